"""wait_for_ssh deferrable: its check on the worker, what it gives the SSH trigger, and what it does
with each of the trigger's events (resumed as Airflow resumes it, in a new task process: a new
sensor object, the same task state store). The login probe is the real SshLoginProbe; the VM's
answers and the Compute API are faked."""

from __future__ import annotations

import json

import pytest

from airflow.providers.standard.triggers.temporal import TimeDeltaTrigger
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from maxtext_sft.vm import access as vm_access
from maxtext_sft.vm.ssh_common import HostKeyMismatch, LoginRefused
from maxtext_sft.tasks import vm_sensors as sensors
from maxtext_sft.vm.ssh_ready import SliceSshReadyTrigger, SshReadyTrigger
from tests.plugins.test_spec import make_spec
from tests.plugins.test_ssh_login_probe import FakeHook
from tests.plugins.test_unreachable_bound import DagRun, StateStore

TARGET = {"host": "10.0.0.2", "host_keys": {"ssh-ed25519": "AAAA"}, "username": None, "iap": None}


class FakeVm:
    """What the worker's check meets: the instance's status, what the login does, OS Login."""

    def __init__(self):
        self.now = 1_000.0
        self.status = "RUNNING"
        self.login: BaseException | None = OSError("[Errno 111] Connection refused")  # None: it works
        self.logins: dict[str, BaseException | None] = {}  # a host's own, over `login`
        self.not_running: dict[str, str] = {}  # a slice's hosts that are not RUNNING: their status
        self.host_keys = TARGET["host_keys"]
        self.target_error: BaseException | None = None
        self.os_login = None
        self.autostops = 0
        self.autostopped: list[str] = []


@pytest.fixture
def fake(monkeypatch):
    vm = FakeVm()

    class Remake:
        def __init__(self, spec, **_):
            pass

        def status(self):
            return vm.status

    def hook(spec, *_, **__):
        return FakeHook(vm.host_keys, vm.logins.get(spec.vm_name, vm.login))

    class Compute:
        def __init__(self, gcp_conn_id):
            pass

        def os_login_enabled(self, resource_id, zone, project_id):
            return vm.os_login

        def get_instance_info(self, zone, resource_id, project_id):
            return {"id": f"id-of-{resource_id}"}

    def ssh_target(spec, gcp_conn_id, *, host_keys_required=True):
        if vm.target_error:
            raise vm.target_error
        return {**TARGET, "host_keys": vm.host_keys}

    def autostop(spec, gcp_conn_id, ssh_conn_id, log):
        vm.autostops += 1
        vm.autostopped.append(spec.vm_name)

    def check_hosts_running(specs, gcp_conn_id):
        for spec in specs:
            if spec.vm_name in vm.not_running:
                raise AirflowFailException(f"Host {spec.host_index} ({spec.vm_name}) is {vm.not_running[spec.vm_name]}")

    STORE.clear()
    monkeypatch.setattr(sensors.time, "time", lambda: vm.now)  # the sensor's and the probe's clock
    vm.slept = []
    monkeypatch.setattr(sensors.time, "sleep", lambda seconds: (vm.slept.append(seconds), setattr(vm, "now", vm.now + seconds)))
    monkeypatch.setattr(sensors, "VmRemake", Remake)
    monkeypatch.setattr(sensors, "ssh_target", ssh_target)
    monkeypatch.setattr(sensors, "start_autostop", autostop)
    monkeypatch.setattr(sensors, "check_hosts_running", check_hosts_running)
    monkeypatch.setattr(vm_access, "vm_ssh_hook", hook)
    monkeypatch.setattr(vm_access, "ComputeEngineEndpointHook", Compute)
    return vm


def sensor(spec=None, **kwargs):
    spec = spec or make_spec(ssh_ready_timeout_seconds=600)
    return sensors.VmSshReadySensor(
        task_id="wait_for_ssh", spec=spec.to_dict(), gcp_conn_id="gcp", ssh_conn_id="ssh", poke_interval=5,
        capacity_first_read_seconds=60, **kwargs,
    )


class Try:
    try_number = 1


STORE = StateStore()  # cleared by the `fake` fixture


def context() -> dict:
    """A task process's context: one run's task state store, this try."""
    return {"task_state_store": STORE, "dag_run": DagRun(), "ti": Try()}


def deferred(call) -> TaskDeferred:
    with pytest.raises(TaskDeferred) as raised:
        call()
    return raised.value


