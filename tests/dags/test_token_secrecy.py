"""The Hugging Face token reaches the VM without appearing anywhere else.

A unique token is planted in the Hugging Face connection. Each MaxText command that needs it
(the stand-in's convert, train and export) is held at a barrier at its start, with the token in
its environment: then every process's command line on the machine (the VMs' processes included)
and every file of the VM are searched for it, before the command is let go. After the run, the
task logs, XComs, rendered template fields, and the Compute and Storage emulators' request logs
(instance metadata included) are searched too.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from pathlib import Path

import pytest

from localcloud.connections import LOCAL_HUB_MODEL, LOCAL_OUTPUTS_CONF

pytestmark = pytest.mark.e2e
COMMANDS = ("to_maxtext", "train_sft", "to_huggingface")  # in the order the pipeline runs them
HUB_USER = "secrecy-team"


def processes_showing(secret: bytes) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # ended meanwhile
        if secret in cmdline:
            found.append(f"{pid}: {cmdline[:200]!r}")
    return found


def files_holding(root: Path, secret: bytes) -> list[str]:
    found = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = Path(dirpath, name)
            try:
                if path.is_file() and not path.is_symlink() and secret in path.read_bytes():
                    found.append(str(path))
            except OSError:
                continue
    return found


class Inspector(threading.Thread):
    """Meets each command at its barrier, looks for the token, then lets the command go on.

    A barrier never met (its step skipped, or the run failed before it) does not hang the run: a
    later command held at its barrier is inspected at once, and after the deadline (or once the
    run has ended: `finish()`) every barrier left is released; the missed ones are in `missed`,
    for the test to name."""

    def __init__(self, cloud, secret: str, deadline_seconds: float = 300):
        super().__init__(daemon=True)
        self.cloud, self.secret, self.deadline_seconds = cloud, secret.encode(), deadline_seconds
        self.reached: list[str] = []
        self.missed: list[str] = []
        self.leaks: list[str] = []
        self.run_ended = threading.Event()

    def held_vm(self, command: str) -> Path | None:
        marker = f".standin-at-barrier-barrier-{command}"
        return next((vm for vm in (self.cloud.state_dir / "vms").glob("*") if (vm / "shm" / marker).exists()), None)

    def release(self, command: str) -> None:
        (self.cloud.state_dir / "vm-etc" / f"barrier-{command}").unlink(missing_ok=True)

    def run(self) -> None:
        waiting = list(COMMANDS)
        while waiting:
            deadline = time.monotonic() + self.deadline_seconds
            held = {}
            while not held and time.monotonic() < deadline and not self.run_ended.is_set():
                held = {command: vm for command in waiting if (vm := self.held_vm(command))}
                time.sleep(0.1)  # polling interval: the VMs' folders are read again each time
            if not held:
                self.missed += waiting
                for command in waiting:
                    self.release(command)
                return
            command = next(c for c in waiting if c in held)  # the earliest held; those before it were skipped
            self.missed += waiting[: waiting.index(command)]
            waiting = waiting[waiting.index(command) + 1 :]
            self.reached.append(command)
            self.leaks += [f"{command}: cmdline of {p}" for p in processes_showing(self.secret)]
            self.leaks += [f"{command}: file {f}" for f in files_holding(held[command], self.secret)]
            self.release(command)

    def finish(self) -> None:
        """The run has ended: what is still awaited was missed."""
        self.run_ended.set()
        self.join(timeout=10)
        assert not self.is_alive(), "the inspector did not stop"


def test_the_token_is_nowhere_but_in_the_steps_that_need_it(run_pipeline, local_cloud, monkeypatch):
    from airflow.models.renderedtifields import RenderedTaskInstanceFields
    from airflow.utils.session import create_session
    from sqlalchemy import select

    token = f"hf_secrecy{secrets.token_hex(16)}"
    local_cloud.hub.add_user(HUB_USER, token, role="write")
    local_cloud.hub.grant(HUB_USER, LOCAL_HUB_MODEL)  # the preflight checks the gated model's licence
    connection = {"conn_type": "generic", "password": token, "extra": {"endpoint": local_cloud.hub.endpoint}}
    monkeypatch.setenv("AIRFLOW_CONN_HUGGINGFACE_DEFAULT", json.dumps(connection))
    for command in COMMANDS:
        local_cloud.set_vm_file(f"barrier-{command}", "")
    inspector = Inspector(local_cloud, token)
    inspector.start()
    local_cloud.clear_storage_requests()
    # An output folder of its own: another test's converted checkpoint in the shared cache would
    # skip the conversion, and with it the convert barrier the inspector waits for.
    conf = {
        **LOCAL_OUTPUTS_CONF,
        "output_location": f"{LOCAL_OUTPUTS_CONF['output_location']}/secrecy-{secrets.token_hex(4)}",
        "hub_repo_id": f"{HUB_USER}/secrecy-check",
        "steps": 6,
    }
    try:
        run = run_pipeline(conf, maxtext_faults={command: {"barrier": f"barrier-{command}"} for command in COMMANDS})
    finally:
        for command in COMMANDS:
            (local_cloud.state_dir / "vm-etc" / f"barrier-{command}").unlink(missing_ok=True)
    inspector.finish()

    assert inspector.missed == [], f"barriers never met (their steps were not inspected): {inspector.missed}"
    assert run.state == "success", run.report()
    assert inspector.reached == list(COMMANDS)  # every step that needs the token was inspected
    assert inspector.leaks == []
    assert token not in run.log
    assert token not in json.dumps(run.xcoms, default=str)
    with create_session() as session:
        rendered = session.scalars(
            select(RenderedTaskInstanceFields).where(RenderedTaskInstanceFields.run_id == run.run_id)
        ).all()
    assert rendered  # the check below looked at something
    assert token not in json.dumps([r.rendered_fields for r in rendered], default=str)
    assert token not in json.dumps(local_cloud.requests())  # instance metadata is in the insert body
    assert token not in json.dumps(local_cloud.storage_requests())
    assert run.task_states["publish_to_hub"] == "success"  # the token did its job at the Hub
