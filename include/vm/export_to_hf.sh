#!/usr/bin/env bash
# Tutorial step 5: convert the final MaxText checkpoint back to Hugging Face format, and with
# UPLOAD_URI (gs://...) upload the result there (next to the run's checkpoints).
# Safe to run twice: the export is rewritten from the same checkpoint and the upload is a sync.
# A text-only Gemma 3 export becomes Gemma 3's text model (text_only_export.py, beside this file).
# Prints "MAXTEXT_SFT_RESULT hf_export=PATH_OR_URI".
# Usage: export_to_hf.sh WORK_DIR CHECKPOINT_PATH OUTPUT_DIR UPLOAD_URI|"" [MAXTEXT_ARG...]
#        (HF token on stdin or in HF_TOKEN)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
work_dir=$(resolve_dir "$1")
note_contact "$work_dir"
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
# A complete export: config.json and either one model.safetensors or, above MaxText's 3 GiB
# shard threshold (Gemma 3 4B always), model.safetensors.index.json with every shard its
# weight_map names; nothing empty. Checked before the upload, so storage never gets half a model.
python3 - "$output_dir" <<'PY'
import json
import sys
from pathlib import Path

folder = Path(sys.argv[1])


def fail(message):
    sys.exit(f"export exited 0 but {message} in {folder}")


def check_non_empty(name, what=""):
    path = folder / name
    if not path.is_file():
        fail(f"wrote no {name}{what}")
    if path.stat().st_size == 0:
        fail(f"wrote an empty {name}{what}")


check_non_empty("config.json")
if (folder / "model.safetensors").exists():
    check_non_empty("model.safetensors")
    print("Weights: model.safetensors")
elif (folder / "model.safetensors.index.json").exists():
    try:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
    except ValueError as error:
        fail(f"wrote a model.safetensors.index.json that is not JSON ({error})")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        fail("wrote a model.safetensors.index.json that names no shard")
    shards = sorted({str(shard) for shard in weight_map.values()})
    for shard in shards:
        check_non_empty(shard, ", a shard named by model.safetensors.index.json")
    print(f"Weights: {len(shards)} shards named by model.safetensors.index.json: {' '.join(shards)}")
else:
    fail("wrote neither model.safetensors nor model.safetensors.index.json")
PY
# A text-only fine-tune of Gemma 3 (use_multimodal=False) is exported as the multimodal model
# without its vision tower: published as Gemma 3's text model instead, config and tensor names
# rewritten here, so storage, the Hub and every loader get the same complete model. After the
# check (it reads the files the check found); before the upload.
python3 "$(dirname "$0")/text_only_export.py" "$output_dir"
echo "Exported Hugging Face model to $output_dir:"
ls -l "$output_dir"
if [ -z "$upload_uri" ]; then
  report_result hf_export "$output_dir"
  exit 0
fi
echo "Uploading the export to $upload_uri"
gcloud storage rsync --recursive --delete-unmatched-destination-objects "$output_dir" "$upload_uri"
report_result hf_export "$upload_uri"
