"""include/vm/text_only_export.py: a text-only Gemma 3 export published as Gemma 3's text model.

The files are made here as MaxText 0.2.2's to_huggingface writes them with use_multimodal=False:
a Gemma3ForConditionalGeneration config.json, the language model's tensors named
model.language_model.* (param_mapping.py), sharded with an index or in one model.safetensors.
That transformers loads the result with no weight missing is shown on the real export
(tests/dags/test_pipeline_real_maxtext.py); here, what the script does to the files.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from maxtext_sft.vm.steps import script_files, vm_scripts_dir

SCRIPT = vm_scripts_dir() / "text_only_export.py"
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
# name -> (shard, number of bytes); the embedding alone in the first shard, as MaxText's sorted order puts it
LANGUAGE_MODEL = {
    "model.language_model.embed_tokens.weight": (0, 48),
    "model.language_model.layers.0.self_attn.q_proj.weight": (1, 16),
    "model.language_model.layers.0.mlp.down_proj.weight": (1, 24),
    "model.language_model.norm.weight": (1, 8),
}
VISION = {
    "model.vision_tower.vision_model.embeddings.patch_embedding.weight": (1, 16),
    "model.multi_modal_projector.mm_input_projection_weight": (1, 8),
}
TEXT_CONFIG = {
    "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 1, "hidden_activation": "gelu",
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "vocab_size": 262144,
}
MULTIMODAL_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "dtype": "bfloat16",
    "eos_token_id": [1, 106], "image_token_index": 262144, "transformers_version": "5.8.0",
    "text_config": TEXT_CONFIG, "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 16},
}


def write_safetensors(path: Path, tensors: dict[str, bytes]) -> None:
    """A safetensors file as the format defines it, each tensor's bytes given (BF16, 1-d)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, data in tensors.items():
        header[name] = {"dtype": "BF16", "shape": [len(data) // 2], "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(tensors.values()))


def read_safetensors(path: Path) -> tuple[int, dict, dict[str, bytes]]:
    """(header length, header, name -> the tensor's bytes) of a safetensors file."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    data = raw[8 + length :]
    tensors = {name: data[slice(*info["data_offsets"])] for name, info in header.items() if name != "__metadata__"}
    return length, header, tensors


def write_export(folder: Path, layout: str = "sharded", tensors: dict | None = None, config: dict | None = None):
    """An export as to_huggingface writes it; returns {name: bytes} of its tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = tensors or LANGUAGE_MODEL
    content = {name: bytes((i * 7 + j) % 251 for j in range(size)) for i, (name, (_, size)) in enumerate(tensors.items())}
    (folder / "config.json").write_text(json.dumps(config or MULTIMODAL_CONFIG, indent=2))
    (folder / "tokenizer.json").write_text("{}")
    if layout == "single":
        write_safetensors(folder / "model.safetensors", content)
        return content
    for number, shard in enumerate(SHARDS):
        write_safetensors(folder / shard, {n: content[n] for n, (s, _) in tensors.items() if s == number})
    weight_map = {name: SHARDS[shard] for name, (shard, _) in tensors.items()}
    total = sum(size for _, size in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return content


def run(folder: Path) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), str(folder)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def snapshot(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def text_name(name: str) -> str:
    return "model." + name.removeprefix("model.language_model.")


def test_the_script_is_uploaded_with_the_step_scripts():
    assert script_files()["text_only_export.py"] == SCRIPT.read_bytes()


@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_a_text_only_export_becomes_gemma_3s_text_model_with_its_data_unchanged(tmp_path, layout):
    content = write_export(tmp_path, layout)
    before = snapshot(tmp_path)
    out = run(tmp_path)
    assert "Architecture: Gemma3ForCausalLM (text only" in out

    # config.json: the text config, its architecture named, the multimodal top level's dtype and
    # the token ids generation stops on kept (eos 106, <end_of_turn>, ends a chat turn).
    config = json.loads((tmp_path / "config.json").read_text())
    assert config == {**TEXT_CONFIG, "architectures": ["Gemma3ForCausalLM"], "dtype": "bfloat16",
                      "eos_token_id": [1, 106], "transformers_version": "5.8.0"}
    # Each file: the tensors renamed model.*, the same bytes for each, the header padded to 8.
    files = SHARDS if layout == "sharded" else ["model.safetensors"]
    found = {}
    for name in files:
        length, header, tensors = read_safetensors(tmp_path / name)
        assert length % 8 == 0 and header["__metadata__"] == {"format": "pt"}
        # the data after the header is byte for byte what MaxText wrote
        old_length = struct.unpack("<Q", before[name][:8])[0]
        assert (tmp_path / name).read_bytes()[8 + length :] == before[name][8 + old_length :]
        found.update(tensors)
    assert found == {text_name(name): data for name, data in content.items()}
    if layout == "sharded":
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == {text_name(n): SHARDS[s] for n, (s, _) in LANGUAGE_MODEL.items()}
        assert index["metadata"] == {"total_size": sum(size for _, size in LANGUAGE_MODEL.values())}
    assert (tmp_path / "tokenizer.json").read_bytes() == before["tokenizer.json"]
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(before)  # no file left beside them

    # Run again (export_to_hf.sh run twice): nothing changes.
    after = snapshot(tmp_path)
    assert "Gemma3ForCausalLM, left as it is" in run(tmp_path)
    assert snapshot(tmp_path) == after


def test_a_run_stopped_half_way_is_finished_by_the_next(tmp_path):
    # The first shard already renamed and a half-written file beside it; config.json (written
    # last) still the multimodal one.
    content = write_export(tmp_path)
    run(tmp_path)
    renamed_first = (tmp_path / SHARDS[0]).read_bytes()
    write_export(tmp_path)
    (tmp_path / SHARDS[0]).write_bytes(renamed_first)
    (tmp_path / f"{SHARDS[1]}.text-only-tmp").write_bytes(b"half")
    run(tmp_path)
    assert (tmp_path / SHARDS[0]).read_bytes() == renamed_first  # a renamed shard is left alone
    assert read_safetensors(tmp_path / SHARDS[1])[2] == {
        text_name(n): content[n] for n, (s, _) in LANGUAGE_MODEL.items() if s == 1}
    assert not list(tmp_path.glob("*.text-only-tmp"))
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]


@pytest.mark.parametrize(
    ("tensors", "config", "why"),
    [
        ({**LANGUAGE_MODEL, **VISION}, MULTIMODAL_CONFIG,
         "Gemma3ForConditionalGeneration, left as it is (2 vision and projector tensors)"),
        ({"model.embed_tokens.weight": (0, 48), "model.layers.0.self_attn.q_proj.weight": (1, 16)},
         {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, "Qwen3ForCausalLM, left as it is"),
    ],
    ids=["multimodal-with-vision-tensors", "another-model"],
)
def test_an_export_with_vision_tensors_or_of_another_model_is_left_as_it_is(tmp_path, tensors, config, why):
    write_export(tmp_path, tensors=tensors, config=config)
    before = snapshot(tmp_path)
    assert f"Architecture: {why}" in run(tmp_path)
    assert snapshot(tmp_path) == before


def test_a_large_shard_is_streamed_not_read_whole(tmp_path):
    # A real shard is up to 3 GiB: its data is copied in chunks (16 MiB), so the script's peak
    # memory stays far below a shard of 128 MiB.
    big = {"model.language_model.embed_tokens.weight": (0, 128 << 20), "model.language_model.norm.weight": (1, 8)}
    folder = tmp_path / "export"
    folder.mkdir()
    shard = folder / SHARDS[0]
    with shard.open("wb") as f:  # written in pieces: the test itself need not hold it either
        header = json.dumps({"model.language_model.embed_tokens.weight": {
            "dtype": "BF16", "shape": [64 << 20], "data_offsets": [0, 128 << 20]}}).encode()
        header += b" " * (-len(header) % 8)
        f.write(struct.pack("<Q", len(header)) + header)
        for i in range(128):
            f.write(bytes([i]) * (1 << 20))
    write_safetensors(folder / SHARDS[1], {"model.language_model.norm.weight": b"\x01" * 8})
    (folder / "config.json").write_text(json.dumps(MULTIMODAL_CONFIG))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {name: SHARDS[s] for name, (s, _) in big.items()}}))
    # VmHWM, the process's peak resident memory (ru_maxrss would count the forking test's too).
    measure = (
        "import re, runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__'); "
        "print('peak', re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1))"
    )
    done = subprocess.run([sys.executable, "-c", measure, str(SCRIPT), str(folder)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    peak_kib = int(done.stdout.split("peak ")[-1])
    assert peak_kib < 64 << 10, f"peak memory {peak_kib} KiB for a 128 MiB shard"
    with shard.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        assert list(json.loads(f.read(length))) == ["model.embed_tokens.weight"]
        for i in range(128):
            assert f.read(1 << 20) == bytes([i]) * (1 << 20)
        assert f.read() == b""
