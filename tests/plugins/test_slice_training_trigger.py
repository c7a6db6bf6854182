"""SliceTrainingStatusTrigger against real sshd VMs of the local cloud, a two-host slice (each host
its own VM, each training faked as start_training.sh leaves it): host 0's event as its own trigger
gives it, another host's training dead or never started, another host not answering (not a
death), a host key not that host's, a host deleted or re-created in the Compute emulator; its
serialization; the connections it closes when its event leaves or it is cancelled."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from localcloud.compute.leases import NEVER_LEASED
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.vm.ssh_async import VmSSHHookAsync
from maxtext_sft.vm.training_watch import SliceTrainingStatusTrigger, TrainingStatusTrigger
from tests.plugins.test_training_trigger import (  # noqa: F401 - vm: the module's VM, host 0
    GCP_CONN_ID,
    WRONG_KEY,
    closed,
    fake_training,
    first_event,
    job_dir,
    made_vm,
    run_on_vm,
    trigger_for,
    vm,
    vm_spec,
)

NOBODY = NEVER_LEASED[0]  # nothing listens there: port 22 refuses the connection


@pytest.fixture(scope="module")
def host_1(vm):
    """The slice's host 1: a VM of its own (spec, address, host keys, a paramiko hook to it)."""
    with made_vm(vm_spec("host-1")) as made:
        yield made


def host(made, **overrides) -> dict:
    """A host's TrainingStatusTrigger arguments, as the slice's trigger takes them (plain values)."""
    spec, address, keys, _ = made
    return trigger_for(spec, address, keys, **overrides).serialize()[1]


def slice_trigger(*hosts: dict, instance_ids: dict | None = None) -> SliceTrainingStatusTrigger:
    return SliceTrainingStatusTrigger(hosts=list(hosts), instance_ids=instance_ids or {})


@pytest.fixture
def reads(monkeypatch):
    """Each host's training_status.sh reads, by VM name, as they start (`changed` set at each)."""

    class Reads(dict):
        changed = asyncio.Event()

        async def at_least(self, name: str, count: int) -> None:
            while len(self.get(name, [])) < count:
                self.changed.clear()
                await asyncio.wait_for(self.changed.wait(), 30)

    made = Reads()
    read = TrainingStatusTrigger._read

    async def recorded(self):
        made.setdefault(self.vm_name, []).append(time.time())
        made.changed.set()
        return await read(self)

    monkeypatch.setattr(TrainingStatusTrigger, "_read", recorded)
    return made


def test_serialize_round_trip_holds_plain_values_and_no_secret():
    hosts = [
        TrainingStatusTrigger(
            ssh_conn_id="ssh", host=f"10.0.0.{n + 2}", host_keys={"ssh-ed25519": "AAAA"}, command="bash x",
            vm_name=f"slice-host-{n}", run_name="run", project_id="p", zone="z", gcp_conn_id="gcp", poll_interval=30,
            stall_timeout_seconds=900, deadline=1234.5,
        ).serialize()[1]
        for n in range(2)
    ]
    trigger = SliceTrainingStatusTrigger(hosts=hosts, instance_ids={"slice-host-0": "100", "slice-host-1": "101"},
                                         first_event_after=60)
    classpath, kwargs = trigger.serialize()
    assert classpath == "maxtext_sft.vm.training_watch.SliceTrainingStatusTrigger"
    assert json.loads(json.dumps(kwargs)) == kwargs  # what Airflow stores for the triggerer
    assert SliceTrainingStatusTrigger(**kwargs).serialize() == (classpath, kwargs)
    assert not any("huggingface" in json.dumps(value) for value in kwargs.values())


def test_host_0s_crash_is_its_own_triggers_event(vm, host_1):
    fake_training(vm[0], vm[3], steps=4, alive=False, exit_code=1, tail="\nTraceback (most recent call last):\nBoom")
    fake_training(host_1[0], host_1[3], steps=4, alive=True, exit_code=None)
    event = first_event(slice_trigger(host(vm), host(host_1)))
    assert event["hosts"] == {}
    host_0 = event["host_0"]
    assert host_0["status"] == "training" and host_0["answered"] is True and host_0["last_step"] == 4
    assert "Boom" in host_0["output"] and host_0["output"][-1].startswith("MAXTEXT_SFT_STATUS state=failed exit_code=1")


