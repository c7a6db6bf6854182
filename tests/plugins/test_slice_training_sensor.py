"""A slice's wait_for_final_checkpoint deferrable: its check of every host on the worker, what it
gives the slice's status trigger, and what it does with each of the trigger's events (resumed as
Airflow resumes it, in a new task process: a new sensor object, the same task state store). The
hosts' training_status.sh lines, the Compute API and storage are faked."""

from __future__ import annotations

import json
import shlex

import pytest

from airflow.sdk.exceptions import AirflowFailException, AirflowSensorTimeout, TaskDeferred

from maxtext_sft.vm.ssh_common import HostKeyMismatch, LoginRefused
from maxtext_sft.tasks import vm_sensors as sensors
from maxtext_sft.vm.slice_hosts import NOT_RECOVERED
from maxtext_sft.vm.training_watch import SliceTrainingStatusTrigger
from tests.plugins.test_slice_spec import make_slice_spec
from tests.plugins.test_unreachable_bound import DagRun, StateStore

HOSTS = [{"name": f"slice-host-{n}", "ip": f"10.0.0.{n + 2}", "id": str(100 + n)} for n in range(3)]
SPEC = make_slice_spec(stall_timeout_seconds=900, unreachable_timeout_seconds=600)


def status(state: str, exit_code: str = "none", last_step: int = 3, **more) -> str:
    fields = {"state": state, "exit_code": exit_code, "last_step": last_step, "last_loss": "1.5", "out_of_data": "no",
              "idle_seconds": 5, **more}
    return "MAXTEXT_SFT_STATUS " + " ".join(f"{key}={value}" for key, value in fields.items())


RUNNING = ["completed step: 3, seconds: 1.0, loss: 1.5", status("running")]
KILLED = ["--- tail of train.log", "jax: heartbeat lost", "Killed", status("failed", "137")]
CRASHED = ["--- tail of train.log", "Traceback (most recent call last):", "ValueError: boom", status("failed", "1")]
NOT_STARTED = ["MAXTEXT_SFT_STATUS state=failed exit_code=none last_step=none last_loss=none reason=no-training-started"]


class FakeSlice:
    """What the worker's checks meet: each host's training_status.sh lines (or the error its read
    raises), each host's state in the Compute API, the final commit marker in storage."""

    def __init__(self):
        self.now = 1_000.0
        self.lines: dict[str, list[str] | BaseException] = {host["name"]: RUNNING for host in HOSTS}
        self.not_running: dict[str, str] = {}
        self.committed = False
        self.reads: list[str] = []
        self.recreated_on_read: str | None = None  # a host its group re-creates as the worker reads it


@pytest.fixture
def fake(monkeypatch):
    made = FakeSlice()

    def read_training_status(self, spec):
        made.reads.append(spec.vm_name)
        if spec.vm_name == made.recreated_on_read:  # a blank disk: no training there
            made.not_running[spec.vm_name] = "gone: deleted outside this run's teardown, and re-created by its group as instance 999"
            return 0, list(NOT_STARTED)
        lines = made.lines[spec.vm_name]
        if isinstance(lines, BaseException):
            raise lines
        return 0, list(lines)

    def check_hosts_running(specs, gcp_conn_id):
        for spec in specs:
            if spec.vm_name in made.not_running:
                raise AirflowFailException(f"Host {spec.host_index} ({spec.vm_name}) of slice {spec.group_name} is "
                                           f"{made.not_running[spec.vm_name]}: {NOT_RECOVERED}")

    class Remake:
        def __init__(self, spec, **_):
            self.name = spec.vm_name

        def status(self):
            return None if "gone" in made.not_running.get(self.name, "") else "RUNNING"

    class Storage:
        def __init__(self, **_):
            pass

        def uri_exists(self, uri):
            return made.committed

        def committed_steps(self, checkpoints_dir):
            return []

    class Recovery:  # a slice's host is never recovered: none counted
        def __init__(self, spec, **_):
            pass

        def count(self):
            return 0

    def ssh_target(spec, gcp_conn_id):
        return {"host": next(h["ip"] for h in HOSTS if h["name"] == spec.vm_name),
                "host_keys": {"ssh-ed25519": f"KEY-{spec.vm_name}"}, "username": None, "iap": None}

    STORE.clear()
    monkeypatch.setattr(sensors.time, "time", lambda: made.now)
    monkeypatch.setattr(sensors.TrainingCheckpointSensor, "_read_training_status", read_training_status)
    monkeypatch.setattr(sensors, "check_hosts_running", check_hosts_running)
    monkeypatch.setattr(sensors, "VmRemake", Remake)
    monkeypatch.setattr(sensors, "StorageEndpointHook", Storage)
    monkeypatch.setattr(sensors, "VmRecovery", Recovery)
    monkeypatch.setattr(sensors, "ssh_target", ssh_target)
    return made


