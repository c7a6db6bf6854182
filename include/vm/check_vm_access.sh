#!/usr/bin/env bash
# The rehearsal's checks from the VM itself: what the run's steps will need to reach from here,
# with the VM's own credentials and network, checked in seconds instead of found out by a failed
# conversion or training on a TPU VM.
#   bucket   a probe object written, read back and deleted under OUTPUT_URI (skipped when "")
#            with gcloud storage, as the VM's service account (what MaxText's checkpoints use)
#   model    a file of the base model at MODEL_REVISION ("" : main) read with the token (a
#            gated model answers 403 until the token's account was granted access)
#   dataset  DATASET_FILE of the dataset at DATASET_REVISION read with the token (skipped when
#            DATASET_ID is "": a folder dataset)
# Each check prints "MAXTEXT_SFT_RESULT <name>=ok: ..." or its error on stderr; the script exits
# 1 when any failed, after running them all. Safe to run twice (the probe has a name of its own).
# Usage: check_vm_access.sh WORK_DIR OUTPUT_URI MODEL_ID MODEL_REVISION DATASET_ID DATASET_REVISION DATASET_FILE
#        (HF token on stdin or in HF_TOKEN; HF_ENDPOINT, if set, is the Hub to ask)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
work_dir=$(resolve_dir "$1")
note_contact "$work_dir"
output_uri=${2%/}
model_id=$3
model_revision=${4:-main}
dataset_id=$5
dataset_revision=${6:-main}
dataset_file=$7
read_hf_token
endpoint=${HF_ENDPOINT:-https://huggingface.co}
failed=0

scratch=$(mktemp -d)  # private (0700): the token's header file lives here
on_exit 'rm -rf "$scratch"'

check_bucket() {
  local probe="$output_uri/.rehearsal-vm-probe-$(hostname)-$$"
  echo "rehearsal $(date -u +%FT%TZ)" >"$scratch/probe"
  if ! gcloud storage cp "$scratch/probe" "$probe" >"$scratch/bucket.log" 2>&1 ||
    ! gcloud storage cat "$probe" >/dev/null 2>>"$scratch/bucket.log" ||
    ! gcloud storage rm "$probe" >>"$scratch/bucket.log" 2>&1; then
    echo "bucket: the VM cannot write, read and delete objects in $output_uri as its service account" \
      "(it needs roles/storage.objectUser on the bucket, and the VM the cloud-platform scope):" >&2
    sed 's/^/  /' "$scratch/bucket.log" >&2
    return 1
  fi
  report_result bucket "ok: wrote, read and deleted a probe in $output_uri as the VM's service account"
}

# HEAD of a Hub file with the token in a header file (never on a command line); prints the HTTP
# status and keeps the Hub's X-Error-Code / X-Error-Message headers for the message.
hub_head() {
  local url=$1
  if [ -n "${HF_TOKEN:-}" ]; then
    printf 'Authorization: Bearer %s\n' "$HF_TOKEN" >"$scratch/auth"
  else
    : >"$scratch/auth"
  fi
  curl --silent --show-error --head --location --max-time 60 --header @"$scratch/auth" \
    --dump-header "$scratch/headers" --output /dev/null --write-out '%{http_code}' "$url" 2>"$scratch/curl.log" ||
    { echo "000"; return 0; }
}

hub_error() {
  grep -i '^x-error-\(code\|message\):' "$scratch/headers" 2>/dev/null | tr -d '\r' | sed 's/^/  /' || true
}

check_hub_file() {
  local name=$1 what=$2 url=$3 status
  status=$(hub_head "$url")
  case "$status" in
    200) report_result "$name" "ok: read $what from the VM with the token" ;;
    000)
      echo "$name: the VM could not reach $endpoint (egress: an external IP or Cloud NAT, and DNS):" >&2
      sed 's/^/  /' "$scratch/curl.log" >&2
      return 1 ;;
    401 | 403)
      echo "$name: the Hub refused $what to this token (HTTP $status): a gated repo needs its access request accepted for the token's account" >&2
      hub_error >&2
      return 1 ;;
    *)
      echo "$name: the Hub answered HTTP $status for $what" >&2
      hub_error >&2
      return 1 ;;
  esac
}

if [ -n "$output_uri" ]; then
  check_bucket || failed=1
fi
check_hub_file model "config.json of $model_id@$model_revision" \
  "$endpoint/$model_id/resolve/$model_revision/config.json" || failed=1
if [ -n "$dataset_id" ]; then
  check_hub_file dataset "$dataset_file of dataset $dataset_id@$dataset_revision" \
    "$endpoint/datasets/$dataset_id/resolve/$dataset_revision/$dataset_file" || failed=1
fi
exit "$failed"
