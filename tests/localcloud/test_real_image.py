"""The local cloud's "real" image: real MaxText 0.2.2 and toy inputs made locally.

The first test of a session builds the image if the cache lacks it (~2 min, ~6.5 GB); with the
image cached, the whole module takes seconds. The MaxText commands themselves run in the DAG's
end-to-end test on this image, not here.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest

from localcloud import images

pytestmark = pytest.mark.real_maxtext

TOY_DIMS = {"base_emb_dim": 64, "base_mlp_dim": 128, "base_num_query_heads": 2, "base_num_kv_heads": 1,
            "head_dim": 32}
GEMMA3_4B_LAYERS = 34
GEMMA3_VOCAB = 262144


@pytest.fixture(scope="session")
def real_image() -> Path:
    return images.build_real_image()


@pytest.fixture(scope="session")
def image_python(real_image) -> str:
    return str(real_image / "maxtext_venv" / "bin" / "python3")


def run_image_python(python: str, code: str) -> dict:
    """Run code in the image venv (its start-up hook included); it prints one JSON line."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "HF_TOKEN")}
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor shapes from a safetensors header (8-byte little-endian length, then JSON)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {name: info["shape"] for name, info in header.items() if name != "__metadata__"}


@pytest.fixture
def vm_home(real_image):
    """A VM user's home made as the emulator makes it (cp -a of skel/), owned by `nobody` when
    running as root, so the checks run unprivileged."""
    home = Path(tempfile.mkdtemp(prefix="real-image-home-"))
    home.chmod(0o755)
    subprocess.run(["cp", "-a", f"{real_image / 'skel'}/.", str(home)], check=True)
    user = None
    if os.geteuid() == 0 and shutil.which("runuser"):
        user = pwd.getpwnam("nobody")
        subprocess.run(["chown", "-hR", f"{user.pw_uid}:{user.pw_gid}", str(home)], check=True)
    yield home, user
    shutil.rmtree(home, ignore_errors=True)


def test_image_is_cached_under_its_recipe(real_image):
    assert real_image.name == f"real-{images.real_recipe()[:16]}"
    assert images.build_real_image() == real_image  # reused, not rebuilt
    meta = json.loads((real_image / "image.json").read_text())
    assert meta["kind"] == "real" and meta["recipe"] == images.real_recipe()


def test_recipe_covers_locks_generator_and_hook(monkeypatch, tmp_path):
    before = images.real_recipe()
    copies = []
    for source in images._real_files():
        shutil.copyfile(source, tmp_path / source.name)
        copies.append(tmp_path / source.name)
    monkeypatch.setattr(images, "RECIPES_DIR", tmp_path)
    monkeypatch.setattr(images, "_real_files", lambda: copies)
    assert images.real_recipe() == before  # same names and contents, same recipe
    for copy in copies:
        original = copy.read_bytes()
        copy.write_bytes(original + b"\n# changed\n")
        assert images.real_recipe() != before, copy.name
        copy.write_bytes(original)
    monkeypatch.setattr(images, "REAL_BUILDER_VERSION", images.REAL_BUILDER_VERSION + 1)
    assert images.real_recipe() != before


def test_skel_links_the_venv_instead_of_copying_it(real_image):
    link = real_image / "skel" / "maxtext_venv"
    assert link.is_symlink()
    target = Path(os.readlink(link))
    assert target.is_absolute() and target == real_image / "maxtext_venv"
    assert sorted(path.name for path in (real_image / "skel").iterdir()) == ["maxtext_venv"]


def test_vm_user_gets_maxtext_022_through_the_skel_symlink(vm_home):
    home, user = vm_home
    assert (home / "maxtext_venv").is_symlink()
    # What install_maxtext.sh checks, and how the step scripts activate the venv.
    script = (
        'source ~/maxtext_venv/bin/activate && python3 -c "'
        "import importlib.metadata as m, json, os, sys; "
        "print(json.dumps({'maxtext': m.version('maxtext'), 'prefix': sys.prefix, "
        "'offline': os.environ.get('HF_HUB_OFFLINE'), 'hub_cache': os.environ.get('HF_HUB_CACHE')}))\""
        ' && ~/maxtext_venv/bin/python -c "import importlib.metadata as m; print(m.version(\'maxtext\'))"'
    )
    env = ["env", "-i", f"HOME={home}", "PATH=/usr/bin:/bin"]
    command = ["runuser", "-u", user.pw_name, "--", *env] if user else env
    result = subprocess.run([*command, "bash", "-c", script], capture_output=True, text=True, timeout=120, cwd=home)
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.strip().splitlines()[-2:]
    report = json.loads(first)
    assert report["maxtext"] == "0.2.2" and second == "0.2.2"
    assert report["prefix"].endswith("/maxtext_venv")
    assert report["offline"] == "1"
    assert Path(report["hub_cache"]).is_dir()