STORE = StateStore()  # cleared by the `fake` fixture


class Try:
    try_number = 1


def context() -> dict:
    """A task process's context: one run's task state store, this try."""
    return {"task_state_store": STORE, "dag_run": DagRun(), "ti": Try()}


def sensor(**kwargs):
    return sensors.SliceTrainingSensor(
        task_id="wait_for_final_checkpoint", spec=SPEC.to_dict(), hosts=HOSTS, gcp_conn_id="gcp", ssh_conn_id="ssh",
        hf_conn_id="hf", capacity_first_read_seconds=60, **kwargs,
    )


def deferred(call) -> TaskDeferred:
    with pytest.raises(TaskDeferred) as raised:
        call()
    return raised.value


def check() -> TaskDeferred:
    """The try's first task process: its check on the worker, which defers."""
    return deferred(lambda: sensor().execute(context()))


def resume(deferral: TaskDeferred, *, host_0=None, hosts=None):
    """A new task process resumes the task as Airflow does, with the slice trigger's event."""
    event = {"host_0": host_0, "hosts": hosts or {}}
    return sensor().resume_execution(deferral.method_name, {**(deferral.kwargs or {}), "event": event}, context())


def host_0_event(output: list[str], **more) -> dict:
    return {"status": "training", "exit_status": 0, "output": output, "last_step": 3, "answered": True, **more}


def test_the_first_check_reads_every_host_then_defers_to_the_slices_trigger(fake):
    deferral = check()
    assert sorted(fake.reads) == sorted(host["name"] for host in HOSTS)  # the step scripts uploaded on each
    trigger = deferral.trigger
    assert isinstance(trigger, SliceTrainingStatusTrigger) and deferral.method_name == "resume_after_hosts"
    assert [host["vm_name"] for host in trigger.hosts] == [host["name"] for host in HOSTS]  # host 0 first
    assert [host["host"] for host in trigger.hosts] == [host["ip"] for host in HOSTS]
    assert [host["host_keys"] for host in trigger.hosts] == [{"ssh-ed25519": f"KEY-{h['name']}"} for h in HOSTS]
    assert trigger.instance_ids == {host["name"]: host["id"] for host in HOSTS}
    specs = SPEC.on_hosts(HOSTS)
    assert [host["command"] for host in trigger.hosts] == [sensors.remote_command("training_status", s) for s in specs]
    watched = trigger.hosts[0]
    assert watched["deadline"] == 1_000 + SPEC.training_timeout_hours * 3600
    assert watched["poll_interval"] == SPEC.poke_interval_seconds and watched["stall_timeout_seconds"] == 900
    assert trigger.first_event_after == 60
    # What the triggerer is given: plain JSON values, the connections' ids, nothing of Hugging Face's.
    _, kwargs = trigger.serialize()
    assert json.loads(json.dumps(kwargs)) == kwargs
    assert {(host["ssh_conn_id"], host["gcp_conn_id"]) for host in kwargs["hosts"]} == {("ssh", "gcp")}
    assert '"hf"' not in json.dumps(kwargs)
    assert all(shlex.split(host["command"])[1].endswith("/training_status.sh") for host in kwargs["hosts"])


