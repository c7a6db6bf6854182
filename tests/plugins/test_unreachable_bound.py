"""The training sensor's clocks, kept in the task state store across reschedules: how long the VM
has not answered (past unreachable_timeout_seconds it is replaced; any poke that reaches it
starts the clock again; a recreated VM has its boot's bound instead; a stopped one is lost at
once), and how long a recovery has waited for a machine (deferred to the capacity trigger, up to
max_capacity_wait_minutes; then the run fails)."""

from __future__ import annotations

import json
import shlex

import pytest

from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from maxtext_sft.tasks import vm_sensors as sensors
from maxtext_sft.tasks.vm_sensors import TrainingCheckpointSensor
from tests.plugins.test_spec import make_spec

CONNECTIONS = {"gcp_conn_id": "gcp", "ssh_conn_id": "ssh", "hf_conn_id": "hf"}


class StateStore(dict):
    """The task state store's get/set/delete, as one DAG run's task sees it across its pokes."""

    def set(self, key, value, retention=None):
        self[key] = value

    def delete(self, key):
        del self[key]


class DagRun:
    clear_number = 0


@pytest.fixture
def clock(monkeypatch):
    class Clock:
        now = 1_000.0

    monkeypatch.setattr(sensors.time, "time", lambda: Clock.now)
    return Clock


class Recoveries(list):
    machine_free = True  # what recover() finds: a machine for the new VM, or none (it waits)
    lost_after_step = None  # what the last recover() was told
    vm_status = "RUNNING"  # what the Compute API says of the unanswering VM
    final_step_committed = False  # whether storage holds the final checkpoint


@pytest.fixture
def recoveries(monkeypatch):
    made = Recoveries()

    class Remake:
        def __init__(self, spec, **_):
            self.spec = spec

        def status(self):
            return made.vm_status

        def capacity_wait_trigger(self, deadline, **_):
            return ("capacity trigger", deadline) if self.spec.reservation else None

    class Recovery:
        def __init__(self, spec, **_):
            self.remake = Remake(spec)

        def recover(self, reason, *, replace=False, lost_after_step=None, waited_since=None):
            made.append((reason, replace))
            made.lost_after_step = lost_after_step
            return made.machine_free

        def count(self):
            return len(made)

    class Storage:
        def __init__(self, **_):
            pass

        def uri_exists(self, uri):
            return made.final_step_committed

        def read_text(self, uri):  # the step lines start_training.sh copied as the training exited
            return "completed step: 39, seconds: 1.0, loss: 1.7\ncompleted step: 40, seconds: 1.0, loss: 1.5\n"

    monkeypatch.setattr(sensors, "VmRecovery", Recovery)
    monkeypatch.setattr(sensors, "VmRemake", Remake)
    monkeypatch.setattr(sensors, "StorageEndpointHook", Storage)
    monkeypatch.setattr(TrainingCheckpointSensor, "defer", lambda self, *, trigger, method_name: (_ for _ in ()).throw(
        TaskDeferred(trigger=trigger, method_name=method_name)))
    return made


def poke_context(store):
    return {"task_state_store": store, "dag_run": DagRun()}


def fresh_sensor(spec):
    """A new sensor object each poke, as a reschedule-mode sensor is a new process each poke."""
    return TrainingCheckpointSensor(task_id="wait_for_final_checkpoint", spec=spec.to_dict(), **CONNECTIONS)


def test_the_vm_is_replaced_once_unreachable_past_the_bound_across_reschedules(clock, recoveries):
    spec = make_spec(output_location="gs://team/sft", unreachable_timeout_seconds=600)
    store = StateStore()
    fresh_sensor(spec)._note_last_step(poke_context(store), 342)  # a poke that reached the VM saw step 342
    for waited in (0, 300, 599):
        clock.now = 1_000 + waited
        fresh_sensor(spec)._unreachable(poke_context(store), spec, OSError("timed out"))
    assert recoveries == [] and store == {"unreachable_since_g0": 1_000, "last_step_g0": 342}

    clock.now = 1_600
    fresh_sensor(spec)._unreachable(poke_context(store), spec, OSError("timed out"))

    [(reason, replace)] = recoveries
    assert replace is True
    assert f"VM {spec.vm_name} has answered no SSH for 600 s (unreachable_timeout_seconds: 600 s" in reason
    assert "timed out" in reason
    assert recoveries.lost_after_step == 342  # for the recovery's record: the steps it loses
    # The replacement's boot has a clock of its own.
    assert store == {"last_step_g0": 342, "new_vm_since_g0": 1_600}