def check(**kwargs):
    """The try's first task process: its check on the worker."""
    return sensor(**kwargs).execute(context())


def resume(deferral: TaskDeferred, event, spec=None):
    """A new task process resumes the task as Airflow does: the deferral's kwargs and the event."""
    return sensor(spec).resume_execution(deferral.method_name, {**(deferral.kwargs or {}), "event": event}, context())


def pinned(name: str, keys=None) -> dict:
    """The wait's XCom once it pinned `name`'s host keys (the fake Compute API's instance id)."""
    return {"host_keys": {name: keys or TARGET["host_keys"]}, "instance_ids": {name: f"id-of-{name}"}}


def test_a_vm_that_answers_the_first_check_pins_its_keys_a_poll_later_and_starts_its_autostop(fake):
    fake.login = None
    assert check() == pinned(make_spec().vm_name)  # the keys read twice, a poll apart, the same
    assert fake.slept == [5] and fake.autostops == 1  # no deferral for that one poll


def test_host_keys_that_change_between_the_two_reads_are_read_again_on_the_triggerer(fake):
    fake.login = None
    reads = iter([{"ssh-ed25519": "OLD1"}, {"ssh-ed25519": "NEW1"}])
    real_hook = vm_access.vm_ssh_hook

    def changing(spec, *args, **kwargs):
        hook = real_hook(spec, *args, **kwargs)
        hook.published_host_keys = next(reads)
        return hook

    vm_access.vm_ssh_hook = changing
    try:
        deferral = deferred(lambda: check())
    finally:
        vm_access.vm_ssh_hook = real_hook
    assert deferral.trigger.host_keys == {"ssh-ed25519": "NEW1"}  # the last read: the trigger's next must agree
    assert fake.autostops == 0


def test_an_unanswering_vm_defers_to_the_ssh_trigger_with_plain_values_and_no_secret(fake):
    deferral = deferred(lambda: check())
    trigger = deferral.trigger
    assert isinstance(trigger, SshReadyTrigger) and deferral.method_name == "resume_after_login"
    assert (trigger.host, trigger.host_keys) == (TARGET["host"], {})  # no login met a key yet: none read
    assert trigger.deadline == 1_000 + 600  # ssh_ready_timeout_seconds from the first check
    assert trigger.poll_interval == 5 and trigger.first_event_after == 60
    assert trigger.refused_until is None and trigger.first_refused is None
    assert STORE == {"ssh_wait_since_try1_g0": 1_000}  # the wait's clock, for the next task process
    _, kwargs = trigger.serialize()
    assert json.loads(json.dumps(kwargs)) == kwargs
    assert (kwargs["ssh_conn_id"], kwargs["gcp_conn_id"]) == ("ssh", "gcp")
    assert fake.autostops == 0


def test_no_host_keys_published_yet_the_trigger_reads_them(fake):
    fake.login, fake.host_keys = vm_access.HostKeysNotPublished("none yet"), {}
    assert deferred(lambda: check()).trigger.host_keys == {}


def test_a_vm_gone_or_stopped_is_done_at_once(fake):
    fake.status = "TERMINATED"
    assert check() is None
    assert fake.autostops == 0


def test_the_login_working_on_the_triggerer_starts_the_autostop(fake):
    deferral = deferred(lambda: check())
    fake.now += 30
    keys = {"ssh-ed25519": "BBBB"}  # what settled on the triggerer
    assert resume(deferral, {"status": "ready", "host_keys": keys}) == pinned(make_spec().vm_name, keys)
    assert fake.autostops == 1


def test_look_again_checks_on_the_worker(fake):
    deferral = deferred(lambda: check())
    fake.now += 30
    again = deferred(lambda: resume(deferral, {"status": "look_again"}))
    assert again.trigger.deadline == 1_600  # the same wait: its bound is not restarted
    fake.status = None  # gone: the next step makes it again
    assert resume(again, {"status": "look_again"}) is None and fake.autostops == 0