def test_everything_is_world_readable(real_image):
    for path in [real_image / "toy" / "toy.json", real_image / "toy" / "model" / "model.safetensors",
                 real_image / "maxtext_venv" / "pyvenv.cfg"]:
        assert path.stat().st_mode & 0o004, path
    assert (real_image / "maxtext_venv" / "bin" / "python3").resolve() == Path(images.SYSTEM_PYTHON).resolve()


def test_venv_holds_exactly_the_locked_packages(image_python):
    locked = {}
    for lock in (images.REAL_LOCK, images.REAL_WHEEL_LOCK):
        for name, version in re.findall(r"^([A-Za-z0-9._-]+)==(\S+)", lock.read_text(), re.MULTILINE):
            locked[re.sub(r"[-_.]+", "-", name).lower()] = version
    installed = run_image_python(image_python, (
        "import importlib.metadata as m, json, re; "
        "print(json.dumps({re.sub(r'[-_.]+', '-', d.metadata['Name']).lower(): d.version "
        "for d in m.distributions()}))"))
    assert installed == locked
    assert installed["maxtext"] == "0.2.2" and installed["torch"] == "2.13.0+cpu"
    assert not [name for name in installed if re.match(r"(nvidia-|cuda-|libtpu$|torchvision$)", name)]


def test_toy_model_is_gemma3_4b_shaped(real_image):
    toy = json.loads((real_image / "toy" / "toy.json").read_text())
    assert toy["maxtext_dims"] == TOY_DIMS
    config = json.loads((real_image / "toy" / "model" / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"]
    text = config["text_config"]
    assert text["num_hidden_layers"] == toy["num_hidden_layers"] == GEMMA3_4B_LAYERS
    assert text["vocab_size"] == GEMMA3_VOCAB
    assert (text["hidden_size"], text["intermediate_size"], text["num_attention_heads"],
            text["num_key_value_heads"], text["head_dim"]) == (64, 128, 2, 1, 32)

    shapes = safetensors_shapes(real_image / "toy" / "model" / "model.safetensors")
    embed = next(shape for name, shape in shapes.items() if name.endswith("embed_tokens.weight"))
    assert embed == [GEMMA3_VOCAB, 64]
    layers = {int(m.group(1)) for name in shapes if (m := re.search(r"language_model\..*layers\.(\d+)\.", name))}
    assert layers == set(range(GEMMA3_4B_LAYERS))
    q_proj = next(shape for name, shape in shapes.items() if re.search(r"language_model\..*layers\.0\.self_attn\.q_proj", name))
    k_proj = next(shape for name, shape in shapes.items() if re.search(r"language_model\..*layers\.0\.self_attn\.k_proj", name))
    assert q_proj == [2 * 32, 64] and k_proj == [1 * 32, 64]


def test_toy_json_names_datasets_and_extra_args(real_image):
    toy = json.loads((real_image / "toy" / "toy.json").read_text())
    dims = ["override_model_config=True", "base_emb_dim=64", "base_mlp_dim=128", "base_num_query_heads=2",
            "base_num_kv_heads=1", "head_dim=32"]
    assert toy["extra_args"] == {
        "convert": ["--simulated_cpu_devices_count=1", *dims],
        "train": ["attention=dot_product", "skip_jax_distributed_system=true", "max_target_length=256", *dims],
        "export": ["skip_jax_distributed_system=true", *dims],
    }
    for folder in toy["datasets"].values():
        assert (real_image / "toy" / folder / "data" / "train_sft-00000-of-00001.parquet").is_file()


def test_hub_cache_serves_gemma_3_4b_it_offline(real_image):
    repo = real_image / "toy" / "hf_home" / "hub" / "models--google--gemma-3-4b-it"
    revision = (repo / "refs" / "main").read_text().strip()
    snapshot = repo / "snapshots" / revision
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json", "model.safetensors"):
        assert (snapshot / name).is_file(), name
    assert (snapshot / "config.json").read_bytes() == (real_image / "toy" / "model" / "config.json").read_bytes()
    assert "<start_of_turn>" in (real_image / "toy" / "tokenizer" / "chat_template.jinja").read_text()


def test_tokenizer_and_shrunk_maxtext_config_in_the_venv(image_python):
    # The start-up hook makes MaxText's hard-coded gemma3-4b HF config describe the toy model.
    # The module is loaded through the hook's own finder, skipping `import maxtext` (12 s of JAX
    # and TensorFlow imports); the image build checks the plain import.
    report = run_image_python(image_python, """
import importlib.util, json, sys, sysconfig, toy_site
from transformers import AutoTokenizer
utils = sysconfig.get_paths()["purelib"] + "/maxtext/checkpoint_conversion/utils"
assert any(isinstance(finder, toy_site._PatchingFinder) for finder in sys.meta_path)
spec = toy_site._PatchingFinder().find_spec(toy_site.CONFIGS_MODULE, [utils])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
HF_MODEL_CONFIGS = module.HF_MODEL_CONFIGS
tok = AutoTokenizer.from_pretrained("google/gemma-3-4b-it")
chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
text = HF_MODEL_CONFIGS["gemma3-4b"].text_config
print(json.dumps({
    "size": len(tok),
    "rendered": tok.apply_chat_template(chat, tokenize=False),
    "prompt": tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True),
    "hf": [text.hidden_size, text.intermediate_size, text.num_attention_heads, text.num_key_value_heads,
           text.head_dim, text.num_hidden_layers, text.vocab_size],
}))
""")
    assert report["size"] == GEMMA3_VOCAB
    assert report["rendered"] == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
    assert report["prompt"] == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert report["hf"] == [64, 128, 2, 1, 32, GEMMA3_4B_LAYERS, GEMMA3_VOCAB]


def test_the_export_shards_the_toy_weights_like_a_4b_export(image_python):
    # MaxText shards an export above 3 GiB; the hook lowers that threshold for the toy weights,
    # through the default argument save_model_files relies on (a plain import of the module).
    report = run_image_python(image_python, """
import json, numpy as np, toy_site
from maxtext.checkpoint_conversion.utils import utils
table = np.zeros((262144, 64), np.float16)  # the toy embedding table's size in bf16
layer = np.zeros((64, 128), np.float16)
weights = {"embed": table, **{f"layers.{i}": layer for i in range(200)}}
shards, index = utils.shard_checkpoint(weights)
print(json.dumps({"shards": sorted(shards), "named": sorted(set(index["weight_map"].values())),
                  "threshold": utils.DEFAULT_MAX_SHARD_SIZE, "toy": toy_site.TOY_MAX_SHARD_SIZE}))
""")
    assert report["threshold"] == report["toy"] < 3 * 1024**3
    assert len(report["shards"]) >= 3 and report["named"] == report["shards"]
    assert report["shards"][0] == f"model-00001-of-{len(report['shards']):05d}.safetensors"


def test_chat_datasets_in_ultrachat_layout(real_image, image_python):
    datasets = real_image / "toy" / "datasets"
    files = {name: datasets / name / "data" / "train_sft-00000-of-00001.parquet"
             for name in ("ultrachat_200k", "ultrachat_small")}
    report = run_image_python(image_python, f"""
import json, pyarrow.parquet as pq
files = {json.dumps({name: str(path) for name, path in files.items()})}
out = {{}}
for name, path in files.items():
    table = pq.read_table(path)
    first = table.column("messages")[0].as_py()
    out[name] = {{"rows": table.num_rows, "columns": table.column_names, "roles": [m["role"] for m in first]}}
print(json.dumps(out))
""")
    assert report["ultrachat_200k"]["rows"] >= 400
    assert report["ultrachat_small"]["rows"] < 40
    for entry in report.values():
        assert "messages" in entry["columns"]
        assert entry["roles"][0] == "user" and entry["roles"][1] == "assistant"
