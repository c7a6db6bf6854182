"""SshReadyTrigger against a real sshd VM of the local cloud: the login that works, the host keys it
reads itself when none were published at the deferral, a host key other than the published one, a
refused login (at once, or polled on during the worker's grace), an unanswering VM polled until the
bound with its last error, a VM gone; its serialization; the connections it opens and closes."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from localcloud.compute.leases import NEVER_LEASED
from maxtext_sft.vm.ssh_async import VmSSHHookAsync
from maxtext_sft.vm import ssh_ready
from maxtext_sft.vm.ssh_ready import SliceSshReadyTrigger, SshReadyTrigger
from tests.plugins.test_training_trigger import (  # noqa: F401 - vm: the module's VM
    WRONG_KEY,
    closed,
    first_event,
    vm,
    vm_ssh_kwargs,
)

NOBODY, ELSEWHERE = NEVER_LEASED[:2]  # nothing listens there: port 22 refuses the connection


def trigger_for(spec, address, keys, **overrides) -> SshReadyTrigger:
    return SshReadyTrigger(**{**vm_ssh_kwargs(spec, address, keys), **overrides})


@pytest.fixture
def logins(monkeypatch):
    """Every connection the trigger opens, in order."""
    opened = []
    connect = VmSSHHookAsync.get_conn

    async def recorded(self):
        conn = await connect(self)
        opened.append(conn)
        return conn

    monkeypatch.setattr(VmSSHHookAsync, "get_conn", recorded)
    return opened


def test_serialize_round_trip_holds_plain_values_and_no_secret():
    trigger = SshReadyTrigger(
        ssh_conn_id="ssh", host="10.0.0.2", host_keys={"ssh-ed25519": "AAAA"}, vm_name="vm", project_id="p",
        zone="z", gcp_conn_id="gcp", poll_interval=5, deadline=1234.5, username="sa_1", iap={"gcp_conn_id": "gcp", "project": "p", "zone": "z", "instance": "vm", "port": 22},
        refused_until=99.0, first_refused=9.0, first_event_after=60,
    )
    classpath, kwargs = trigger.serialize()
    assert classpath == "maxtext_sft.vm.ssh_ready.SshReadyTrigger"
    assert json.loads(json.dumps(kwargs)) == kwargs  # what Airflow stores for the triggerer
    again = SshReadyTrigger(**kwargs)
    assert again.serialize() == (classpath, kwargs)
    assert kwargs["first_poll_after"] == 5  # a poll interval after the worker's own check
    # The connections by id; nothing the VM runs comes from the kwargs (the command is fixed).
    assert "command" not in kwargs and not any("huggingface" in str(value) for value in kwargs.values())


def test_a_vm_that_takes_the_login_is_ready_after_the_deferral_is_reported(vm, logins):
    spec, address, keys, _ = vm
    started = time.monotonic()
    # Given the keys the worker read last, the same as the trigger reads: pinned at the first poll.
    assert first_event(trigger_for(spec, address, keys, first_event_after=2)) == {"status": "ready", "host_keys": keys}
    assert time.monotonic() - started >= 2  # held until the executor has reported the deferral
    assert len(logins) == 1
    assert asyncio.run(closed(logins[0]))


def test_without_host_keys_read_before_the_trigger_pins_them_at_its_second_read(vm, local_cloud):
    spec, address, keys, _ = vm
    before = len(local_cloud.requests())
    assert first_event(trigger_for(spec, address, {})) == {"status": "ready", "host_keys": keys}
    reads = [r for r in local_cloud.requests()[before:] if r["path"].endswith(f"/instances/{spec.vm_name}/getGuestAttributes")]
    assert [r["query"].get("queryPath") for r in reads] == ["hostkeys/"] * 2  # two reads in a row, the same


def published_in_turn(monkeypatch, *reads):
    """The VM publishes `reads` in turn (a dict, or None for what it really publishes), the last one after."""
    answers = list(reads)
    real = SshReadyTrigger._host_keys

    def published(self):
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        return real(self) if answer is None else answer

    monkeypatch.setattr(SshReadyTrigger, "_host_keys", published)


def test_a_host_key_other_than_the_one_published_all_along_is_refused_past_the_grace(vm, monkeypatch):
    from maxtext_sft.vm import access as vm_access

    spec, address, _, _ = vm
    monkeypatch.setattr(vm_access, "HOST_KEY_MISMATCH_GRACE_SECONDS", 1)
    published_in_turn(monkeypatch, WRONG_KEY)  # what the VM publishes is not its sshd's key, at every read
    started = time.time()
    event = first_event(trigger_for(spec, address, {}))
    assert event["status"] == "refused" and event["kind"] == "host_key", event
    assert time.time() - started >= 1
    # As the workers' VmSSHHook says it (the fault matrix's cause).
    assert "not the ssh-ed25519 key the VM published in its guest attributes" in event["message"]
    assert "refusing to connect" in event["message"] and "for 1 s, the same keys published all along" in event["message"]


def test_host_keys_changing_during_the_first_boot_are_read_until_they_settle(vm, monkeypatch):
    """The old key published while sshd shows a new one (a first boot's guest agent), then the new
    one published: polled on, and pinned once two reads agree and the login works."""
    spec, address, keys, _ = vm
    published_in_turn(monkeypatch, WRONG_KEY, None)
    logins = []
    login = SshReadyTrigger._login

    async def counted(self, host_keys):
        logins.append(dict(host_keys))
        return await login(self, host_keys)

    monkeypatch.setattr(SshReadyTrigger, "_login", counted)
    event = first_event(trigger_for(spec, address, {"ssh-ed25519": keys["ssh-ed25519"][:-4] + "AAA="}))
    assert event == {"status": "ready", "host_keys": keys}
    assert logins == [WRONG_KEY, keys, keys]  # a mismatch, then the published keys twice


def test_host_keys_that_never_settle_reach_the_bound_naming_the_mismatch(vm, monkeypatch):
    spec, address, keys, _ = vm
    other = {"ssh-ed25519": WRONG_KEY["ssh-ed25519"][:-8] + "AAAAAAA="}
    turns = [WRONG_KEY, other] * 200  # a different wrong key at every read: never the same twice
    monkeypatch.setattr(SshReadyTrigger, "_host_keys", lambda self: turns.pop(0))
    event = first_event(trigger_for(spec, address, {}, deadline=time.time() + 2))
    assert event["status"] == "unreachable" and event["error_type"] == "HostKeyMismatch", event
    assert "not the ssh-ed25519 key the VM published" in event["error"]


def test_a_refused_login_goes_to_the_worker_at_once_or_after_its_grace(vm):
    """A user the VM does not have: its sshd refuses the login. Without a grace the worker judges
    it at once (OS Login); within the worker's grace it is polled on, then reported with the time
    of the first refusal."""
    spec, address, keys, _ = vm
    before = time.time()
    event = first_event(trigger_for(spec, address, keys, username="nobody-here"))
    assert event["status"] == "refused" and event["kind"] == "login", event
    assert "refused the SSH login" in event["message"] and before <= event["first_refused"] <= time.time()

    first = time.time() - 30  # the worker's check was refused half a minute ago
    event = first_event(trigger_for(spec, address, keys, username="nobody-here", first_refused=first,
                                    refused_until=time.time() + 2))
    assert event["status"] == "refused" and event["first_refused"] == first
    assert time.time() >= first + 32  # polled on until the grace ended


def test_an_unanswering_vm_is_polled_until_the_bound_and_its_last_error_comes_back(vm, monkeypatch):
    spec, _, keys, _ = vm
    tries = []
    login = SshReadyTrigger._login

    async def counted(self, host_keys):
        tries.append(time.time())
        return await login(self, host_keys)

    monkeypatch.setattr(SshReadyTrigger, "_login", counted)
    started = time.time()
    event = first_event(trigger_for(spec, NOBODY, keys, deadline=started + 2))
    assert event == {"status": "unreachable", "error_type": "ConnectionRefusedError", "error": event["error"]}
    assert NOBODY in event["error"]
    assert time.time() - started >= 2 and len(tries) >= 3  # polled on while the VM is RUNNING, to the bound


def test_an_unanswering_vm_the_compute_api_says_is_gone_sends_the_worker_to_look(vm):
    spec, _, keys, _ = vm
    event = first_event(trigger_for(spec, NOBODY, keys, vm_name="no-such-vm"))
    assert event == {"status": "look_again"}


def test_a_cancelled_trigger_closes_the_connection_it_has_open_and_logs_in_no_more(vm, logins, monkeypatch):
    """The triggerer cancelling the trigger (its task cleared or marked, the triggerer stopping)
    mid-login closes its connection. (A command that lasts stands in for `true` here.)"""
    spec, address, keys, _ = vm
    monkeypatch.setattr(ssh_ready, "COMMAND", "sleep 30")

    async def login_then_cancel():
        waiting = asyncio.ensure_future(anext(trigger_for(spec, address, keys).run()))
        while not logins:
            await asyncio.sleep(0.05)  # polling interval: the login's connection opens
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return await closed(logins[0])

    assert asyncio.run(login_then_cancel()) is True
    assert len(logins) == 1


# ----- a slice's hosts, watched at once ----------------------------------------------------------


@pytest.fixture
def running(monkeypatch):
    """The Compute API says every host is RUNNING (the test VM is the only real one)."""

    async def never_lost(self):
        return False

    monkeypatch.setattr(SshReadyTrigger, "_vm_lost", never_lost)


def host(spec, address, keys, name=None, **overrides) -> dict:
    """One host's SshReadyTrigger arguments, as the slice's trigger takes them (plain values)."""
    return trigger_for(spec, address, keys, **({"vm_name": name} if name else {}), **overrides).serialize()[1]


@pytest.fixture
def keys_as_given(monkeypatch):
    """Each host publishes the keys its trigger was given: the slice tests' hosts at addresses where
    nothing answers are not VMs the Compute API knows."""
    monkeypatch.setattr(SshReadyTrigger, "_host_keys", lambda self: dict(self.host_keys))


def test_a_slices_hosts_ready_are_named_with_the_event_of_the_one_that_needs_the_worker(vm, running, keys_as_given):
    spec, address, keys, _ = vm
    deadline = time.time() + 2
    trigger = SliceSshReadyTrigger(hosts=[host(spec, address, keys), host(spec, NOBODY, keys, "host-1", deadline=deadline)])
    assert SliceSshReadyTrigger(**trigger.serialize()[1]).serialize() == trigger.serialize()
    assert json.loads(json.dumps(trigger.serialize()[1])) == trigger.serialize()[1]
    event = first_event(trigger)
    assert event["ready"] == [spec.vm_name] and event["host_keys"] == {spec.vm_name: keys}
    assert event["events"] == {"host-1": {"status": "unreachable", "error_type": "ConnectionRefusedError",
                                          "error": event["events"]["host-1"]["error"]}}
    assert time.time() >= deadline


def test_at_the_bound_every_waiting_hosts_last_error_comes_back(vm, running, keys_as_given):
    spec, _, keys, _ = vm
    deadline = time.time() + 1
    event = first_event(SliceSshReadyTrigger(hosts=[
        host(spec, NOBODY, keys, "host-0", deadline=deadline), host(spec, ELSEWHERE, keys, "host-1", deadline=deadline),
    ]))
    assert event["ready"] == [] and set(event["events"]) == {"host-0", "host-1"}
    assert ELSEWHERE in event["events"]["host-1"]["error"] and NOBODY in event["events"]["host-0"]["error"]


def test_a_host_that_needs_the_worker_ends_the_other_hosts_logins_closing_their_connections(
    vm, logins, monkeypatch, keys_as_given
):
    """Host 1 is gone (the Compute API's 404 to the trigger): the event leaves at once, and the
    login host 0 has open (a command that lasts stands in for `true`) is closed."""
    spec, address, keys, _ = vm
    monkeypatch.setattr(ssh_ready, "COMMAND", "sleep 30")
    started = time.monotonic()
    event = first_event(SliceSshReadyTrigger(hosts=[
        host(spec, address, keys), host(spec, NOBODY, keys, "no-such-vm", first_poll_after=1),
    ]))
    assert event == {"ready": [], "host_keys": {}, "events": {"no-such-vm": {"status": "look_again"}}}
    assert time.monotonic() - started < 30 and len(logins) == 1
    assert asyncio.run(closed(logins[0]))


def test_host_keys_the_compute_api_could_not_read_are_read_again_at_the_next_poll(vm, monkeypatch):
    spec, address, _, _ = vm
    from maxtext_sft.vm import access as vm_access
    reads = []
    read = vm_access.published_host_keys

    def flaky(*args):
        reads.append(args)
        if len(reads) == 1:
            raise RuntimeError("503 backendError")  # as a Compute API that answers 503 raises
        return read(*args)

    monkeypatch.setattr(vm_access, "published_host_keys", flaky)
    assert first_event(trigger_for(spec, address, {}))["status"] == "ready"
    assert len(reads) == 3  # failed, then two reads in a row, the same