def test_another_host_dead_at_the_first_check_fails_without_deferring(fake):
    fake.lines["slice-host-2"] = KILLED
    with pytest.raises(AirflowFailException) as failed:
        sensor().execute(context())
    assert str(failed.value).startswith(
        f"Training {SPEC.run_name} exited with code 137 (killed by SIGKILL) on host 2 (slice-host-2); last log lines:")
    assert "Killed" in str(failed.value)


def test_a_host_re_created_as_the_worker_reads_it_is_named_lost_not_a_training_never_started(fake):
    """Its group re-creates a deleted host under its name between the worker's Compute API check
    and its read of that host's training status: a blank disk, no training. Asked again, the API
    names the cause (CI saw "No training was ever started" for the host a test had deleted)."""
    fake.recreated_on_read = "slice-host-2"
    with pytest.raises(AirflowFailException, match=rf"Host 2 \(slice-host-2\) of slice .* is gone: deleted outside this "
                                                   rf"run's teardown, and re-created by its group .*: {NOT_RECOVERED}"):
        sensor().execute(context())


def test_a_host_the_worker_cannot_read_is_not_a_death(fake):
    fake.lines["slice-host-1"] = OSError("[Errno 111] Connection refused")
    assert isinstance(check().trigger, SliceTrainingStatusTrigger)


def test_another_hosts_dead_training_from_the_trigger_fails_naming_it(fake):
    deferral = check()
    fake.reads.clear()
    with pytest.raises(AirflowFailException) as failed:
        resume(deferral, hosts={"slice-host-2": {"status": "training", "output": KILLED},
                                "slice-host-1": {"status": "training", "output": NOT_STARTED}})
    assert str(failed.value).split("\n")[:2] == [
        "No training was ever started on host 1 (slice-host-1)",  # in worker order
        f"Training {SPEC.run_name} exited with code 137 (killed by SIGKILL) on host 2 (slice-host-2); last log lines:",
    ]
    assert str(failed.value).endswith("jax: heartbeat lost\nKilled")
    assert fake.reads == []  # judged from the trigger's reads


def test_a_host_lost_fails_the_run_naming_it(fake):
    deferral = check()
    fake.not_running = {"slice-host-1": "gone (deleted outside this run's teardown)"}
    with pytest.raises(AirflowFailException, match=rf"Host 1 \(slice-host-1\) of slice .* is gone .*: {NOT_RECOVERED}"):
        resume(deferral, hosts={"slice-host-1": {"status": "lost", "state": "gone (deleted outside this run's teardown)"}})


def test_a_host_the_trigger_saw_lost_but_running_to_the_worker_is_checked_and_watched_again(fake):
    deferral = check()
    fake.now += 600
    fake.reads.clear()
    again = deferred(lambda: resume(deferral, hosts={"slice-host-1": {"status": "lost", "state": "STOPPING"}}))
    assert isinstance(again.trigger, SliceTrainingStatusTrigger) and again.method_name == "resume_after_hosts"
    assert sorted(fake.reads) == sorted(host["name"] for host in HOSTS)  # a check of every host
    assert again.trigger.hosts[0]["deadline"] == deferral.trigger.hosts[0]["deadline"]  # the same wait


@pytest.mark.parametrize(("kind", "error", "message"), [
    ("host_key", HostKeyMismatch, "SSH host key of 10.0.0.4 is not one the VM slice-host-2 published ..."),
    ("login", LoginRefused, "10.0.0.4 refused the SSH login with the connection's key: ..."),
])
def test_another_hosts_refused_key_or_login_fails_naming_it(fake, kind, error, message):
    deferral = check()
    with pytest.raises(error) as failed:
        resume(deferral, hosts={"slice-host-2": {"status": "refused", "kind": kind, "message": message}})
    assert str(failed.value) == f"Host 2 (slice-host-2): {message}"


