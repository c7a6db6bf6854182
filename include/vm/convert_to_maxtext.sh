#!/usr/bin/env bash
# Tutorial step 3: convert the Hugging Face checkpoint to MaxText format.
# Safe to run twice: skips when OUTPUT_DIR holds a finished conversion (marker written last).
#
# With CACHE_URI (gs://.../base-checkpoints/MODEL/KEY, KEY naming model, revision, MaxText
# version and conversion flags), converted checkpoints are shared between runs:
#   - CACHE_URI/COMPLETE.json exists: another run converted this key; use it, convert nothing;
#   - otherwise convert, upload to CACHE_URI/attempts/RUN_NAME/, then create COMPLETE.json only
#     if it does not exist yet (a generation-0 precondition): the marker is written last and
#     only once, so a reader never sees half a conversion and two concurrent runs agree on one.
# Prints "MAXTEXT_SFT_RESULT base_checkpoint=PATH": what train_sft loads.
# Usage: convert_to_maxtext.sh WORK_DIR OUTPUT_DIR CACHE_URI|"" RUN_NAME [MAXTEXT_ARG...]
#        (HF token on stdin or in HF_TOKEN)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
work_dir=$(resolve_dir "$1")
output_dir=${2%/}
cache_uri=${3%/}
run_name=$4
shift 4
read_hf_token
marker="$output_dir/.maxtext-sft-converted"

# The items path recorded in a cache marker; fails when there is no marker.
published_items() {
  gcloud storage cat "$1" 2>/dev/null | python3 -c 'import json, sys; print(json.load(sys.stdin)["items"])'
}

if [ -n "$cache_uri" ] && items=$(published_items "$cache_uri/COMPLETE.json"); then
  echo "This base checkpoint was converted before: $items ($cache_uri/COMPLETE.json); skipping conversion"
  report_result base_checkpoint "$items"
  exit 0
fi

if [ -f "$marker" ]; then
  echo "Checkpoint already converted in $output_dir"
else
  # A step folder left by an interrupted conversion is not reused.
  rm -rf -- "${output_dir:?}/0"
  activate_maxtext_venv "$work_dir"
  python3 -m maxtext.checkpoint_conversion.to_maxtext "$@"
  if [ ! -d "$output_dir/0/items" ]; then
    echo "conversion exited 0 but wrote no $output_dir/0/items" >&2
    exit 1
  fi
  touch "$marker"
  echo "Converted checkpoint: $output_dir/0/items"
fi

if [ -z "$cache_uri" ]; then
  report_result base_checkpoint "$output_dir/0/items"
  exit 0
fi

attempt="$cache_uri/attempts/$run_name"
echo "Uploading the conversion to $attempt"
gcloud storage rsync --recursive --delete-unmatched-destination-objects \
  --exclude='^\.maxtext-sft-converted$' "$output_dir" "$attempt"
record=$(mktemp)
trap 'rm -f "$record"' EXIT
python3 - "$attempt/0/items" "$run_name" "$@" >"$record" <<'PY'
import datetime, json, sys
items, run_name, *flags = sys.argv[1:]
print(json.dumps({"items": items, "converted_by": run_name, "conversion_flags": flags,
                  "converted_at": datetime.datetime.now(datetime.timezone.utc).isoformat()}))
PY
if gcloud storage cp --if-generation-match=0 "$record" "$cache_uri/COMPLETE.json"; then
  items="$attempt/0/items"
  echo "Published the conversion: $cache_uri/COMPLETE.json"
elif items=$(published_items "$cache_uri/COMPLETE.json"); then
  echo "Another run published this conversion first ($items); removing ours"
  gcloud storage rm --recursive "$attempt" || true
else
  echo "could not publish $cache_uri/COMPLETE.json, and it does not exist" >&2
  exit 1
fi
report_result base_checkpoint "$items"
