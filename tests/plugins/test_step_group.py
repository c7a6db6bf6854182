"""The command that ends a timed-out step's process group, and the line a step names it by."""

from __future__ import annotations

import shlex

import pytest

from maxtext_sft.vm.ssh_common import REMOTE_SCRIPT_DIR
from maxtext_sft.vm.steps import STEP_GROUP_GRACE_SECONDS, end_step_command, script_files, step_group


def test_the_end_command_is_the_fixed_script_and_three_numbers():
    command = end_step_command((4242, 1234567))
    assert shlex.split(command) == [
        "bash", f"{REMOTE_SCRIPT_DIR}/end_step_group.sh", "4242", "1234567", str(STEP_GROUP_GRACE_SECONDS)
    ]
    assert "end_step_group.sh" in script_files()  # uploaded with the steps, there when a step times out


@pytest.mark.parametrize("group", [(1, 5), (0, 5), (-3, 5), (12, -1), ("12; reboot", 5), (12.0, 5), (True, 5)])
def test_anything_but_a_step_group_reaches_no_command(group):
    with pytest.raises(ValueError, match="not a step's process group"):
        end_step_command(group)


def test_the_group_line_is_read_exactly():
    assert step_group("MAXTEXT_SFT_STEP_GROUP 22 98765") == (22, 98765)
    for line in ("MAXTEXT_SFT_STEP_GROUP 22", "MAXTEXT_SFT_STEP_GROUP 0 5", "MAXTEXT_SFT_STEP_GROUP 22 5; id",
                 " MAXTEXT_SFT_STEP_GROUP 22 5", "MAXTEXT_SFT_RESULT group=22"):
        assert step_group(line) is None, line


# ----- lib.sh's claim_step_group, run here with bash (no VM) ---------------------------------------

STEP = """#!/usr/bin/env bash
set -euo pipefail
source "$(dirname "$0")/lib.sh"
note_contact "$1"
ls "$1/maxtext-sft-steps" 2>/dev/null || true
"""


@pytest.fixture
def steps_dir(tmp_path):
    from maxtext_sft.vm.steps import vm_scripts_dir

    (tmp_path / "lib.sh").write_bytes((vm_scripts_dir() / "lib.sh").read_bytes())
    for name in ("install_maxtext.sh", "training_status.sh"):
        (tmp_path / name).write_text(STEP)
    return tmp_path


def run_step(steps_dir, name: str, *, own_group: bool):
    import subprocess

    return subprocess.run(["bash", str(steps_dir / name), str(steps_dir / "work")], capture_output=True, text=True,
                          timeout=30, start_new_session=own_group, check=True)


def test_a_step_leading_its_group_names_it_and_an_exclusive_one_records_it_while_it_runs(steps_dir):
    run = run_step(steps_dir, "install_maxtext.sh", own_group=True)
    group = step_group(run.stderr.strip())
    assert group is not None and group[0] > 1, run.stderr
    assert run.stdout.split() == ["install_maxtext.sh.group", "install_maxtext.sh.lock"]  # recorded while it ran
    assert sorted(p.name for p in (steps_dir / "work" / "maxtext-sft-steps").iterdir()) == ["install_maxtext.sh.lock"]
    read_only = run_step(steps_dir, "training_status.sh", own_group=True)
    assert step_group(read_only.stderr.strip()) and "training_status.sh.group" not in read_only.stdout


def test_a_step_run_from_another_script_changes_nothing(steps_dir):
    """Not leading its process group (a person's script ran it): no group of its own to end."""
    run = run_step(steps_dir, "install_maxtext.sh", own_group=False)
    assert run.stderr == "" and run.stdout == ""
    assert not (steps_dir / "work" / "maxtext-sft-steps").exists()
