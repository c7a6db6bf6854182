"""The remote steps: which script in include/vm runs, with which arguments, for a RunSpec.

A remote command is always `bash <fixed script path> <shlex-quoted values>`: values are never
formatted into shell code, so a value can only ever arrive at the script as data.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path

from maxtext_sft.vm.ssh_common import REMOTE_SCRIPT_DIR
from maxtext_sft.results.loss_curve import MAX_POINTS
from maxtext_sft.run.paths import include_dir
from maxtext_sft.run.spec import RunSpec


# A line by which a step script hands a value back (lib.sh's report_result).
RESULT_LINE = re.compile(r"^MAXTEXT_SFT_RESULT ([a-z_]+)=(.*)$")

# The line by which a step script says which process group is its own (lib.sh's claim_step_group):
# the group's id and its leader's start time, what end_step_command ends on a timeout.
STEP_GROUP_LINE = re.compile(r"^MAXTEXT_SFT_STEP_GROUP ([1-9][0-9]{0,9}) ([0-9]{1,20})$")

# How long a timed-out step's processes get between SIGTERM and SIGKILL: enough for pip or apt to
# exit on SIGTERM, short enough that the task's retry is not held up.
STEP_GROUP_GRACE_SECONDS = 10


@dataclasses.dataclass(frozen=True)
class VmStep:
    script: str
    # (spec, results of earlier steps) -> the script's arguments
    arguments: Callable[[RunSpec, Mapping[str, str]], list[str]]
    timeout_seconds: Callable[[RunSpec], float]
    needs_hf_token: bool


STEPS: dict[str, VmStep] = {
    # Started on every VM the pipeline makes, at its first login: the VM stops itself once it has
    # had no training, no step and no check for autostop_idle_minutes (a dead Airflow).
    "autostop": VmStep(
        script="autostop.sh",
        arguments=lambda s, _: [s.work_dir, f"{s.autostop_idle_minutes:g}"],
        timeout_seconds=lambda s: 60,
        needs_hf_token=False,
    ),
    "install": VmStep(
        script="install_maxtext.sh",
        arguments=lambda s, _: [s.work_dir, s.maxtext_version],
        timeout_seconds=lambda s: s.install_timeout_minutes * 60,
        needs_hf_token=False,
    ),
    # The rehearsal's checks from the VM: its service account on the bucket, its egress and the
    # token on the base model and the dataset snapshot.
    "check_vm_access": VmStep(
        script="check_vm_access.sh",
        arguments=lambda s, _: [
            s.work_dir,
            s.run_output_dir if s.durable else "",
            s.base_model_id,
            s.model_revision or "",
            s.dataset_name if s.hub_dataset else "",
            s.dataset_revision or "",
            s.dataset_files[0] if s.dataset_files else "README.md",
        ],
        timeout_seconds=lambda s: 300,
        needs_hf_token=True,
    ),
    # The rehearsal's toy inputs, made on the VM (include/rehearsal): MaxText then runs at toy size.
    "prepare_rehearsal": VmStep(
        script="prepare_rehearsal.sh",
        arguments=lambda s, _: [s.work_dir],
        timeout_seconds=lambda s: 900,
        needs_hf_token=False,
    ),
    "convert": VmStep(
        script="convert_to_maxtext.sh",
        arguments=lambda s, _: [
            s.work_dir, s.maxtext_checkpoint_dir, s.base_checkpoint_cache or "", *s.convert_args()
        ],
        timeout_seconds=lambda s: s.convert_timeout_minutes * 60,
        needs_hf_token=True,
    ),
    "start_training": VmStep(
        script="start_training.sh",
        arguments=lambda s, results: [
            s.work_dir,
            s.run_name,
            s.tpu["accelerator_type"],
            s.tpu["topology"],
            s.tpu["chips_per_host_bounds"],
            # The host's place in the slice: its worker id and every host's address, in worker order.
            s.tpu["host_bounds"],
            str(s.host_index),
            ",".join(s.worker_hostnames) or "localhost",
            # Host 0's step lines, metrics and log are the run's (every host logs the same losses).
            (s.training_steps_uri or "") if s.host_index == 0 else "",
            (s.training_metrics_uri or "") if s.host_index == 0 else "",
            (s.training_log_uri or "") if s.host_index == 0 else "",
            # "resuming": set by a VM recovery (tasks/vm_sensors.py), not by the DAG's start_training.
            *s.train_args(results.get("base_checkpoint"), resuming=results.get("resuming") == "yes"),
        ],
        timeout_seconds=lambda s: 300,
        needs_hf_token=True,
    ),
    "training_status": VmStep(
        script="training_status.sh",
        arguments=lambda s, _: [s.work_dir, s.run_name, s.checkpoints_dir, str(s.steps)],
        timeout_seconds=lambda s: 120,
        needs_hf_token=False,
    ),
    # Read only; collect_outputs parses the lines (training_metrics.parse_metrics) for the loss
    # history, the eval results and the final loss.
    "training_metrics": VmStep(
        script="training_metrics.sh",
        arguments=lambda s, _: [s.work_dir, s.run_name, str(MAX_POINTS)],
        timeout_seconds=lambda s: 120,
        needs_hf_token=False,
    ),
    "export": VmStep(
        script="export_to_hf.sh",
        arguments=lambda s, _: [
            s.work_dir, s.final_checkpoint_path, s.hf_export_dir, s.hf_export_uri or "", *s.export_args()
        ],
        timeout_seconds=lambda s: s.export_timeout_minutes * 60,
        needs_hf_token=True,
    ),
}


# What a step needs done first on a VM made again (a recovery, a cleared task): the earlier steps'
# work lives on the VM's disk (the MaxText venv; the converted checkpoint, unless in the shared cache).
STEPS_BEFORE: dict[str, tuple[str, ...]] = {
    "install": (),
    "check_vm_access": (),
    "prepare_rehearsal": ("install",),
    "convert": ("install",),
    "start_training": ("install", "convert"),
    "export": ("install",),
}


def steps_before(step: str, spec: RunSpec) -> tuple[str, ...]:
    """STEPS_BEFORE for this run: a rehearsal's MaxText steps need its toy kit on the VM too."""
    before = STEPS_BEFORE.get(step, ("install",))
    if spec.rehearsal and step in ("convert", "start_training", "export"):
        before = ("install", "prepare_rehearsal", *before[1:])
    return before


