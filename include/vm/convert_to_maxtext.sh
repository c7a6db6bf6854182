#!/usr/bin/env bash
# Tutorial step 3: convert the Hugging Face checkpoint to MaxText format.
# Skips when OUTPUT_DIR holds a finished conversion (marker written last).
# Usage: convert_to_maxtext.sh WORK_DIR OUTPUT_DIR [MAXTEXT_ARG...]   (HF token on stdin or in HF_TOKEN)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
work_dir=$(resolve_dir "$1")
output_dir=${2%/}
shift 2
read_hf_token
marker="$output_dir/.maxtext-sft-converted"

if [ -f "$marker" ]; then
  echo "Checkpoint already converted in $output_dir; nothing to do"
  exit 0
fi
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
