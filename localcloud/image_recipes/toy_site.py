"""Start-up hook of the real image's venv (the local cloud's image only, never the product).

Loaded by `localcloud_toy.pth` in the venv's site-packages at every interpreter start. (A
`sitecustomize.py` in a venv's site-packages is shadowed by Debian's
/usr/lib/python3.11/sitecustomize.py: the standard library comes first on sys.path.)

1. Environment defaults for the toy: everything Hugging Face is served offline from the image
   (the hub cache holds `google/gemma-3-4b-it`'s tokenizer), and no Google client probes the GCE
   metadata server. Values already set by the caller win.
2. The rehearsal kit's MaxText patches (include/rehearsal/sitecustomize.py, copied beside this
   file by the image builder as REHEARSAL_PATCHES), applied to the image's own toy model: MaxText's
   gemma3-4b HF config shrunk to the toy's widths, the export's shard threshold lowered. A
   rehearsal kit on the VM (its sitecustomize runs after this hook) replaces them with its own.

LOCALCLOUD_TOY_SITE=0 turns the hook off (no defaults, no patches): what a VM without the image's
toy has, e.g. to show that a rehearsal kit works on its own.
"""

import os
import sys
from pathlib import Path

import maxtext_rehearsal_patches as _patches

# The venv is <image>/maxtext_venv; a VM user reaches it through ~/maxtext_venv, a symlink.
IMAGE_DIR = Path(os.path.realpath(sys.prefix)).parent
TOY_DIR = IMAGE_DIR / "toy"
CONFIGS_MODULE = _patches.CONFIGS_MODULE
TOY_MAX_SHARD_SIZE = _patches.TOY_MAX_SHARD_SIZE
OFF_SWITCH = "LOCALCLOUD_TOY_SITE"

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


class _PatchingFinder(_patches.PatchingFinder):
    """The rehearsal kit's patches for the image's toy model."""

    def __init__(self):
        super().__init__(TOY_DIR / "model" / "config.json")


def install() -> None:
    if os.environ.get(OFF_SWITCH) == "0":
        return
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if not any(isinstance(finder, _PatchingFinder) for finder in sys.meta_path):
        _patches.install(_PatchingFinder())


install()
