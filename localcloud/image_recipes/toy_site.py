"""Start-up hook of the real image's venv (the local cloud's image only, never the product).

Loaded by `localcloud_toy.pth` in the venv's site-packages at every interpreter start. (A
`sitecustomize.py` in a venv is shadowed by Debian's /usr/lib/python3.11/sitecustomize.py.)

1. Environment defaults for the toy: everything Hugging Face is served offline from the image
   (the hub cache holds `google/gemma-3-4b-it`'s tokenizer), and no Google client probes the GCE
   metadata server. Values already set by the caller win.
2. MaxText's `HF_MODEL_CONFIGS["gemma3-4b"]` gets the toy model's widths as soon as
   `maxtext.checkpoint_conversion.utils.hf_model_configs` is imported. The converters map shapes
   from that hard-coded config (to_huggingface also writes it as the export's config.json), so it
   must describe the toy checkpoint, not the real 4B model. The values come from the toy model's
   own config.json, so the two cannot disagree.
3. MaxText's export shards its weights above 3 GiB (`maxtext.checkpoint_conversion.utils.utils`:
   `shard_checkpoint`, `DEFAULT_MAX_SHARD_SIZE`), so Gemma 3 4B (about 8.6 GB) is always exported
   as model-0000N-of-0000M.safetensors plus model.safetensors.index.json. The toy weights (about
   36 MB) would fit in one file; with the threshold lowered to TOY_MAX_SHARD_SIZE the toy export
   has several shards too, so the pipeline reads the layout production writes.
"""

import importlib.abc
import importlib.machinery
import json
import os
import sys
from pathlib import Path

# The venv is <image>/maxtext_venv; a VM user reaches it through ~/maxtext_venv, a symlink.
IMAGE_DIR = Path(os.path.realpath(sys.prefix)).parent
TOY_DIR = IMAGE_DIR / "toy"
CONFIGS_MODULE = "maxtext.checkpoint_conversion.utils.hf_model_configs"
CONVERSION_UTILS_MODULE = "maxtext.checkpoint_conversion.utils.utils"
# The toy embedding table alone is 32 MiB (bf16), the 34 layers about 2.5 MB: one shard for the
# table (a tensor above the threshold gets a shard of its own) and a few for the layers.
TOY_MAX_SHARD_SIZE = 1024 * 1024
MODEL_KEY = "gemma3-4b"
TEXT_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "query_pre_attn_scalar", "num_hidden_layers", "vocab_size")
VISION_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                 "patch_size")

ENV_DEFAULTS = {
    # Only the hub cache is the image's (read-only); HF_HOME stays the user's own, writable
    # ~/.cache/huggingface (the datasets library keeps its cache there).
    "HF_HUB_CACHE": str(TOY_DIR / "hf_home" / "hub"),
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    # google-auth: skip the metadata-server probe; any metadata request would go to loopback.
    "NO_GCE_CHECK": "True",
    "GCE_METADATA_HOST": "127.0.0.1:9",
    "GCE_METADATA_IP": "127.0.0.1:9",
}


def _shrink(configs) -> None:
    path = TOY_DIR / "model" / "config.json"
    if MODEL_KEY not in configs or not path.is_file():
        return  # an image still being built (the toy model is made after the venv)
    toy = json.loads(path.read_text())
    config = configs[MODEL_KEY]
    for field in TEXT_FIELDS:
        setattr(config.text_config, field, toy["text_config"][field])
    for field in VISION_FIELDS:
        setattr(config.vision_config, field, toy["vision_config"][field])
    config.mm_tokens_per_image = toy["mm_tokens_per_image"]


def _lower_shard_threshold(utils) -> None:
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
        raise RuntimeError(f"toy_site: {CONVERSION_UTILS_MODULE}.shard_checkpoint changed: {names} {defaults}")
    defaults[position] = TOY_MAX_SHARD_SIZE
    function.__defaults__ = tuple(defaults)
    utils.DEFAULT_MAX_SHARD_SIZE = TOY_MAX_SHARD_SIZE


# What to change in a module right after it is executed, by module name.
PATCHES = {
    CONFIGS_MODULE: lambda module: _shrink(module.HF_MODEL_CONFIGS),
    CONVERSION_UTILS_MODULE: _lower_shard_threshold,
}


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


class _PatchingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


def install() -> None:
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if not any(isinstance(finder, _PatchingFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchingFinder())


install()