def test_a_poke_that_reaches_the_vm_starts_the_clock_again(clock, recoveries):
    spec = make_spec(unreachable_timeout_seconds=600)
    store = StateStore()
    fresh_sensor(spec)._unreachable(poke_context(store), spec, OSError("timed out"))
    clock.now += 500
    fresh_sensor(spec)._stop_clock(poke_context(store), "unreachable_since")  # what a reaching poke does
    assert store == {}
    clock.now += 500
    fresh_sensor(spec)._unreachable(poke_context(store), spec, OSError("timed out"))
    assert recoveries == [] and store == {"unreachable_since_g0": clock.now}


def test_a_cleared_run_has_a_clock_of_its_own(clock, recoveries):
    spec = make_spec(unreachable_timeout_seconds=600)
    store = StateStore()
    fresh_sensor(spec)._unreachable(poke_context(store), spec, OSError("timed out"))
    cleared = {"task_state_store": store, "dag_run": type("Cleared", (), {"clear_number": 1})()}
    clock.now += 700
    fresh_sensor(spec)._unreachable(cleared, spec, OSError("timed out"))
    assert recoveries == [] and set(store) == {"unreachable_since_g0", "unreachable_since_g1"}


def test_without_a_state_store_the_sensor_object_keeps_the_clock(clock, recoveries):
    spec = make_spec(unreachable_timeout_seconds=10)
    sensor = fresh_sensor(spec)
    sensor._unreachable({}, spec, OSError("timed out"))
    clock.now += 10
    sensor._unreachable({}, spec, OSError("timed out"))
    assert len(recoveries) == 1


def test_a_recovery_waits_for_a_machine_deferred_up_to_max_capacity_wait_minutes(clock, recoveries):
    spec = make_spec(output_location="gs://team/sft", max_capacity_wait_minutes=30)
    store = StateStore()
    recoveries.machine_free = False
    for waited in (0, 600, 1799):  # each return from the trigger finds no machine for a new VM
        clock.now = 1_000 + waited
        with pytest.raises(TaskDeferred) as deferred:
            fresh_sensor(spec)._recover_gone_vm(poke_context(store), spec)
        # The trigger waits, the deadline counted from the first poke that found no machine.
        assert deferred.value.trigger == ("capacity trigger", 1_000 + 1800)
        assert deferred.value.method_name == "resume_after_capacity_wait"
    assert store == {"capacity_wait_since_g0": 1_000}

    clock.now = 1_000 + 1800
    with pytest.raises(AirflowFailException, match=r"no machine was free to recreate it for 30 minutes "
                       r"\(max_capacity_wait_minutes=30, reservation my-reservation\)"):
        fresh_sensor(spec)._recover_gone_vm(poke_context(store), spec)


def test_a_recovery_that_got_its_machine_stops_the_wait_clock(clock, recoveries):
    spec = make_spec(output_location="gs://team/sft")
    store = StateStore()
    recoveries.machine_free = False
    with pytest.raises(TaskDeferred):
        fresh_sensor(spec)._recover_gone_vm(poke_context(store), spec)
    recoveries.machine_free = True
    clock.now += 60
    fresh_sensor(spec)._recover_gone_vm(poke_context(store), spec)
    assert store == {"new_vm_since_g0": 1_060} and len(recoveries) == 2


def test_a_stopped_vm_is_lost_at_once(clock, recoveries):
    """TERMINATED (its guest shut down, as its autostop does with the pipeline away): no clock."""
    spec = make_spec(output_location="gs://team/sft", unreachable_timeout_seconds=600)
    store = StateStore()
    recoveries.vm_status = "TERMINATED"
    assert fresh_sensor(spec)._unreachable(poke_context(store), spec, OSError("connection refused")) is False
    [(reason, replace)] = recoveries
    assert replace is True and "is stopped (TERMINATED" in reason


def test_a_lost_vm_whose_training_finished_is_not_recovered(clock, recoveries):
    spec = make_spec(output_location="gs://team/sft", steps=40)
    recoveries.vm_status, recoveries.final_step_committed = "TERMINATED", True
    done = fresh_sensor(spec)._unreachable(poke_context(StateStore()), spec, OSError("connection refused"))
    assert recoveries == []
    assert done.is_done and done.xcom_value["final_step"] == 40 and done.xcom_value["final_loss"] == "1.5"


