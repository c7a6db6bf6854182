"""SshLoginProbe: a refused login is waited for only while a guest agent may still be making the
user, and never when OS Login is known to be on for a run that does not use it; host keys are
pinned once they settle, and a pinned key that changes later fails the run, naming it."""

from __future__ import annotations

import base64
import logging
import threading
import time
import types

import pytest

from maxtext_sft.vm.ssh import LoginRefused
from maxtext_sft.vm.ssh_common import HostKeyMismatch
from maxtext_sft.vm import access as vm_access
from tests.plugins.test_spec import make_spec

LOG = logging.getLogger("test")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def refusing_vm(monkeypatch):
    """A VM whose sshd refuses the login, and a compute API that says `os_login` about it."""
    state = {"os_login": None}

    def refused_hook(spec, gcp_conn_id, ssh_conn_id, **kwargs):
        raise LoginRefused(f"10.0.0.2 refused the SSH login of {spec.ssh_user} with the connection's key")

    class Compute:
        def __init__(self, gcp_conn_id):
            pass

        def os_login_enabled(self, resource_id, zone, project_id):
            return state["os_login"]

    clock = Clock()
    monkeypatch.setattr(vm_access, "vm_ssh_hook", refused_hook)
    monkeypatch.setattr(vm_access, "ComputeEngineEndpointHook", Compute)
    monkeypatch.setattr(vm_access.time, "time", clock)  # the grace runs on the wall clock: a deferred wait goes on in another process
    return state, clock


def test_os_login_on_for_a_run_without_it_fails_at_the_first_refusal(refusing_vm):
    state, _ = refusing_vm
    state["os_login"] = True
    probe = vm_access.SshLoginProbe(make_spec(), "gcp", "ssh", LOG)
    with pytest.raises(LoginRefused, match=r"OS Login is enabled for VM .* Set the Param os_login"):
        probe()


def test_otherwise_a_refusal_is_waited_for_during_the_grace_then_fails_naming_os_login(refusing_vm):
    _, clock = refusing_vm
    probe = vm_access.SshLoginProbe(make_spec(), "gcp", "ssh", LOG)
    assert probe() is False  # the guest agent may not have made the user yet
    clock.now += vm_access.LOGIN_GRACE_SECONDS - 1
    assert probe() is False
    clock.now += 1
    with pytest.raises(LoginRefused, match=r"for 90 s\)\. .*constraints/compute.requireOsLogin.*Param os_login"):
        probe()


def test_a_run_with_os_login_is_told_what_its_account_needs(refusing_vm):
    state, clock = refusing_vm
    state["os_login"] = True
    probe = vm_access.SshLoginProbe(make_spec(os_login=True), "gcp", "ssh", LOG)
    assert probe() is False
    clock.now += vm_access.LOGIN_GRACE_SECONDS
    with pytest.raises(LoginRefused, match=r"roles/compute.osAdminLogin"):
        probe()


# ----- host keys: pinned once they settle; a change after that fails, naming it ------------------


OLD = {"ssh-ed25519": base64.b64encode(b"old-key-blob").decode()}
NEW = {"ssh-ed25519": base64.b64encode(b"new-key-blob").decode()}


class FakeHook:
    """A VmSSHHook as the probe uses it: the keys read for it, and what its login raises (`error`);
    else `true` exits 0."""

    def __init__(self, published_host_keys: dict, error: BaseException | None = None):
        self.published_host_keys = dict(published_host_keys)
        self.error = error

    def get_conn(self):
        if self.error:
            raise self.error
        return self

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False

    def run_command(self, command, **_):
        assert command == "true"
        return 0, []


@pytest.fixture
def first_boot(monkeypatch):
    """A VM whose published keys and sshd's answer follow `turns`: (published keys, sshd shows one of them)."""
    turns: list[tuple[dict, bool]] = []
    mismatch = HostKeyMismatch("SSH host key of 10.0.0.2 is ssh-ed25519 ..., not the ssh-ed25519 key the VM published")

    def hook(*_, **__):
        keys, matches = turns.pop(0)
        return FakeHook(keys, None if matches else mismatch)

    monkeypatch.setattr(vm_access, "vm_ssh_hook", hook)
    return turns


def test_keys_that_change_during_the_first_boot_are_pinned_once_they_settle(first_boot):
    # cloud-init's keys; the guest agent's new ones served before they are published; then published.
    first_boot += [(OLD, True), (OLD, False), (NEW, True), (NEW, True)]
    probe = vm_access.SshLoginProbe(make_spec(), "gcp", "ssh", LOG)
    assert probe() is False and probe.awaiting_second_read  # read once: read again
    assert probe() is False and not probe.awaiting_second_read  # a mismatch during the first boot: polled on
    assert probe() is False  # new keys, read once
    assert probe() is True and probe.pinned == NEW


