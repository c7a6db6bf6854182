#!/usr/bin/env bash
# Tutorial step 3: convert the Hugging Face checkpoint to MaxText format, into OUTPUT_DIR (the
# converter's base_output_directory: a folder on the VM, or gs://).
# Safe to run twice: a finished conversion in OUTPUT_DIR is kept (Orbax publishes a checkpoint
# by renaming it into place on a disk, and by writing commit_success.txt last on GCS).
#
# With CACHE_URI (gs://.../base-checkpoints/MODEL/KEY, KEY naming model, revision, MaxText
# version and conversion flags; OUTPUT_DIR is then CACHE_URI/attempts/RUN_NAME/), conversions
# are shared between runs:
#   - CACHE_URI/COMPLETE.json exists: another run converted this key; use it, convert nothing;
#   - otherwise convert into OUTPUT_DIR, then create COMPLETE.json only if it does not exist yet
#     (a generation-0 precondition): the marker is written last and only once, so a reader
#     never sees half a conversion and two concurrent runs agree on one.
# Prints "MAXTEXT_SFT_RESULT base_checkpoint=PATH": what train_sft loads.
# Usage: convert_to_maxtext.sh WORK_DIR OUTPUT_DIR CACHE_URI|"" [MAXTEXT_ARG...]
#        (HF token on stdin or in HF_TOKEN)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
work_dir=$(resolve_dir "$1")
note_contact "$work_dir"
output_dir=${2%/}
cache_uri=${3%/}
shift 3
read_hf_token

# The items path recorded in a cache marker; fails when there is no marker.
published_items() {
  local marker
  marker=$(gcloud storage cat "$1" 2>/dev/null) || return 1
  python3 -c 'import json, sys; print(json.loads(sys.argv[1])["items"])' "$marker"
}

if [ -n "$cache_uri" ] && items=$(published_items "$cache_uri/COMPLETE.json"); then
  echo "This base checkpoint was converted before: $items ($cache_uri/COMPLETE.json); skipping conversion"
  report_result base_checkpoint "$items"
  exit 0
fi

# What OUTPUT_DIR/0 holds: "committed" (a finished conversion), "partial" (what an interrupted
# one left) or "empty". On GCS one listing tells the three apart (each gcloud call costs about a
# second of CPU); a listing that fails counts as partial, so the removal is still tried.
conversion_state() {
  local names
  case "$1" in
    gs://*)
      if ! names=$(gcloud storage objects list "$1/0/**" --format='value(name)' 2>/dev/null); then
        echo partial
      elif printf '%s\n' "$names" | grep -qxF -- "$(object_name "$1/0/items/commit_success.txt")"; then
        echo committed
      elif [ -n "$names" ]; then
        echo partial
      else
        echo empty
      fi ;;
    *)
      if checkpoint_committed "$1/0/items"; then echo committed
      elif [ -e "$1/0" ]; then echo partial
      else echo empty
      fi ;;
  esac
}

# The object name in a gs://BUCKET/NAME URI.
object_name() {
  local path=${1#gs://}
  printf '%s\n' "${path#*/}"
}

state=$(conversion_state "$output_dir")
if [ "$state" = committed ]; then
  echo "Checkpoint already converted in $output_dir"
else
  # What an interrupted conversion left is not reused.
  if [ "$state" = partial ]; then
    case "$output_dir" in
      gs://*) gcloud storage rm --recursive "$output_dir/0" >/dev/null 2>&1 || true ;;
      *) rm -rf -- "${output_dir:?}/0" ;;
    esac
  fi
  activate_maxtext_venv "$work_dir"
  make_gcs_folder "$output_dir"
  python3 -m maxtext.checkpoint_conversion.to_maxtext "$@"
  if ! checkpoint_committed "$output_dir/0/items"; then
    echo "conversion exited 0 but left no complete checkpoint in $output_dir/0/items" >&2
    exit 1
  fi
  echo "Converted checkpoint: $output_dir/0/items"
fi

if [ -z "$cache_uri" ]; then
  report_result base_checkpoint "$output_dir/0/items"
  exit 0
fi

record=$(mktemp)
on_exit 'rm -f "$record"'
python3 -c '
import datetime, json, sys
items, *flags = sys.argv[1:]
print(json.dumps({"items": items, "conversion_flags": flags,
                  "converted_at": datetime.datetime.now(datetime.timezone.utc).isoformat()}))
' "$output_dir/0/items" "$@" >"$record"
if gcloud storage cp --if-generation-match=0 "$record" "$cache_uri/COMPLETE.json"; then
  items="$output_dir/0/items"
  echo "Published the conversion: $cache_uri/COMPLETE.json"
elif items=$(published_items "$cache_uri/COMPLETE.json"); then
  echo "Another run published this conversion first ($items); removing ours"
  gcloud storage rm --recursive "$output_dir" || true
else
  echo "could not publish $cache_uri/COMPLETE.json, and it does not exist" >&2
  exit 1
fi
report_result base_checkpoint "$items"
