"""The wait for SSH on a VM whose host keys change during its first boot (the local cloud's
first_boot_host_keys fault: cloud-init's keys first, then the guest agent's, served before they are
published): the trigger's logins and the worker's probe go on through the change and pin the new
keys once they settle; a pinned key that changes later fails the run, naming it."""

from __future__ import annotations

import logging
import time

import pytest

from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.vm import access as vm_access
from maxtext_sft.vm.ssh_common import HostKeyMismatch
from maxtext_sft.vm.ssh_ready import SshReadyTrigger
from tests.conftest import poll
from tests.plugins.test_training_trigger import GCP_CONN_ID, first_event, vm_spec, vm_ssh_kwargs

LOG = logging.getLogger("test")


@pytest.fixture
def first_boot_vm(pipeline_connections, local_cloud):
    """Factory: a new VM whose keys change 2 s after RUNNING and are published 1 s later: (spec,
    address, the keys it published first). Deleted after the test."""
    compute = ComputeEngineEndpointHook(gcp_conn_id=GCP_CONN_ID)
    made = []

    def make(name: str):
        spec = vm_spec(name)
        local_cloud.set_faults({"first_boot_host_keys": {"seconds": 2, "publish_after": 1, "name_regex": f"^{spec.vm_name}$"}})
        where = {"zone": spec.zone, "project_id": spec.project_id}
        compute.insert_instance(body=spec.instance_body(), **where)
        made.append((spec.vm_name, where))
        first = compute.get_host_keys(resource_id=spec.vm_name, **where)
        assert first, "the VM published no host keys at RUNNING"
        return spec, compute.get_instance_address(resource_id=spec.vm_name, **where), first

    yield make
    local_cloud.set_faults({})
    for name, where in made:
        compute.delete_instance(resource_id=name, **where)


def test_the_trigger_pins_the_keys_the_first_boot_settles_on(first_boot_vm, monkeypatch):
    spec, address, first = first_boot_vm("fbk-trigger")
    logins: list[dict] = []
    login = SshReadyTrigger._login

    async def recorded(self, host_keys):
        logins.append(dict(host_keys))
        return await login(self, host_keys)

    monkeypatch.setattr(SshReadyTrigger, "_login", recorded)
    trigger = SshReadyTrigger(**{**vm_ssh_kwargs(spec, address, first), "poll_interval": 0.5},
                              refused_until=time.time() + 60)  # the guest agent makes the user after its keys
    event = first_event(trigger)
    now = ComputeEngineEndpointHook(gcp_conn_id=GCP_CONN_ID).get_host_keys(
        resource_id=spec.vm_name, zone=spec.zone, project_id=spec.project_id)
    assert event == {"status": "ready", "host_keys": now}
    assert now["ssh-ed25519"] != first["ssh-ed25519"]  # the keys did change during the wait
    assert logins[0] == first and logins[-2:] == [now, now]  # read until two reads agreed with a login


def test_the_workers_probe_pins_them_too_and_a_later_change_fails_naming_it(first_boot_vm):
    spec, _, first = first_boot_vm("fbk-probe")
    probe = vm_access.SshLoginProbe(spec, GCP_CONN_ID, "maxtext_sft_vm_ssh", LOG)
    poll(probe, timeout=60, what="the probe's login with settled keys", interval=0.5)  # 0.5 s: its poke_interval here
    assert probe.pinned["ssh-ed25519"] != first["ssh-ed25519"]
    # What a later task of the run does with the wait's XCom: the keys now are the pinned ones...
    compute = ComputeEngineEndpointHook(gcp_conn_id=GCP_CONN_ID)
    pinned = (probe.pinned, vm_access.instance_id(spec, GCP_CONN_ID))
    vm_access.check_pinned_host_keys(spec, vm_access.published_host_keys(
        GCP_CONN_ID, spec.vm_name, spec.zone, spec.project_id), compute, pinned)
    # ...and the keys of that first boot, pinned too early, would now fail it, naming both.
    with pytest.raises(HostKeyMismatch, match=r"changed after the wait for SSH pinned them: it pinned .*ssh-ed25519 SHA256:.*the VM now publishes"):
        vm_access.check_pinned_host_keys(spec, probe.pinned, compute, (first, pinned[1]))