def test_a_recreated_vm_has_its_boot_bound_not_the_unreachable_one(clock, recoveries):
    spec = make_spec(output_location="gs://team/sft", unreachable_timeout_seconds=10)
    store = StateStore({"new_vm_since_g0": 1_000})
    clock.now = 1_000 + 300  # far past unreachable_timeout_seconds, within the boot's bound
    fresh_sensor(spec)._unreachable(poke_context(store), spec, OSError("connection refused"))
    assert recoveries == []
    clock.now = 1_000 + sensors.SSH_WAIT_SECONDS
    fresh_sensor(spec)._unreachable(poke_context(store), spec, OSError("connection refused"))
    [(reason, replace)] = recoveries
    assert replace and "the recreated VM's boot: 600 s" in reason


@pytest.mark.parametrize("status", [None, "TERMINATED"], ids=["gone", "stopped"])
def test_wait_for_ssh_is_done_at_once_for_a_vm_gone_or_stopped(recoveries, monkeypatch, status):
    """The step after it makes the VM again; waiting for a stopped VM's SSH would only time out."""
    recoveries.vm_status = status
    monkeypatch.setattr(sensors, "SshLoginProbe", lambda *_: pytest.fail("no login is tried"))
    spec = make_spec()
    sensor = sensors.VmSshReadySensor(task_id="wait_for_ssh", spec=spec.to_dict(), gcp_conn_id="gcp", ssh_conn_id="ssh")
    assert sensor.poke({}) is True


# ----- the deferrable sensor: what it does with each event of its status trigger ------------------

TARGET = {"host": "10.0.0.2", "host_keys": {"ssh-ed25519": "AAAA"}, "username": None, "iap": None}


@pytest.fixture
def status_events(monkeypatch, clock, recoveries):
    """The sensor's resume from a status trigger's event: it re-defers (TaskDeferred) or ends."""
    monkeypatch.setattr(sensors, "ssh_target", lambda spec, gcp_conn_id: TARGET)

    def resume(spec, store, event):
        return fresh_sensor(spec).resume_after_status(poke_context(store), {"last_step": None, **event})

    return resume


def test_an_unanswering_vm_is_watched_on_by_the_trigger_until_its_bound(clock, status_events):
    spec = make_spec(unreachable_timeout_seconds=600)
    store = StateStore()
    with pytest.raises(TaskDeferred) as deferred:
        status_events(spec, store, {"status": "unreachable", "error": "OSError: refused", "answered": False})
    assert store["unreachable_since_g0"] == 1_000  # the clock started; the trigger polls on until its bound
    assert store["watch_since_try0_g0"] == 1_000  # and training_timeout_hours from the first check
    trigger = deferred.value.trigger
    assert trigger.unreachable_deadline == 1_600 and trigger.host == "10.0.0.2"
    assert trigger.host_keys == TARGET["host_keys"]  # the VM's published keys, the only ones accepted

    clock.now = 1_100  # the VM answered in between, then went silent again: a new clock
    with pytest.raises(TaskDeferred) as deferred:
        status_events(spec, store, {"status": "unreachable", "error": "OSError: refused", "answered": True})
    assert store["unreachable_since_g0"] == 1_100 and deferred.value.trigger.unreachable_deadline == 1_700
    assert deferred.value.trigger.deadline == 1_000 + spec.training_timeout_hours * 3600


def test_a_try_begun_on_the_triggerer_keeps_its_clock_from_there(clock, status_events):
    """The start trigger's event says when the try's watch began: training_timeout_hours runs from
    then, not from the worker's first stretch (hours later, at the training's end)."""
    spec = make_spec()
    store = StateStore()
    with pytest.raises(TaskDeferred) as deferred:
        status_events(spec, store, {"status": "unreachable", "error": "OSError: refused", "answered": False,
                                    "watch_since": 400.0})
    assert store["watch_since_try0_g0"] == 400.0
    assert deferred.value.trigger.deadline == 400.0 + spec.training_timeout_hours * 3600


def test_no_ssh_target_on_the_triggerer_sends_the_worker_to_check(clock, status_events, monkeypatch):
    checks = []
    monkeypatch.setattr(TrainingCheckpointSensor, "_check", lambda self, context: checks.append(self.run_spec) or "checked")
    spec = make_spec()
    store = StateStore()
    answer = status_events(spec, store, {"status": "check", "error": "NotFound: no VM", "answered": False,
                                         "watch_since": 900.0})
    assert answer == "checked" and checks == [spec]
    assert store["watch_since_try0_g0"] == 900.0