def test_another_hosts_training_dying_hands_back_that_host_with_its_tail(vm, host_1, reads, capsys):
    fake_training(vm[0], vm[3], steps=2, alive=True, exit_code=None)
    fake_training(host_1[0], host_1[3], steps=2, alive=True, exit_code=None)
    name = host_1[0].vm_name

    async def watch():
        waiting = asyncio.ensure_future(anext(slice_trigger(host(vm), host(host_1)).run()))
        await reads.at_least(name, 2)  # host 1 read twice, its training running: no event
        assert not waiting.done()
        await asyncio.to_thread(fake_training, host_1[0], host_1[3], steps=3, alive=False, exit_code=137,
                                tail="\nKilled", first=3)
        return (await asyncio.wait_for(waiting, 30)).payload

    capsys.readouterr()
    event = asyncio.run(watch())
    assert event["host_0"] is None and list(event["hosts"]) == [name]
    died = event["hosts"][name]
    assert died["status"] == "training" and died["output"][0].startswith("--- tail of ")
    assert "Killed" in died["output"] and died["output"][-1].startswith("MAXTEXT_SFT_STATUS state=failed exit_code=137")
    assert "training progress: step 3," not in capsys.readouterr().out  # host 0's log is the training's


def test_no_training_started_on_another_host_hands_back(vm, host_1):
    fake_training(vm[0], vm[3], steps=2, alive=True, exit_code=None)
    run_on_vm(host_1[3], f'rm -rf "{job_dir(host_1[0])}"')
    event = first_event(slice_trigger(host(vm), host(host_1)))
    assert event["host_0"] is None
    [(name, died)] = event["hosts"].items()
    assert name == host_1[0].vm_name and died["status"] == "training"
    assert "reason=no-training-started" in died["output"][-1]


@pytest.mark.parametrize("host_1_is", ["unanswering", "finished"])
def test_another_host_unanswering_or_finished_is_not_a_death(vm, host_1, reads, host_1_is, capsys):
    """Host 1 is polled on while host 0 trains; host 0's end is the event, with nothing from host 1."""
    spec, _, _, _ = host_1
    fake_training(vm[0], vm[3], steps=2, alive=True, exit_code=None)
    fake_training(spec, host_1[3], steps=5, alive=False, exit_code=0)  # a host whose own training ended well
    other = host(host_1, **({"host": NOBODY} if host_1_is == "unanswering" else {}))

    async def watch():
        waiting = asyncio.ensure_future(anext(slice_trigger(host(vm), other).run()))
        await reads.at_least(spec.vm_name, 3)
        assert not waiting.done()
        # Host 0's watch ends (its training finished): the event is its alone.
        await asyncio.to_thread(fake_training, vm[0], vm[3], steps=5, alive=False, exit_code=0, first=3)
        return (await asyncio.wait_for(waiting, 30)).payload

    capsys.readouterr()
    event = asyncio.run(watch())
    assert event["hosts"] == {}
    assert event["host_0"]["status"] == "training" and "state=succeeded" in event["host_0"]["output"][-1]
    unanswered = capsys.readouterr().out.count(f"Could not check training on host {spec.vm_name} this time")
    if host_1_is == "unanswering":
        assert unanswered >= 2  # the reads before the third, each warned of
    else:
        assert unanswered == 0


def test_a_host_key_not_another_hosts_hands_back_refused(vm, host_1):
    fake_training(vm[0], vm[3], steps=2, alive=True, exit_code=None)
    event = first_event(slice_trigger(host(vm), host(host_1, host_keys=WRONG_KEY)))
    refused = event["hosts"][host_1[0].vm_name]
    assert event["host_0"] is None and refused["status"] == "refused" and refused["kind"] == "host_key", event
    assert f"not one the VM {host_1[0].vm_name} published" in refused["message"]


