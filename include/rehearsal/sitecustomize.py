"""Start-up hook of the rehearsal kit: MaxText's gemma3-4b converters at the toy model's size.

Lives at KIT/site/sitecustomize.py (prepare_rehearsal.sh copies it there). lib.sh's
activate_maxtext_venv puts KIT/site first on PYTHONPATH when the kit exists, and Python's site
module imports `sitecustomize` at every interpreter start. PYTHONPATH entries come before the
standard library on sys.path, so this file wins over a distribution's own sitecustomize.py
(Debian's and Ubuntu's only install the apport crash hook, which is then not installed).

It changes two things in MaxText, each right after the module is first executed:
1. `HF_MODEL_CONFIGS["gemma3-4b"]` (maxtext.checkpoint_conversion.utils.hf_model_configs) gets
   the toy model's widths from KIT/model/config.json. The converters map shapes from that
   hard-coded config, and to_huggingface writes it as the export's config.json, so it must
   describe the toy checkpoint, not the real 4B model. Read from the toy's own config, the two
   cannot disagree.
2. The export's shard threshold (maxtext.checkpoint_conversion.utils.utils: shard_checkpoint,
   DEFAULT_MAX_SHARD_SIZE, 3 GiB) drops to TOY_MAX_SHARD_SIZE. Gemma 3 4B (about 8.6 GB) is
   always exported as model-0000N-of-0000M.safetensors plus model.safetensors.index.json; the
   toy weights (about 36 MB) would fit one file. Lowered, the toy export is sharded too, so the
   pipeline reads the layout a real run writes.
And, as the kit's sitecustomize only, JAX_PLATFORMS defaults to cpu (see the end of this file).

Imported under another name (the local cloud's image does, for its own toy), it only defines
PatchingFinder and install(); nothing happens until install() is called.
"""

import importlib.abc
import importlib.machinery
import json
import os
import sys
from pathlib import Path

CONFIGS_MODULE = "maxtext.checkpoint_conversion.utils.hf_model_configs"
CONVERSION_UTILS_MODULE = "maxtext.checkpoint_conversion.utils.utils"
MODEL_KEY = "gemma3-4b"
# The toy embedding table alone is 32 MiB (bf16), the 34 layers about 2.5 MB: one shard for the
# table (a tensor above the threshold gets a shard of its own) and a few for the layers.
TOY_MAX_SHARD_SIZE = 1024 * 1024
TEXT_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "query_pre_attn_scalar", "num_hidden_layers", "vocab_size")
VISION_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                 "patch_size")


def shrink_configs(configs, model_config: Path) -> None:
    """Give configs["gemma3-4b"] the widths of the Hugging Face config.json at model_config."""
    if MODEL_KEY not in configs:
        return  # a MaxText without gemma3-4b: nothing here to describe
    if not model_config.is_file():
        raise RuntimeError(f"rehearsal kit: no toy model config at {model_config}; make the kit again "
                           "(prepare_rehearsal.sh) or remove it to run MaxText at full size")
    toy = json.loads(model_config.read_text())
    config = configs[MODEL_KEY]
    for field in TEXT_FIELDS:
        setattr(config.text_config, field, toy["text_config"][field])
    for field in VISION_FIELDS:
        setattr(config.vision_config, field, toy["vision_config"][field])
    config.mm_tokens_per_image = toy["mm_tokens_per_image"]


def lower_shard_threshold(utils) -> None:
    # save_model_files calls shard_checkpoint(weight_arrays) without max_shard_size, and that
    # argument's default was bound to DEFAULT_MAX_SHARD_SIZE when the function was defined:
    # rebinding the constant alone would change nothing. The default itself is replaced (the
    # constant too, for the log lines that quote it); a signature that no longer has it fails here
    # rather than leaving the toy export unsharded.
    function = utils.shard_checkpoint
    names = function.__code__.co_varnames[: function.__code__.co_argcount]
    defaults = list(function.__defaults__)
    position = names.index("max_shard_size") - (len(names) - len(defaults))
    if position < 0 or defaults[position] != utils.DEFAULT_MAX_SHARD_SIZE:
        raise RuntimeError(f"rehearsal kit: {CONVERSION_UTILS_MODULE}.shard_checkpoint changed: {names} {defaults}")
    defaults[position] = TOY_MAX_SHARD_SIZE
    function.__defaults__ = tuple(defaults)
    utils.DEFAULT_MAX_SHARD_SIZE = TOY_MAX_SHARD_SIZE


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self._loader, name)


class PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds the two MaxText modules as the normal path finder does, and patches each once it has
    run; the toy model is the Hugging Face config.json at `model_config`."""

    # How install() recognises a finder of this file under any module name (the kit's
    # `sitecustomize`, the local cloud image's copy): only one of them may patch.
    maxtext_rehearsal_patches = True

    def __init__(self, model_config: Path):
        self.model_config = Path(model_config)
        self.patches = {
            CONFIGS_MODULE: lambda module: shrink_configs(module.HF_MODEL_CONFIGS, self.model_config),
            CONVERSION_UTILS_MODULE: lower_shard_threshold,
        }

    def find_spec(self, fullname, path, target=None):
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


def install(finder: PatchingFinder) -> None:
    """Make `finder` the one that patches, replacing one installed before (the last install wins:
    the kit's sitecustomize runs after the .pth files of site-packages)."""
    sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "maxtext_rehearsal_patches", False) is not True]
    sys.meta_path.insert(0, finder)


if __name__ == "sitecustomize":
    # A rehearsal VM is a CPU VM: JAX then never tries the TPU runtime that maxtext[tpu-post-train]
    # installs (libtpu) on a machine without TPU chips. (The converters pick the CPU themselves;
    # train_sft does not.) A value the caller set wins.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # KIT/site/sitecustomize.py -> KIT/model/config.json
    install(PatchingFinder(Path(__file__).resolve().parent.parent / "model" / "config.json"))