def test_host_0s_finished_training_is_the_result(fake):
    deferral = check()
    fake.committed = True
    output = [status("exited", "0", last_step=SPEC.steps)]
    result = resume(deferral, host_0=host_0_event(output, last_step=SPEC.steps))
    assert result == {"final_step": SPEC.steps, "final_loss": "1.5", "final_checkpoint": SPEC.final_checkpoint_path,
                      "vm_recoveries": 0}


def test_host_0s_crash_names_the_other_hosts_that_died_on_their_own_first(fake):
    deferral = check()
    fake.lines["slice-host-1"] = KILLED  # read on the worker, as a poke reads it
    with pytest.raises(AirflowFailException) as failed:
        resume(deferral, host_0=host_0_event(CRASHED))
    message = str(failed.value)
    assert message.startswith(f"Training {SPEC.run_name} exited with code 137 (killed by SIGKILL) on host 1 (slice-host-1)")
    assert f"\nHost 0: Training {SPEC.run_name} on slice-host-0 ended without its final checkpoint" in message
    assert message.count("Host 0:") == 1 and message.endswith("ValueError: boom")


def test_host_0s_crash_alone_is_named_as_on_one_vm(fake):
    deferral = check()
    with pytest.raises(AirflowFailException, match=r"^Training .* on slice-host-0 ended without its final checkpoint "
                                                   r".*training exited with code 1 after step 3"):
        resume(deferral, host_0=host_0_event(CRASHED))


def test_host_0_without_a_status_is_checked_on_the_worker_once(fake):
    """The worker's check uploads the scripts; a host dead by then is named once, not as host 0's cause too."""
    deferral = check()
    fake.reads.clear()
    again = deferred(lambda: resume(deferral, host_0={"status": "no_status", "exit_status": 127,
                                                      "output": ["no such file"], "last_step": None, "answered": True}))
    assert sorted(fake.reads) == sorted(host["name"] for host in HOSTS)
    assert isinstance(again.trigger, SliceTrainingStatusTrigger)

    fake.lines["slice-host-0"], fake.lines["slice-host-2"] = CRASHED, KILLED
    with pytest.raises(AirflowFailException) as failed:
        resume(again, host_0={"status": "no_status", "exit_status": 127, "output": [], "last_step": None,
                              "answered": True})
    assert str(failed.value).count("on host 2 (slice-host-2)") == 1


def test_host_0_unanswering_is_watched_until_its_bound_then_fails_the_run(fake):
    deferral = check()
    again = deferred(lambda: resume(deferral, host_0={"status": "unreachable", "error": "OSError: refused",
                                                      "last_step": 3, "answered": False}))
    assert again.trigger.hosts[0]["unreachable_deadline"] == 1_000 + 600  # polled on by the trigger
    fake.now += 600
    with pytest.raises(AirflowFailException, match=rf"VM slice-host-0 has answered no SSH for 600 s .*: {NOT_RECOVERED}"):
        resume(again, host_0={"status": "unreachable", "error": "OSError: refused", "last_step": 3, "answered": False})


def test_the_timeout_fails_the_sensor(fake):
    deferral = check()
    with pytest.raises(AirflowSensorTimeout, match="training_timeout_hours"):
        resume(deferral, host_0={"status": "timeout", "last_step": 3, "answered": True})


def test_not_deferrable_it_pokes_as_before(fake, monkeypatch):
    """deferrable=False ([maxtext_sft] training_wait_deferrable = false): reschedule-mode pokes."""
    monkeypatch.setattr(sensors.BaseSensorOperator, "execute", lambda self, context: ("poked", self.poke(context)))
    poking = sensor(deferrable=False)
    assert poking.mode == "reschedule"
    assert poking.execute(context()) == ("poked", False)
    fake.lines["slice-host-1"] = NOT_STARTED
    with pytest.raises(AirflowFailException, match=r"^No training was ever started on host 1 \(slice-host-1\)$"):
        poking.execute(context())
