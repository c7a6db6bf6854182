"""The training sensor's clocks, kept in the task state store across reschedules: how long the VM
has not answered (past unreachable_timeout_seconds it is replaced; any poke that reaches it
starts the clock again), and how long a recovery has waited for a machine (past
max_capacity_wait_minutes the run fails)."""

from __future__ import annotations

import pytest

from airflow.sdk.exceptions import AirflowFailException

from maxtext_sft.sensors import vm as sensors
from maxtext_sft.sensors.vm import TrainingCheckpointSensor
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


@pytest.fixture
def recoveries(monkeypatch):
    made = Recoveries()

    class Recovery:
        def __init__(self, spec, **_):
            pass

        def recover(self, reason, *, replace=False, lost_after_step=None):
            made.append((reason, replace))
            made.lost_after_step = lost_after_step
            return made.machine_free

    monkeypatch.setattr(sensors, "VmRecovery", Recovery)
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
    assert f"VM {spec.vm_name} has answered no SSH for 600 s (unreachable_timeout_seconds=600" in reason
    assert "timed out" in reason
    assert recoveries.lost_after_step == 342  # for the recovery's record: the steps it loses
    assert store == {"last_step_g0": 342}  # the replacement starts a new clock


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


def test_a_recovery_waits_for_a_machine_up_to_max_capacity_wait_minutes(clock, recoveries):
    spec = make_spec(output_location="gs://team/sft", max_capacity_wait_minutes=30)
    store = StateStore()
    recoveries.machine_free = False
    for waited in (0, 600, 1799):  # each poke finds the VM gone and no machine for a new one
        clock.now = 1_000 + waited
        fresh_sensor(spec)._recover_gone_vm(poke_context(store), spec)
    assert store == {"capacity_wait_since_g0": 1_000}

    clock.now = 1_000 + 1800
    with pytest.raises(AirflowFailException, match=r"no machine was free to recreate it for 30 minutes "
                       r"\(max_capacity_wait_minutes=30, reservation my-reservation\)"):
        fresh_sensor(spec)._recover_gone_vm(poke_context(store), spec)


def test_a_recovery_that_got_its_machine_stops_the_wait_clock(clock, recoveries):
    spec = make_spec(output_location="gs://team/sft")
    store = StateStore()
    recoveries.machine_free = False
    fresh_sensor(spec)._recover_gone_vm(poke_context(store), spec)
    recoveries.machine_free = True
    clock.now += 60
    fresh_sensor(spec)._recover_gone_vm(poke_context(store), spec)
    assert store == {} and len(recoveries) == 2