def test_a_host_deleted_in_the_compute_api_hands_back_lost(vm, local_cloud, reads):
    fake_training(vm[0], vm[3], steps=2, alive=True, exit_code=None)
    with made_vm(vm_spec("deleted")) as doomed:
        spec = doomed[0]
        fake_training(spec, doomed[3], steps=2, alive=True, exit_code=None)

        async def watch():
            waiting = asyncio.ensure_future(anext(slice_trigger(host(vm), host(doomed)).run()))
            await reads.at_least(spec.vm_name, 1)  # watched, its training running
            assert not waiting.done()
            await asyncio.to_thread(local_cloud.terminate_vm, spec.vm_name, "DELETE")  # as a preemption does
            return (await asyncio.wait_for(waiting, 30)).payload

        event = asyncio.run(watch())
    assert event == {"host_0": None, "hosts": {spec.vm_name: {
        "status": "lost", "state": "gone (deleted outside this run's teardown)"}}}


def test_a_host_re_created_by_its_group_is_lost(vm, host_1):
    """Another instance under the host's name: the group re-made it (a blank disk, no training)."""
    fake_training(vm[0], vm[3], steps=2, alive=True, exit_code=None)
    fake_training(host_1[0], host_1[3], steps=2, alive=True, exit_code=None)
    spec = host_1[0]
    now = ComputeEngineEndpointHook(gcp_conn_id=GCP_CONN_ID).get_instance(
        resource_id=spec.vm_name, zone=spec.zone, project_id=spec.project_id).id
    event = first_event(slice_trigger(host(vm), host(host_1), instance_ids={spec.vm_name: f"{now}0"}))
    assert event == {"host_0": None, "hosts": {spec.vm_name: {"status": "lost", "state": (
        f"gone: deleted outside this run's teardown, and re-created by its group as instance {now}")}}}


@pytest.fixture
def connections(monkeypatch):
    """Every SSH connection the trigger opens, in order: (the host's address, the connection)."""
    opened: list[tuple[str, object]] = []
    connect = VmSSHHookAsync.get_conn

    async def recorded(self):
        conn = await connect(self)
        opened.append((self.host, conn))
        return conn

    monkeypatch.setattr(VmSSHHookAsync, "get_conn", recorded)
    return opened


def test_host_0s_event_ends_the_other_hosts_reads_closing_their_connections(vm, host_1, connections, monkeypatch):
    """Host 0's training crashed, read once host 1's read (a command that lasts stands in for the
    status script) has its connection open: the event leaves at once, host 1's connection closed."""
    host_1_address = host_1[1]
    read = TrainingStatusTrigger._read

    async def host_0_after_host_1(self):
        while self.host != host_1_address and not any(address == host_1_address for address, _ in connections):
            await asyncio.sleep(0.05)  # polling interval: host 1's connection opens
        return await read(self)

    monkeypatch.setattr(TrainingStatusTrigger, "_read", host_0_after_host_1)
    fake_training(vm[0], vm[3], steps=1, alive=False, exit_code=1)
    started = time.monotonic()
    event = first_event(slice_trigger(host(vm), host(host_1, command="sleep 30")))
    assert event["host_0"]["status"] == "training" and event["hosts"] == {}
    assert time.monotonic() - started < 30
    [conn] = [conn for address, conn in connections if address == host_1_address]
    assert asyncio.run(closed(conn))


def test_a_cancelled_trigger_closes_every_connection_it_has_open_and_reads_no_more(vm, host_1, connections):
    """The triggerer cancelling the trigger (its task cleared or marked, the triggerer stopping)
    mid-read closes each host's connection. (A command that lasts stands in for the script.)"""

    async def read_then_cancel():
        trigger = slice_trigger(host(vm, command="sleep 30"), host(host_1, command="sleep 30"))
        waiting = asyncio.ensure_future(anext(trigger.run()))
        while len(connections) < 2:
            await asyncio.sleep(0.05)  # polling interval: both hosts' connections open
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return [await closed(conn) for _, conn in connections]

    assert asyncio.run(read_then_cancel()) == [True, True]
    assert sorted(address for address, _ in connections) == sorted([vm[1], host_1[1]])  # none after the cancel
