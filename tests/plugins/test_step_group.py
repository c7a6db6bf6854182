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
