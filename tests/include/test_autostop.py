"""include/vm/autostop.sh alone, with bash, on a temp WORK_DIR (no emulator, no SSH).

The power-off is `sudo -n shutdown -h now`; the PATH's first `sudo` here records its arguments
to a file instead (or refuses, like sudo for a user without sudo rights), which is what the tests
wait for. Bounds are 0.05 minutes (3 s; checks every 0.75 s).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from maxtext_sft.vm.steps import vm_scripts_dir
from tests.conftest import poll

SCRIPT = vm_scripts_dir() / "autostop.sh"
BOUND_MINUTES = "0.05"
BOUND = 3.0


wait_for = functools.partial(poll, interval=0.05)  # wait_for(condition, timeout, what)


def stays_false(condition, seconds: float, what: str) -> None:
    """`condition()` stays false for `seconds` (polled until that deadline)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert not condition(), what
        time.sleep(0.05)


class Vm:
    def __init__(self, tmp_path: Path, sudo_refuses: bool = False):
        self.work = tmp_path / "work"
        self.work.mkdir()
        self.state = self.work / "maxtext-sft-autostop"
        self.calls = tmp_path / "sudo-calls"
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        record = f'echo "$*" >> {self.calls}\n'
        refuse = 'echo "sudo: a password is required" >&2\nexit 1\n' if sudo_refuses else ""
        (bin_dir / "sudo").write_text(f"#!/bin/bash\n{record}{refuse}")
        (bin_dir / "sudo").chmod(0o755)
        self.env = {"HOME": str(tmp_path), "PATH": f"{bin_dir}:/usr/bin:/bin"}
        self.groups: list[int] = []  # process groups to kill at teardown

    def autostop(self, minutes: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(
            ["bash", str(SCRIPT), str(self.work), minutes], capture_output=True, text=True, env=self.env, timeout=30
        )
        if check:
            assert result.returncode == 0, result.stdout + result.stderr
        if self.pid_file.exists():
            pid = int(self.pid_file.read_text())
            if pid not in self.groups:
                self.groups.append(pid)  # setsid: the watchdog leads its own process group
        return result

    @property
    def pid_file(self) -> Path:
        return self.state / "pid"

    def log(self) -> str:
        try:
            return (self.state / "log").read_text()
        except FileNotFoundError:
            return ""

    def powered_off(self) -> bool:
        return self.calls.exists() and self.calls.read_text() != ""

    def start(self, *argv: str) -> subprocess.Popen:
        proc = subprocess.Popen(list(argv), env=self.env, start_new_session=True, stdout=subprocess.DEVNULL)
        self.groups.append(proc.pid)
        return proc

    def kill_all(self) -> None:
        for pgid in self.groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def vm(tmp_path):
    v = Vm(tmp_path)
    yield v
    v.kill_all()


def watchdogs(work: Path) -> list[int]:
    """Pids of live watchdogs of WORK_DIR `work`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                args = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z" and b"--watch" in args and str(work).encode() in args:
                found.append(int(entry))
    return found


def test_an_idle_vm_is_powered_off_once_the_bound_has_passed(vm):
    started = time.monotonic()
    out = vm.autostop(BOUND_MINUTES).stdout
    assert "Started autostop watchdog" in out
    wait_for(vm.powered_off, BOUND + 6, "the power-off")
    elapsed = time.monotonic() - started
    # The contact file's mtime has whole seconds: up to 1 s early, never more.
    assert elapsed > BOUND - 1, elapsed
    assert vm.calls.read_text() == "-n shutdown -h now\n"
    assert "powering off: idle for" in vm.log() and "no training alive, no step in progress" in vm.log()
    wait_for(lambda: not watchdogs(vm.work), 5, "the watchdog's exit after the accepted shutdown")


def test_a_running_training_keeps_the_vm_up_until_it_ends(vm):
    sleeper = vm.start("sleep", "1000")
    run_dir = vm.work / "maxtext-sft-runs" / "run-1"
    run_dir.mkdir(parents=True)
    (run_dir / "pid").write_text(f"{sleeper.pid}\n")
    vm.autostop(BOUND_MINUTES)
    wait_for(lambda: "kept up: training run-1 is running" in vm.log(), 5, "the watchdog seeing the training")
    stays_false(vm.powered_off, 3 * BOUND, "powered off while training ran")
    os.killpg(sleeper.pid, signal.SIGKILL)
    sleeper.wait()
    (run_dir / "exit_code").write_text("137\n")
    ended = time.monotonic()
    wait_for(vm.powered_off, BOUND + 6, "the power-off after the training ended")
    assert time.monotonic() - ended > BOUND - 1


def test_pipeline_contact_keeps_the_vm_up(vm):
    vm.autostop(BOUND_MINUTES)
    contact = vm.state / "contact"
    # The sensor's pokes: training_status.sh touches the contact file each time (here: every 1 s).
    deadline = time.monotonic() + 3 * BOUND
    while time.monotonic() < deadline:
        os.utime(contact)
        assert not vm.powered_off(), "powered off despite fresh contact"
        time.sleep(1)
    last = time.monotonic()
    wait_for(vm.powered_off, BOUND + 6, "the power-off once contact stopped")
    assert time.monotonic() - last > BOUND - 1


def test_a_step_in_progress_keeps_the_vm_up_and_a_dead_ones_marker_does_not(vm):
    lib = vm_scripts_dir() / "lib.sh"
    step = vm.start("bash", "-c", f'source "{lib}"; note_contact "$1"; exec sleep 1000', "step", str(vm.work))
    marker = vm.state / "busy" / str(step.pid)
    wait_for(marker.exists, 5, "the step's busy marker")
    vm.autostop(BOUND_MINUTES)
    wait_for(lambda: f"kept up: a step script is in progress (pid {step.pid})" in vm.log(), 5, "the step seen")
    stays_false(vm.powered_off, 3 * BOUND, "powered off while a step ran")
    # Killed before its exit trap could remove the marker: the dead pid no longer counts.
    os.killpg(step.pid, signal.SIGKILL)
    step.wait()
    assert marker.exists()
    wait_for(vm.powered_off, BOUND + 6, "the power-off after the step died")
    assert not marker.exists()


def test_a_step_removes_its_busy_marker_when_it_exits(vm):
    lib = vm_scripts_dir() / "lib.sh"
    result = subprocess.run(
        ["bash", "-c", f'set -eu; source "{lib}"; note_contact "$1"; ls "$1/maxtext-sft-autostop/busy"', "step", str(vm.work)],
        capture_output=True, text=True, env=vm.env, timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() != []  # registered while it ran
    assert list((vm.state / "busy").iterdir()) == []
    assert (vm.state / "contact").exists()


def test_running_it_again_updates_the_bound_of_the_one_watchdog(vm):
    assert "Started" in vm.autostop("10").stdout
    first = int(vm.pid_file.read_text())
    wait_for(lambda: "watchdog started" in vm.log(), 5, "the first watchdog")
    again = vm.autostop(BOUND_MINUTES).stdout
    assert f"already running (pid {first})" in again
    assert int(vm.pid_file.read_text()) == first
    assert (vm.state / "idle_minutes").read_text() == f"{BOUND_MINUTES}\n"
    assert watchdogs(vm.work) == [first]
    wait_for(lambda: f"idle bound is now {BOUND_MINUTES} minutes" in vm.log(), 60, "the new bound taken up")
    wait_for(vm.powered_off, BOUND + 6, "the power-off at the new bound")
    assert vm.log().count("watchdog started") == 1


@pytest.mark.parametrize("value", ["0", "0.0", "-1", "abc", "1e3", "", "1.5.2", " 3"])
def test_a_bad_idle_bound_is_refused(vm, value):
    result = vm.autostop(value, check=False)
    assert result.returncode == 2
    assert f"IDLE_MINUTES must be a positive number of minutes (e.g. 30 or 0.5), not '{value}'" in result.stderr
    assert not vm.pid_file.exists() and not watchdogs(vm.work)


def test_a_refused_sudo_is_logged_and_tried_again(tmp_path):
    v = Vm(tmp_path, sudo_refuses=True)
    try:
        v.autostop(BOUND_MINUTES)
        wait_for(lambda: v.log().count("shutdown refused") >= 2, 4 * BOUND + 6, "two refused attempts")
        assert "sudo: a password is required" in v.log() and "the VM keeps running" in v.log()
        assert watchdogs(v.work) == [int(v.pid_file.read_text())]
    finally:
        v.kill_all()