def test_the_bound_fails_the_task_naming_the_last_error(fake):
    deferral = deferred(lambda: check())
    fake.now += 600
    event = {"status": "unreachable", "error_type": "ConnectionRefusedError",
             "error": "[Errno 111] Connect call failed ('10.0.0.2', 22)"}
    with pytest.raises(AirflowFailException) as failed:
        resume(deferral, event)
    message = str(failed.value)
    assert "answered no SSH login for 600 s (ssh_ready_timeout_seconds)" in message
    assert "port 22 refused the connection" in message and "Connect call failed" in message
    assert "allowing tcp:22 from the workers' addresses to the network tag" in message

    event = {"status": "unreachable", "error_type": "HostKeysNotPublished", "error": "VM x has published none"}
    with pytest.raises(AirflowFailException, match="its guest agent published no host keys"):
        resume(deferral, event)


def test_a_host_key_not_the_vms_fails_without_retries(fake):
    deferral = deferred(lambda: check())
    with pytest.raises(HostKeyMismatch, match="not the ssh-ed25519 key"):
        resume(deferral, {"status": "refused", "kind": "host_key", "message": "... is not the ssh-ed25519 key ..."})
    assert issubclass(HostKeyMismatch, AirflowFailException)


def test_a_refused_login_with_os_login_on_for_a_run_without_it_fails_at_once(fake):
    deferral = deferred(lambda: check())
    fake.os_login = True
    with pytest.raises(LoginRefused, match=r"OS Login is enabled for VM .* Set the Param os_login"):
        resume(deferral, {"status": "refused", "kind": "login", "message": "10.0.0.2 refused", "first_refused": 1_010})


def test_a_refused_login_is_polled_on_by_the_trigger_for_the_grace_then_fails(fake):
    deferral = deferred(lambda: check())
    fake.now = 1_020
    again = deferred(lambda: resume(deferral, {"status": "refused", "kind": "login", "message": "10.0.0.2 refused",
                                               "first_refused": 1_010}))
    # The guest agent may not have made the user yet: the trigger tries on until the grace ends.
    assert again.trigger.first_refused == 1_010
    assert again.trigger.refused_until == 1_010 + vm_access.LOGIN_GRACE_SECONDS
    assert STORE == {"ssh_wait_since_try1_g0": 1_000, f"login_refused_since_{make_spec().vm_name}_try1_g0": 1_010}
    fake.now = 1_010 + vm_access.LOGIN_GRACE_SECONDS
    with pytest.raises(LoginRefused, match=r"for 90 s\)\. .*Param os_login"):
        resume(again, {"status": "refused", "kind": "login", "message": "10.0.0.2 refused", "first_refused": 1_010})


def test_a_login_refused_on_the_worker_gives_the_trigger_its_grace(fake):
    fake.login = LoginRefused("10.0.0.2 refused the SSH login")
    deferral = deferred(lambda: check())
    assert deferral.trigger.first_refused == 1_000
    assert deferral.trigger.refused_until == 1_000 + vm_access.LOGIN_GRACE_SECONDS


def test_no_ssh_target_just_now_checks_again_on_the_worker_after_a_pause(fake):
    deferral = deferred(lambda: check())
    fake.target_error = OSError("Compute API: connection reset")
    fake.now += 30
    pause = deferred(lambda: resume(deferral, {"status": "look_again"}))
    assert isinstance(pause.trigger, TimeDeltaTrigger) and pause.method_name == "resume_check"
    fake.target_error, fake.login = None, None
    assert resume(pause, {"moment": "2026-12-03T00:00:00+00:00"}) == pinned(make_spec().vm_name)
    assert fake.autostops == 1 and fake.slept == [5]  # read twice, a poll apart


def test_not_deferrable_it_pokes_as_before(fake, monkeypatch):
    """deferrable=False ([maxtext_sft] ssh_wait_deferrable = false): BaseSensorOperator's poke loop."""
    monkeypatch.setattr(sensors.BaseSensorOperator, "execute",
                        lambda self, context: ("poked", self.poke(context), self.poke(context)))
    fake.login = None
    poked, first, second = check(deferrable=False)
    assert first is False  # the keys read once
    assert second.is_done and second.xcom_value == pinned(make_spec().vm_name)  # the same a poke later


def test_a_retry_waits_its_own_bound(fake):
    """As a poking sensor's wait began again with each try."""
    deferred(lambda: check())
    fake.now += 600
    Try.try_number = 2
    try:
        assert deferred(lambda: check()).trigger.deadline == 1_600 + 600
    finally:
        Try.try_number = 1


# ----- a slice: every host, one trigger for the hosts still waiting --------------------------------

HOSTS = [{"name": f"slice-host-{n}", "ip": f"10.0.0.{n + 2}", "id": str(100 + n)} for n in range(3)]


