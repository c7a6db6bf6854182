"""SshLoginProbe: a refused login is waited for only while a guest agent may still be making the
user, and never when OS Login is known to be on for a run that does not use it."""

from __future__ import annotations

import logging

import pytest

from maxtext_sft.vm.ssh import LoginRefused
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
