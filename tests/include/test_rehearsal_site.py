"""include/rehearsal/sitecustomize.py, the kit's MaxText patches, against a small stand-in of the
two MaxText modules it patches (the real ones: tests/include/test_prepare_rehearsal.py and the
real-MaxText pipeline test)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO

SITE_SOURCE = REPO / "include" / "rehearsal" / "sitecustomize.py"

# MaxText's layout, with only what the patches touch; the numbers are gemma3-4b's.
CONFIGS = textwrap.dedent(
    """\
    from types import SimpleNamespace as N
    HF_MODEL_CONFIGS = {"gemma3-4b": N(
        text_config=N(hidden_size=2560, intermediate_size=10240, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=256, query_pre_attn_scalar=256, num_hidden_layers=34, vocab_size=262144),
        vision_config=N(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                        image_size=896, patch_size=14),
        mm_tokens_per_image=256)}
    """
)
UTILS = textwrap.dedent(
    """\
    DEFAULT_MAX_SHARD_SIZE = 3 * 1024**3
    def shard_checkpoint(weights, max_shard_size=DEFAULT_MAX_SHARD_SIZE, weights_name="model.safetensors"):
        return max_shard_size
    """
)
TOY = {
    "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
                    "head_dim": 32, "query_pre_attn_scalar": 32, "num_hidden_layers": 34, "vocab_size": 262144},
    "vision_config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                      "image_size": 56, "patch_size": 14},
    "mm_tokens_per_image": 4,
}
READ_BOTH = (
    "import json; from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS as c; "
    "from maxtext.checkpoint_conversion.utils import utils; g = c['gemma3-4b']; "
    "print(json.dumps({'text': vars(g.text_config), 'vision': vars(g.vision_config), 'mm': g.mm_tokens_per_image, "
    "'default': utils.shard_checkpoint({}), 'constant': utils.DEFAULT_MAX_SHARD_SIZE}))"
)


@pytest.fixture
def kit(tmp_path) -> Path:
    """KIT/site/sitecustomize.py and KIT/model/config.json, and the MaxText stand-in in packages/."""
    kit = tmp_path / "rehearsal-kit"
    (kit / "site").mkdir(parents=True)
    shutil.copy(SITE_SOURCE, kit / "site" / "sitecustomize.py")
    (kit / "model").mkdir()
    (kit / "model" / "config.json").write_text(json.dumps(TOY))
    utils = tmp_path / "packages" / "maxtext" / "checkpoint_conversion" / "utils"
    utils.mkdir(parents=True)
    for package in (utils, utils.parent, utils.parent.parent):
        (package / "__init__.py").write_text("")
    (utils / "hf_model_configs.py").write_text(CONFIGS)
    (utils / "utils.py").write_text(UTILS)
    return kit


def run(kit: Path, code: str) -> subprocess.CompletedProcess:
    pythonpath = f"{kit / 'site'}:{kit.parent / 'packages'}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath})


def test_maxtexts_gemma3_4b_config_gets_the_kit_models_widths(kit):
    result = run(kit, READ_BOTH)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["text"] == TOY["text_config"]
    assert report["vision"] == TOY["vision_config"]
    assert report["mm"] == TOY["mm_tokens_per_image"]


def test_the_export_shards_above_one_mib_through_the_default_argument(kit):
    report = json.loads(run(kit, READ_BOTH).stdout)
    assert report["default"] == report["constant"] == 1024 * 1024


def test_a_changed_shard_checkpoint_fails_loudly(kit):
    utils = kit.parent / "packages" / "maxtext" / "checkpoint_conversion" / "utils" / "utils.py"
    utils.write_text("DEFAULT_MAX_SHARD_SIZE = 3 * 1024**3\ndef shard_checkpoint(weights, max_shard_size=None):\n    pass\n")
    result = run(kit, "from maxtext.checkpoint_conversion.utils import utils")
    assert result.returncode != 0 and "shard_checkpoint changed" in result.stderr


def test_a_kit_without_its_model_config_says_so(kit):
    (kit / "model" / "config.json").unlink()
    result = run(kit, "from maxtext.checkpoint_conversion.utils import hf_model_configs")
    assert result.returncode != 0 and f"no toy model config at {kit / 'model' / 'config.json'}" in result.stderr


def test_under_another_name_it_patches_only_once_installed_and_the_last_install_wins(kit, tmp_path):
    """How the local cloud's image uses the same code for its own toy: imported as a module,
    install()ed with that toy's config; a later install (the kit's sitecustomize) replaces it."""
    other = tmp_path / "other" / "model" / "config.json"
    other.parent.mkdir(parents=True)
    other.write_text(json.dumps({**TOY, "text_config": {**TOY["text_config"], "hidden_size": 96}}))
    module = tmp_path / "patches.py"  # a copy: loading writes __pycache__ beside the file
    shutil.copy(SITE_SOURCE, module)
    code = textwrap.dedent(
        f"""
        import importlib.util, json, sys
        spec = importlib.util.spec_from_file_location("patches", {str(module)!r})
        patches = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(patches)
        def ours():
            return [str(f.model_config) for f in sys.meta_path if getattr(f, "maxtext_rehearsal_patches", False) is True]
        before = ours()
        patches.install(patches.PatchingFinder({str(kit / 'model' / 'config.json')!r}))
        patches.install(patches.PatchingFinder({str(other)!r}))
        from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS
        print(json.dumps({{"before": before, "after": ours(),
                          "hidden": HF_MODEL_CONFIGS["gemma3-4b"].text_config.hidden_size}}))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(kit.parent / "packages")})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"before": [], "after": [str(other)], "hidden": 96}