def slice_sensor():
    from tests.plugins.test_slice_spec import make_slice_spec

    return sensors.SliceSshReadySensor(
        task_id="wait_for_ssh", spec=make_slice_spec(ssh_ready_timeout_seconds=600).to_dict(), hosts=HOSTS,
        gcp_conn_id="gcp", ssh_conn_id="ssh", poke_interval=5, capacity_first_read_seconds=60,
    )


def resume_slice(deferral: TaskDeferred, event):
    return slice_sensor().resume_execution(deferral.method_name, {"event": event}, context())


def test_a_slice_defers_one_trigger_for_the_hosts_still_waiting(fake):
    fake.logins = {"slice-host-0": None}  # host 0 answers the worker's check
    deferral = deferred(lambda: slice_sensor().execute(context()))
    second = deferred(lambda: resume_slice(deferral, {"ready": [], "host_keys": {}, "events": {
        "slice-host-1": {"status": "look_again"}, "slice-host-2": {"status": "look_again"}}}))
    assert fake.autostopped == ["slice-host-0"]  # its keys read a second time, the same: pinned
    trigger = second.trigger
    assert isinstance(trigger, SliceSshReadyTrigger) and second.method_name == "resume_after_logins"
    assert [host["vm_name"] for host in trigger.hosts] == ["slice-host-1", "slice-host-2"]
    assert {host["deadline"] for host in trigger.hosts} == {1_600} and trigger.first_event_after == 60
    assert json.loads(json.dumps(trigger.serialize()[1])) == trigger.serialize()[1]

    # The trigger saw both log in: their autostops, and the wait is over.
    keys = {"ssh-ed25519": "CCCC"}
    done = resume_slice(second, {"ready": ["slice-host-1", "slice-host-2"],
                                 "host_keys": {"slice-host-1": keys, "slice-host-2": keys}, "events": {}})
    assert done["host_keys"] == {"slice-host-0": TARGET["host_keys"], "slice-host-1": keys, "slice-host-2": keys}
    assert fake.autostopped == ["slice-host-0", "slice-host-1", "slice-host-2"]


def test_a_slice_host_refused_goes_back_to_the_trigger_with_the_others_still_waiting(fake):
    deferral = deferred(lambda: slice_sensor().execute(context()))
    fake.now, fake.logins = 1_020, {"slice-host-0": None}  # host 0 answers now
    event = {"ready": ["slice-host-2"], "host_keys": {"slice-host-2": TARGET["host_keys"]}, "events": {"slice-host-1": {
        "status": "refused", "kind": "login", "message": "10.0.0.3 refused", "first_refused": 1_010}}}
    again = deferred(lambda: resume_slice(deferral, event))
    # Host 0's keys read once on the worker (the trigger reads them again); no host's autostop twice.
    assert fake.autostopped == ["slice-host-2"]
    host_0, host = again.trigger.hosts
    assert host_0["vm_name"] == "slice-host-0" and host_0["host_keys"] == TARGET["host_keys"]
    assert host["vm_name"] == "slice-host-1" and host["refused_until"] == 1_010 + vm_access.LOGIN_GRACE_SECONDS


def test_a_slice_past_its_bound_names_every_waiting_hosts_last_error(fake):
    deferral = deferred(lambda: slice_sensor().execute(context()))
    fake.now += 600
    unreachable = {"status": "unreachable", "error_type": "TimeoutError", "error": ""}
    with pytest.raises(AirflowFailException) as failed:
        resume_slice(deferral, {"ready": ["slice-host-0"], "host_keys": {"slice-host-0": TARGET["host_keys"]},
                                "events": {"slice-host-1": unreachable, "slice-host-2": unreachable}})
    reasons = str(failed.value).split("; ")
    assert [reason.split()[1] for reason in reasons] == ["slice-host-1", "slice-host-2"]
    assert all("answered no SSH login for 600 s" in reason and "did not complete" in reason for reason in reasons)


def test_a_slice_host_gone_fails_the_run(fake):
    deferral = deferred(lambda: slice_sensor().execute(context()))
    fake.not_running = {"slice-host-2": "gone (deleted outside this run's teardown)"}
    with pytest.raises(AirflowFailException, match=r"Host 2 \(slice-host-2\) is gone"):
        resume_slice(deferral, {"ready": [], "events": {"slice-host-2": {"status": "look_again"}}})
