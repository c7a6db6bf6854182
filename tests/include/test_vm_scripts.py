"""The VM-side step scripts, run directly with bash (no SSH), on the fast image's MaxText stand-in.

Arguments come from the real RunSpec and step table, with the tutorial's /dev/shm paths moved
into a temp dir. Each script must be runnable by hand and safe to run twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from localcloud import images
from maxtext_sft.spec import build_run_spec
from maxtext_sft.vm_steps import STEPS, include_dir

TOKEN = "hf_script_test_token_42"
STATUS = re.compile(r"^MAXTEXT_SFT_STATUS (.*)$", re.M)


@pytest.fixture(scope="module")
def image_venv() -> Path:
    return images.build_fast_image() / "skel" / "maxtext_venv"


@pytest.fixture
def vm(tmp_path, image_venv):
    """A fake VM home with the image's venv, and a runner for one step's script."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "maxtext_venv").symlink_to(image_venv)
    shm = tmp_path / "shm"
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"seconds_per_step": 0.002}))
    spec = build_run_spec(
        {"reservation": "r", "steps": 12},
        dag_id="maxtext_sft",
        run_id="manual__test",
        generation=0,
        started=datetime(2026, 11, 29, tzinfo=timezone.utc),
        default_project_id="my-project",
        ssh_user="maxtext",
        ssh_public_key="ssh-ed25519 AAAA",
    )

    class Vm:
        def __init__(self):
            self.home, self.shm, self.spec, self.faults = home, shm, spec, faults

        def path(self, remote: str) -> Path:
            return Path(remote.replace("/dev/shm", str(shm)))

        def run(self, step: str, token: str | None = TOKEN, check: bool = True) -> subprocess.CompletedProcess:
            args = [a.replace("/dev/shm", str(shm)) for a in STEPS[step].arguments(spec, {})]
            env = {
                "HOME": str(home),
                "PATH": "/usr/bin:/bin",
                "MAXTEXT_STANDIN_FAULTS": str(faults),
            }
            result = subprocess.run(
                ["bash", str(include_dir() / STEPS[step].script), *args],
                input=(token + "\n") if token else "",
                capture_output=True,
                text=True,
                env=env,
                timeout=120,
            )
            if check:
                assert result.returncode == 0, result.stdout + result.stderr
            return result

        def status(self) -> tuple[dict[str, str], str]:
            out = self.run("training_status").stdout
            fields = dict(item.split("=", 1) for item in STATUS.findall(out)[-1].split())
            return fields, out

        def wait_for_training(self, timeout: float = 60) -> tuple[dict[str, str], str]:
            seen = ""
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                fields, out = self.status()
                seen += out
                if fields["state"] != "running":
                    return fields, seen
                time.sleep(0.1)  # polling interval, not synchronisation: the state is re-read
            raise AssertionError("training still running at the deadline")

    return Vm()


def converted(vm) -> None:
    vm.run("convert")


def test_install_skips_when_the_pinned_version_is_in_the_venv(vm):
    result = vm.run("install")
    assert "already installed" in result.stdout


def test_convert_gets_the_token_on_stdin_and_is_safe_to_run_twice(vm):
    first = vm.run("convert")
    out_dir = vm.path(vm.spec.maxtext_checkpoint_dir)
    assert (out_dir / "0" / "items").is_dir()
    token_hash = (out_dir / ".standin-hf-token.sha256").read_text().strip()
    assert token_hash == hashlib.sha256(TOKEN.encode()).hexdigest()
    assert TOKEN not in first.stdout + first.stderr
    assert f"MAXTEXT_SFT_RESULT base_checkpoint={out_dir}/0/items" in first.stdout
    second = vm.run("convert")
    assert "already converted" in second.stdout


def test_convert_without_a_token_fails_and_leaves_no_checkpoint(vm):
    result = vm.run("convert", token=None, check=False)
    assert result.returncode != 0
    assert not (vm.path(vm.spec.maxtext_checkpoint_dir) / "0" / "items").exists()


def test_training_runs_detached_and_status_streams_each_line_once(vm):
    converted(vm)
    started = vm.run("start_training")
    assert "Started training" in started.stdout
    fields, seen = vm.wait_for_training()
    assert fields["state"] == "succeeded", seen
    assert fields["exit_code"] == "0" and fields["last_step"] == "12"
    assert fields["out_of_data"] == "no"
    steps = [int(s) for s in re.findall(r"completed step: (\d+),", seen)]
    assert steps == list(range(1, 13))  # every step line once, in order, across all the checks
    assert vm.path(vm.spec.final_checkpoint_path).is_dir()
    again = vm.run("start_training")
    assert "already finished" in again.stdout
    log = (vm.home / "maxtext-sft-runs" / vm.spec.run_name / "train.log").read_text()
    assert log.count("Train loop finished") == 1


def test_start_training_twice_while_running_starts_one_process(vm):
    converted(vm)
    vm.faults.write_text(json.dumps({"seconds_per_step": 0.002, "train_sft": {"stall_at_step": 5}}))
    vm.run("start_training")
    second = vm.run("start_training")
    assert "already running" in second.stdout
    pid = int((vm.home / "maxtext-sft-runs" / vm.spec.run_name / "pid").read_text())
    os.killpg(os.getpgid(pid), signal.SIGKILL)
    fields, seen = vm.wait_for_training()
    assert fields["state"] == "failed" and fields["exit_code"] == "none", seen


def test_a_crash_is_reported_with_the_log_tail(vm):
    converted(vm)
    vm.faults.write_text(json.dumps({"seconds_per_step": 0.002, "train_sft": {"crash_at_step": 5}}))
    vm.run("start_training")
    fields, seen = vm.wait_for_training()
    assert fields["state"] == "failed" and fields["exit_code"] == "1"
    assert fields["last_step"] == "4"
    tail = seen.split("--- tail of ")[-1]
    assert "Traceback" in tail


def test_exit_zero_before_the_final_step_is_a_failure(vm):
    converted(vm)
    vm.faults.write_text(json.dumps({"seconds_per_step": 0.002, "train_sft": {"out_of_data_at_step": 6}}))
    vm.run("start_training")
    fields, seen = vm.wait_for_training()
    assert fields["exit_code"] == "0"
    assert fields["state"] == "failed", seen
    assert fields["out_of_data"] == "yes"
    assert "run out of training data" in seen


def test_export_writes_the_hf_files_and_is_safe_to_run_twice(vm):
    converted(vm)
    vm.run("start_training")
    assert vm.wait_for_training()[0]["state"] == "succeeded"
    for _ in range(2):
        result = vm.run("export")
        assert "Exported Hugging Face model" in result.stdout
    export = vm.path(vm.spec.hf_export_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in export.iterdir()}


def test_export_without_a_checkpoint_fails_clearly(vm):
    result = vm.run("export", check=False)
    assert result.returncode != 0
    assert "no checkpoint at" in result.stderr
