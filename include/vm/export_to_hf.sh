#!/usr/bin/env bash
# Tutorial step 5: convert the final MaxText checkpoint back to Hugging Face format.
# Safe to run twice: the export is rewritten from the same checkpoint.
# Usage: export_to_hf.sh WORK_DIR CHECKPOINT_PATH OUTPUT_DIR [MAXTEXT_ARG...]   (HF token on stdin or in HF_TOKEN)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
work_dir=$(resolve_dir "$1")
checkpoint_path=$2
output_dir=${3%/}
shift 3
read_hf_token

if [ ! -d "$checkpoint_path" ]; then
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