def vm_scripts_dir() -> Path:
    return include_dir() / "vm"


def script_files() -> dict[str, bytes]:
    """Every step script plus lib.sh and the Python a script runs beside it (text_only_export.py),
    and the rehearsal kit's sources (include/rehearsal, which prepare_rehearsal.sh finds beside
    it): uploaded together, so a step never meets a stale helper."""
    scripts = sorted([*vm_scripts_dir().glob("*.sh"), *vm_scripts_dir().glob("*.py")])
    kit = include_dir() / "rehearsal"
    kit_sources = sorted([*kit.glob("*.py"), *kit.glob("*.json")])
    return {path.name: path.read_bytes() for path in [*scripts, *kit_sources]}


def remote_command(step: str, spec: RunSpec, results: Mapping[str, str] | None = None) -> str:
    """The step's command line; ValueError for an argument no command line can carry (a NUL byte,
    e.g. in a value a step reported back from the VM)."""
    vm_step = STEPS[step]
    words = ["bash", f"{REMOTE_SCRIPT_DIR}/{vm_step.script}", *vm_step.arguments(spec, results or {})]
    if any("\x00" in word for word in words):
        raise ValueError(f"an argument of {vm_step.script} contains a NUL byte")
    return shlex.join(words)


def parse_results(lines: list[str]) -> dict[str, str]:
    """The values a script reported with report_result (the last one of a name wins)."""
    return {m.group(1): m.group(2) for line in lines if (m := RESULT_LINE.match(line))}


def step_group(line: str) -> tuple[int, int] | None:
    """(process group, its leader's start time) from a STEP_GROUP_LINE, else None."""
    match = STEP_GROUP_LINE.match(line)
    return (int(match.group(1)), int(match.group(2))) if match else None


def end_step_command(group: tuple[int, int], grace_seconds: int = STEP_GROUP_GRACE_SECONDS) -> str:
    """The command that ends a timed-out step's process group (include/vm/end_step_group.sh):
    fixed words and three numbers, checked here, so nothing else reaches the remote shell."""
    pgid, start = group
    values = (pgid, start, grace_seconds)
    if any(type(value) is not int or value < 0 for value in values) or pgid <= 1:
        raise ValueError(f"not a step's process group: {group!r} (grace {grace_seconds!r})")
    return shlex.join(["bash", f"{REMOTE_SCRIPT_DIR}/end_step_group.sh", *map(str, values)])