def test_a_mismatch_with_the_same_keys_published_past_the_grace_fails(first_boot, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(vm_access.time, "time", clock)
    first_boot += [(OLD, True), (OLD, False), (NEW, False), (NEW, False), (NEW, False)]
    probe = vm_access.SshLoginProbe(make_spec(), "gcp", "ssh", LOG)
    assert probe() is False
    assert probe() is False  # sshd's keys just changed, not published yet: a first boot's window
    clock.now += 10
    assert probe() is False  # other keys published: the window starts again
    clock.now += vm_access.HOST_KEY_MISMATCH_GRACE_SECONDS - 1
    assert probe() is False
    clock.now += 1
    with pytest.raises(HostKeyMismatch, match=r"for 15 s, the same keys published all along"):
        probe()


def test_settled_needs_keys_the_same_at_two_reads_and_a_login_that_worked():
    assert vm_access.host_keys_settled(OLD, OLD, None)
    assert not vm_access.host_keys_settled(None, OLD, None) and not vm_access.host_keys_settled(OLD, NEW, None)
    assert not vm_access.host_keys_settled({}, {}, None)
    assert not vm_access.host_keys_settled(OLD, OLD, HostKeyMismatch("x"))
    assert not vm_access.host_keys_settled(None, OLD, HostKeyMismatch("x"), time.time())
    with pytest.raises(HostKeyMismatch):
        vm_access.host_keys_settled(None, OLD, HostKeyMismatch("x"), time.time() - vm_access.HOST_KEY_MISMATCH_GRACE_SECONDS)


class InstanceIds:
    def __init__(self, instance_id):
        self.instance_id = instance_id

    def get_instance_info(self, zone, resource_id, project_id):
        return {"id": self.instance_id}


def test_a_key_that_changes_after_pinning_fails_naming_the_old_and_new_keys():
    spec = make_spec()
    vm_access.check_pinned_host_keys(spec, OLD, InstanceIds("7"), (OLD, "7"))  # unchanged: fine
    vm_access.check_pinned_host_keys(spec, NEW, InstanceIds("7"), None)  # nothing pinned (a trigger, no task)
    with pytest.raises(HostKeyMismatch) as failed:
        vm_access.check_pinned_host_keys(spec, NEW, InstanceIds("7"), (OLD, "7"))
    message = str(failed.value)
    assert f"host keys of VM {spec.vm_name} changed after the wait for SSH pinned them" in message
    assert vm_access.key_fingerprints(OLD) in message and vm_access.key_fingerprints(NEW) in message
    assert vm_access.key_fingerprints(OLD).startswith("ssh-ed25519 SHA256:")


def test_a_vm_made_again_under_the_same_name_is_not_a_changed_key():
    """A recovery or a cleared task makes a new instance: its own wait checks its keys."""
    vm_access.check_pinned_host_keys(make_spec(), NEW, InstanceIds("8"), (OLD, "7"))


def test_the_pinned_keys_come_from_the_waits_xcom_in_another_task_of_the_run(monkeypatch):
    import airflow.sdk

    class Wait:
        pins_host_keys = True

    class Ti:
        def __init__(self, task_id):
            self.task_id = task_id
            self.pulled = []

        def xcom_pull(self, task_ids):
            self.pulled.append(task_ids)
            return {"host_keys": {"vm-1": OLD}, "instance_ids": {"vm-1": "7"}}

    class Dag:
        task_dict = {"provision.wait_for_ssh": Wait(), "install_maxtext": object()}

    ti = Ti("install_maxtext")
    monkeypatch.setattr(airflow.sdk, "get_current_context", lambda: {"ti": ti, "dag": Dag()})
    assert vm_access.pinned_host_keys("vm-1") == (OLD, "7") and ti.pulled == ["provision.wait_for_ssh"]
    assert vm_access.pinned_host_keys("vm-2") is None  # another VM: nothing pinned for it
    ti.task_id = "provision.wait_for_ssh"
    assert vm_access.pinned_host_keys("vm-1") is None  # the wait itself pins


def test_a_slices_host_threads_use_the_pinned_keys_read_in_the_tasks_own_thread(monkeypatch):
    """Airflow 3.3.1 cannot read an XCom from a thread the task started (its supervisor channel
    lives in the task's own thread): on_every_host reads the wait's XCom first, and each host's
    thread finds it without reading again."""
    import airflow.sdk
    from maxtext_sft.vm.slice_hosts import on_every_host

    main = threading.current_thread()

    class Wait:
        pins_host_keys = True

    class Ti:
        id, dag_id, run_id, task_id, try_number = "ti-threads", "maxtext_sft_slice", "manual__1", "install_maxtext", 1

        def xcom_pull(self, task_ids):
            if threading.current_thread() is not main:
                raise ImportError("cannot import name 'SUPERVISOR_COMMS'")  # what 3.3.1 raises there
            return {"host_keys": {"vm-1": OLD, "vm-2": NEW}, "instance_ids": {"vm-1": "7", "vm-2": "8"}}

    class Dag:
        task_dict = {"wait_for_ssh": Wait(), "install_maxtext": object()}

    ti = Ti()
    monkeypatch.setattr(airflow.sdk, "get_current_context", lambda: {"ti": ti, "dag": Dag()})
    hosts = [types.SimpleNamespace(vm_name="vm-1", host_index=0), types.SimpleNamespace(vm_name="vm-2", host_index=1)]
    assert on_every_host(hosts, lambda spec: vm_access.pinned_host_keys(spec.vm_name), "install") == [(OLD, "7"), (NEW, "8")]
