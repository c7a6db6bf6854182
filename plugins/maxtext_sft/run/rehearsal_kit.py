"""The rehearsal kit on the VM (include/vm/prepare_rehearsal.sh makes it): where it is, and the
extra MaxText arguments each step needs with it (include/rehearsal/toy_args.json). No Airflow imports.

The step scripts run in the SSH login's working directory, $HOME, so the kit's path is written as
seen from there: relative for a work_dir under "~", absolute otherwise.
"""

from __future__ import annotations

import json
import posixpath
from pathlib import Path
from typing import Any

from maxtext_sft.run.paths import include_dir

KIT_FOLDER = "rehearsal-kit"
KIT_PLACEHOLDER = "{kit}"


def kit_path(work_dir: str) -> str:
    """WORK_DIR/rehearsal-kit as seen from $HOME: "~" -> "rehearsal-kit", "~/x" -> "x/rehearsal-kit",
    "/abs" -> "/abs/rehearsal-kit"."""
    if work_dir == "~" or work_dir.startswith("~/"):
        under_home = work_dir[2:].strip("/")
        return posixpath.join(under_home, KIT_FOLDER) if under_home else KIT_FOLDER
    return posixpath.join(work_dir, KIT_FOLDER)


def toy_args_file() -> Path:
    return include_dir() / "rehearsal" / "toy_args.json"


def toy_args(work_dir: str) -> dict[str, Any]:
    """toy_args.json with {kit} replaced by kit_path(work_dir): {"convert": [...], "train": [...],
    "export": [...], "dataset": {"path": ..., "split": ..., "eval_split": ...}}."""
    kit = kit_path(work_dir)

    def substitute(value):
        if isinstance(value, str):
            return value.replace(KIT_PLACEHOLDER, kit)
        if isinstance(value, list):
            return [substitute(item) for item in value]
        if isinstance(value, dict):
            return {key: substitute(item) for key, item in value.items()}
        return value

    return substitute(json.loads(toy_args_file().read_text()))
