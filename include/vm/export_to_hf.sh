#!/usr/bin/env bash
# Tutorial step 5: convert the final MaxText checkpoint back to Hugging Face format, and with
# UPLOAD_URI (gs://...) upload the result there (next to the run's checkpoints).
# Safe to run twice: the export is rewritten from the same checkpoint and the upload is a sync.
# Prints "MAXTEXT_SFT_RESULT hf_export=PATH_OR_URI".
# Usage: export_to_hf.sh WORK_DIR CHECKPOINT_PATH OUTPUT_DIR UPLOAD_URI|"" [MAXTEXT_ARG...]
#        (HF token on stdin or in HF_TOKEN)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
work_dir=$(resolve_dir "$1")
checkpoint_path=${2%/}
output_dir=${3%/}
upload_uri=${4%/}
shift 4
read_hf_token

if ! checkpoint_committed "${checkpoint_path%/model_params}"; then
  echo "no checkpoint at $checkpoint_path" >&2
  exit 1
fi
activate_maxtext_venv "$work_dir"
python3 -m maxtext.checkpoint_conversion.to_huggingface "$@"
for file in config.json model.safetensors; do
  if [ ! -f "$output_dir/$file" ]; then
    echo "export exited 0 but wrote no $output_dir/$file" >&2
    exit 1
  fi
done
echo "Exported Hugging Face model to $output_dir:"
ls -l "$output_dir"
if [ -z "$upload_uri" ]; then
  report_result hf_export "$output_dir"
  exit 0
fi
echo "Uploading the export to $upload_uri"
gcloud storage rsync --recursive --delete-unmatched-destination-objects "$output_dir" "$upload_uri"
report_result hf_export "$upload_uri"
