"""Publish MaxText's text-only Gemma 3 export as the text model it is (run by export_to_hf.sh).

Usage: python3 text_only_export.py EXPORT_DIR

MaxText 0.2.2's to_huggingface with use_multimodal=False writes config.json for
Gemma3ForConditionalGeneration (text_config and vision_config: hf_model_configs.py
gemma3_4b_config) but only the language model's tensors, named model.language_model.*
(checkpoint_conversion/utils/param_mapping.py, GEMMA3_MAXTEXT_TO_HF_PARAM_MAPPING); the
vision encoder's are skipped (to_huggingface.py). transformers then builds the vision tower and
projector at random and reports them missing. So an export whose config is Gemma 3's multimodal
one and whose files hold no vision or projector tensor becomes Gemma 3's text model,
Gemma3ForCausalLM: config.json is the text config, and every model.language_model.X is renamed
model.X (in each safetensors header and in the index's weight_map), the names
Gemma3ForCausalLM loads. An export with vision tensors, or any other model's, is left as it is.

A file of its own rather than a heredoc in export_to_hf.sh: it is the longest step of that
script, and tests run it alone. Standard library only (neither torch nor safetensors needed):
a safetensors file is an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, data_offsets relative to the data's start; "__metadata__" optional),
then the data, so renaming rewrites the header and copies the data bytes unchanged. Each file
is written beside itself and renamed over it; config.json goes last, so a run stopped half way
is finished by the next one (a renamed tensor is left alone). Safe to run twice.
"""

import json
import os
import shutil
import struct
import sys
from pathlib import Path

MULTIMODAL_ARCHITECTURE = "Gemma3ForConditionalGeneration"
TEXT_ARCHITECTURE = "Gemma3ForCausalLM"
TEXT_MODEL_TYPE = "gemma3_text"
LANGUAGE_MODEL_PREFIX = "model.language_model."
TEXT_PREFIX = "model."
# The tensors only a multimodal Gemma 3 has: the vision tower and the projector (param_mapping.py's
# names, and transformers' older top-level ones).
VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")
# Top-level fields of the multimodal config that the text model keeps: the dtype, and the token
# ids generation stops on (its eos_token_id [1, 106] ends a chat turn; the text config says 1).
KEPT_TOP_LEVEL_FIELDS = ("dtype", "torch_dtype", "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TEMP_SUFFIX = ".text-only-tmp"  # a file being written; a leftover of a killed run is removed first
COPY_CHUNK = 16 << 20  # data is streamed: a real shard is up to 3 GiB


def read_header(path):
    """(header dict, offset of the data) of a safetensors file."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length)), 8 + length


def renamed(name):
    return TEXT_PREFIX + name[len(LANGUAGE_MODEL_PREFIX):] if name.startswith(LANGUAGE_MODEL_PREFIX) else name


def rename_all(names):
    """{old: new} for every name, refusing two names that would become one."""
    mapping = {name: renamed(name) for name in names}
    if len(set(mapping.values())) != len(mapping):
        clashes = sorted(name for name in mapping if mapping[name] != name and mapping[name] in mapping)
        sys.exit(f"text_only_export: renaming would merge tensors, e.g. {clashes[:3]}")
    return mapping


def replace_file(path, write):
    """Write path's new content with write(file) to a file beside it, then rename it over path."""
    temp = path.with_name(path.name + TEMP_SUFFIX)
    try:
        with open(temp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def write_json(path, value):
    replace_file(path, lambda f: f.write((json.dumps(value, indent=2, sort_keys=True) + "\n").encode()))


def rename_tensors(path, header, data_start):
    """Rewrite one safetensors file with its tensors renamed; the data is copied as it is."""
    mapping = rename_all(name for name in header if name != "__metadata__")
    new_header = {mapping.get(name, name): value for name, value in header.items()}
    encoded = json.dumps(new_header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # as safetensors writes it: padded with spaces to 8 bytes

    def write(out):
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        with open(path, "rb") as source:
            source.seek(data_start)
            shutil.copyfileobj(source, out, COPY_CHUNK)

    replace_file(path, write)


def text_config(config):
    text = dict(config["text_config"])
    text.update({field: config[field] for field in KEPT_TOP_LEVEL_FIELDS if field in config})
    text["architectures"] = [TEXT_ARCHITECTURE]
    text["model_type"] = TEXT_MODEL_TYPE
    return text


def main(folder):
    for leftover in folder.glob("*" + TEMP_SUFFIX):
        leftover.unlink()
    config = json.loads((folder / "config.json").read_text())
    if config.get("architectures") != [MULTIMODAL_ARCHITECTURE] or not isinstance(config.get("text_config"), dict):
        print(f"Architecture: {', '.join(config.get('architectures') or ['not named'])}, left as it is")
        return
    index = folder / INDEX_FILE
    index_json = json.loads(index.read_text()) if index.exists() else None
    weight_map = index_json["weight_map"] if index_json else None
    files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
    headers = {name: read_header(folder / name) for name in files}
    names = [name for header, _ in headers.values() for name in header if name != "__metadata__"]
    vision = [name for name in names if name.startswith(VISION_PREFIXES)]
    if vision:
        print(f"Architecture: {MULTIMODAL_ARCHITECTURE}, left as it is ({len(vision)} vision and projector tensors)")
        return
    for name, (header, data_start) in headers.items():
        if any(renamed(tensor) != tensor for tensor in header):
            rename_tensors(folder / name, header, data_start)
    if weight_map and any(renamed(tensor) != tensor for tensor in weight_map):
        mapping = rename_all(weight_map)
        index_json["weight_map"] = {mapping[tensor]: shard for tensor, shard in weight_map.items()}
        write_json(index, index_json)
    write_json(folder / "config.json", text_config(config))
    print(
        f"Architecture: {TEXT_ARCHITECTURE} (text only: the export has no vision tower or projector; "
        f"{len(names)} tensors named {TEXT_PREFIX}*, config.json its text config)"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