def test_each_try_starts_on_the_triggerer_with_plan_runs_spec_rendered_there():
    """No worker holds a slot to start the wait: the scheduler defers each try to TrainingStartTrigger
    (start_from_trigger), whose `spec` is a template of plan_run's XCom (a template field of the
    task, so Airflow 3.3's triggerer renders it). A reschedule-mode sensor, a spec given as a value,
    and a slice (its hosts are create_slice's XCom) start on the worker."""
    from airflow.sdk import DAG, task

    with DAG("start_from_trigger", schedule=None):
        @task(multiple_outputs=True)
        def plan_run():
            return {"spec": {}, "hosts": []}

        run = plan_run()
        sensor = TrainingCheckpointSensor(task_id="wait", spec=run["spec"], **CONNECTIONS)
        polling = TrainingCheckpointSensor(task_id="poll", spec=run["spec"], deferrable=False, **CONNECTIONS)
        on_a_slice = sensors.SliceTrainingSensor(task_id="slice", spec=run["spec"], hosts=run["hosts"], **CONNECTIONS)
    assert sensor.start_from_trigger is True
    args = sensor.start_trigger_args
    assert args.trigger_cls == "maxtext_sft.vm.training_watch.TrainingStartTrigger"
    assert args.next_method == "resume_after_status" and args.timeout is None
    assert args.trigger_kwargs == {"spec": "{{ ti.xcom_pull(task_ids='plan_run', key='spec', map_indexes=-1) | tojson }}",
                                   "ssh_conn_id": "ssh", "gcp_conn_id": "gcp"}
    assert "spec" in sensor.template_fields  # the triggerer renders only the task's template fields
    assert not polling.start_from_trigger and not on_a_slice.start_from_trigger
    assert not fresh_sensor(make_spec()).start_from_trigger


def test_a_crash_seen_by_the_trigger_fails_the_sensor_with_its_tail(status_events, recoveries, monkeypatch):
    monkeypatch.setattr(TrainingCheckpointSensor, "_vm_status", lambda self, spec: "RUNNING")
    spec = make_spec()
    store = StateStore()
    output = ["--- tail of train.log", "Traceback (most recent call last):", "ValueError: boom",
              "MAXTEXT_SFT_STATUS state=failed exit_code=1 last_step=6 last_loss=2.1 out_of_data=no idle_seconds=3"]
    with pytest.raises(AirflowFailException, match="training exited with code 1 after step 6") as failed:
        status_events(spec, store, {"status": "training", "exit_status": 0, "output": output, "last_step": 6,
                                    "answered": True})
    assert "ValueError: boom" in str(failed.value)
    assert store == {"last_step_g0": 6}


def test_a_finished_training_seen_by_the_trigger_is_the_sensors_result(status_events, recoveries):
    spec = make_spec()  # no output location: the final checkpoint on the VM, as the script reports
    output = ["MAXTEXT_SFT_STATUS state=succeeded exit_code=0 last_step=40 last_loss=1.5 out_of_data=no idle_seconds=1"]
    result = status_events(spec, StateStore(), {"status": "training", "exit_status": 0, "output": output,
                                                "last_step": 40, "answered": True})
    assert result == {"final_step": 40, "final_loss": "1.5", "final_checkpoint": spec.final_checkpoint_path,
                      "vm_recoveries": 0}


def test_a_refused_key_or_login_and_the_timeout_fail_the_sensor(status_events):
    from maxtext_sft.vm.ssh_common import HostKeyMismatch, LoginRefused
    from airflow.sdk.exceptions import AirflowSensorTimeout

    spec = make_spec()
    with pytest.raises(HostKeyMismatch, match="not one the VM"):
        status_events(spec, StateStore(), {"status": "refused", "kind": "host_key", "message": "not one the VM"})
    with pytest.raises(LoginRefused, match="refused the SSH login"):
        status_events(spec, StateStore(), {"status": "refused", "kind": "login", "message": "refused the SSH login"})
    with pytest.raises(AirflowSensorTimeout, match="training_timeout_hours"):
        status_events(spec, StateStore(), {"status": "timeout"})


def test_the_trigger_holds_plain_values_and_no_secret(status_events):
    """What the triggerer is given (the trigger's kwargs, stored in Airflow's database): plain JSON
    values, the SSH and Google connections' ids, the status script's command line: nothing of the
    Hugging Face connection, whose token only the steps that need it take."""
    from maxtext_sft.vm.steps import STEPS

    spec = make_spec()
    with pytest.raises(TaskDeferred) as deferred:
        status_events(spec, StateStore(), {"status": "unreachable", "error": "OSError: refused", "answered": False})
    _, kwargs = deferred.value.trigger.serialize()
    assert json.loads(json.dumps(kwargs)) == kwargs
    assert (kwargs["ssh_conn_id"], kwargs["gcp_conn_id"]) == ("ssh", "gcp")
    assert CONNECTIONS["hf_conn_id"] not in kwargs.values()
    assert shlex.split(kwargs["command"])[1].endswith("/training_status.sh")
    assert STEPS["training_status"].needs_hf_token is False
