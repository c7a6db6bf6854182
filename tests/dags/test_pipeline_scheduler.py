"""The pipeline under Airflow's real scheduler, for what dag.test() cannot do.

Airflow runs as separate components (localcloud.airflow_harness) on the session's PostgreSQL
server. The two tests that kill a component and need settings of their own share one Airflow on
a database of its own; the test whose Airflow comes back whole shares one with the files that
only act through the REST API (SHARED_AIRFLOW_GROUP: test_pipeline_run_actions.py,
test_pipeline_slice.py); the waits for capacity share one in test_pipeline_capacity.py."""

from __future__ import annotations

import ipaddress
from datetime import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.dags import fault_tally
from tests.dags.conftest import (
    SHARED_AIRFLOW_GROUP, module_airflow, wait_for_run_end, wait_for_training_watched, wait_until,
)

pytestmark = pytest.mark.e2e

HEARTBEAT_TIMEOUT_SECONDS = 15


# The two tests that kill Airflow's components share one Airflow (its start costs half a minute
# of two busy cores). A file's tests run on one worker in the file's order (tests/conftest.py):
# the killed worker's test leaves its Airflow whole, then the killed scheduler's test never
# restarts the scheduler and ends with the graceful stop.
@pytest.fixture(scope="module")
def airflow(tmp_path_factory, pipeline_connections, postgres_server, migrated_database):
    """The kill tests' Airflow: a try whose heartbeats stop fails within seconds, and the training
    sensor in reschedule mode (a poke is a task process on a worker, which the worker test kills;
    the killed scheduler's test is indifferent to the mode)."""
    settings = {
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT_SECONDS),
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "2",
        "AIRFLOW__MAXTEXT_SFT__TRAINING_WAIT_DEFERRABLE": "false",
    }
    with module_airflow(tmp_path_factory, pipeline_connections, postgres_server, migrated_database, settings) as instance:
        yield instance


def _marked_processes(home: Path) -> list[int]:
    """Live processes started for this Airflow home (they carry the harness's mark)."""
    from localcloud.airflow_harness import HOME_MARK

    mark = f"{HOME_MARK}={home}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if mark in Path(f"/proc/{name}/environ").read_bytes().split(b"\0"):
                if Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(name))
        except OSError:
            pass
    return found


def _group_alive(pgid: int) -> bool:
    """Whether a process group has a live member (zombies waiting to be reaped do not count)."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                return True
    return False


def _vm_name(airflow, run_id: str) -> str:
    return wait_until(lambda: (airflow.xcom(run_id, "plan_run", "spec") or {}).get("vm_name"), 60, "the run's spec")


def _instance_label(name: str, key: str) -> str:
    from localcloud.connections import LOCAL_PROJECT
    from maxtext_sft.cloud.compute import ComputeEngineEndpointHook

    instance = ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default").get_instance(
        resource_id=name, zone="us-east5-b", project_id=LOCAL_PROJECT
    )
    return instance.labels[key]


# ----- a killed worker mid-training (issue 5's row that needs a scheduler) -------

def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _connected_to(pid: int, ip: str, port: int) -> bool:
    """Whether process `pid` holds an established TCP connection to ip:port (read from /proc)."""
    try:
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        table = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    remote = f"{socket.htonl(int(ipaddress.IPv4Address(ip))):08X}:{port:04X}"
    for row in table:
        fields = row.split()
        if fields[2] == remote and fields[3] == "01" and f"socket:[{fields[9]}]" in inodes:  # 01: ESTABLISHED
            return True
    return False


def _task_process(ti_id: str) -> int | None:
    """The task runner of task instance `ti_id`: the Task SDK titles it `airflow worker -- TI_ID`;
    its parent, the LocalExecutor worker that supervises it, `airflow worker -- LocalExecutor: TI_ID`."""
    for name in os.listdir("/proc"):
        if name.isdigit() and _cmdline(int(name)) == f"airflow worker -- {ti_id}":
            return int(name)
    return None


def test_a_worker_killed_mid_poke_is_retried_and_the_run_succeeds(airflow, local_cloud):
    """SIGKILL the worker and the task process while the sensor's poke waits for the VM's (frozen)
    sshd (the sensor in reschedule mode, as the slice's is): the scheduler fails the try by its
    missing heartbeat, the retry watches on, the run succeeds and the VM is deleted."""
    from localcloud.connections import LOCAL_RUN_CONF

    fault_tally.fault_injected()
    local_cloud.clear_requests()
    # Training outlasts the kill and the heartbeat timeout; a poke waits up to 2 min for a banner.
    local_cloud.set_vm_file("maxtext-faults.json", json.dumps({"seconds_per_step": 1.0}))
    conf = {**LOCAL_RUN_CONF, "steps": 60, "ssh_connect_timeout_seconds": 120}
    vm_name = None
    try:
        run_id = airflow.trigger(conf)
        wait_for_training_watched(airflow, run_id)
        [vm] = local_cloud.vms()
        vm_name, vm_ip = vm["name"], vm["ip"]
        local_cloud.set_sshd_paused(vm_name, True)  # the next poke blocks in SSH connect

        def sensor_in_ssh_connect():
            ti = airflow.get(f"/api/v2/dags/maxtext_sft/dagRuns/{run_id}/taskInstances/wait_for_final_checkpoint")
            pid = _task_process(ti["id"]) if ti["state"] == "running" else None
            return pid and _connected_to(pid, vm_ip, 22) and (ti, pid)

        killed_ti, task_pid = wait_until(sensor_in_ssh_connect, 120, "a poke to wait in SSH connect")
        worker_pid = _parent(task_pid)
        assert _cmdline(worker_pid) == f"airflow worker -- LocalExecutor: {killed_ti['id']}"
        # The supervisor first, so nothing reports the task's end; then the task's own group.
        os.kill(worker_pid, signal.SIGKILL)
        os.killpg(task_pid, signal.SIGKILL)
        wait_until(lambda: _task_process(killed_ti["id"]) is None, 30, "the task process to die")
        local_cloud.set_sshd_paused(vm_name, False)

        final = wait_for_run_end(airflow, run_id, timeout=420)
    finally:
        local_cloud.set_vm_file("maxtext-faults.json", "{}")
    leaked = local_cloud.vms()
    fault_tally.vms_left(leaked)
    assert leaked == []
    states = airflow.task_states(run_id)
    assert final["state"] == "success", states
    sensor = airflow.get(f"/api/v2/dags/maxtext_sft/dagRuns/{run_id}/taskInstances/wait_for_final_checkpoint")
    assert sensor["try_number"] == killed_ti["try_number"] + 1
    # The scheduler's record that it failed the try for its missing heartbeat.
    query = {"dag_id": "maxtext_sft", "run_id": run_id, "task_id": "wait_for_final_checkpoint", "event": "heartbeat timeout"}
    timeouts = airflow.get(f"/api/v2/eventLogs?{urllib.parse.urlencode(query)}")
    assert [entry["try_number"] for entry in timeouts["event_logs"]] == [killed_ti["try_number"]], timeouts
    assert airflow.xcom(run_id, "wait_for_final_checkpoint")["final_step"] == 60
    deletes = [r for r in local_cloud.requests() if r["method"] == "DELETE"]
    assert len(deletes) == 1 and deletes[0]["status"] == 200


# ----- a killed scheduler mid-training (last on this Airflow: it is never restarted) -------

def test_a_scheduler_killed_mid_training_leaves_no_vm(airflow, local_cloud):
    """SIGKILL the scheduler mid-training of two runs and never restart it: each VM must still go,
    one by its maxRunDuration (the cloud's lifetime), the other (its lifetime left to Airflow) by
    the janitor command alone. One Airflow for both: the backstops act on each run's own VM.
    The harness itself (localcloud.airflow_harness) is checked on the way: each component in a
    process group of its own, the scheduler's killed alone, and a graceful stop leaving nothing."""
    from localcloud.airflow_harness import COMPONENTS
    from localcloud.connections import LOCAL_PROJECT, LOCAL_RUN_CONF

    lifetime = 60
    conf = {**LOCAL_RUN_CONF, "steps": 50, "max_run_duration_minutes": lifetime // 60}
    local_cloud.set_vm_file("maxtext-faults.json", json.dumps({"train_sft": {"stall_at_step": 3}}))
    try:
        by_cloud = airflow.trigger({**conf, "cloud_enforced_lifetime": True})
        by_janitor = airflow.trigger({**conf, "cloud_enforced_lifetime": False})
        for run_id in (by_cloud, by_janitor):
            wait_for_training_watched(airflow, run_id)
        groups = {name: airflow.processes[name].pid for name in COMPONENTS}
        assert len(set(groups.values())) == 4 and all(os.getpgid(pgid) == pgid for pgid in groups.values())
        airflow.kill_scheduler()
        started = time.time()  # at most this long after each VM started: its lifetime ends <= started + lifetime
        assert not _group_alive(groups["scheduler"]) and not airflow.running("scheduler")
        for name in ("api-server", "dag-processor", "triggerer"):
            assert airflow.running(name) and _group_alive(groups[name]), name
        assert airflow.health()["metadatabase"]["status"] == "healthy"  # the API still answers
        vm_of = {run_id: _vm_name(airflow, run_id) for run_id in (by_cloud, by_janitor)}
        assert {vm["name"] for vm in local_cloud.vms()} == set(vm_of.values())
        expires = int(_instance_label(vm_of[by_janitor], "expires-at"))

        # Compute Engine may act up to 30 s late; the local cloud acts within a second or two.
        cloud_deleted = lambda: vm_of[by_cloud] not in {vm["name"] for vm in local_cloud.vms()}  # noqa: E731
        wait_until(cloud_deleted, lifetime + 35, "the VM's lifetime to delete it")
        assert time.time() <= started + lifetime + 35

        wait_until(lambda: time.time() > expires + 1, lifetime + 10, "the other VM's expiry to pass")
        # Nothing else removes it: no scheduler, no cloud lifetime.
        assert [vm["name"] for vm in local_cloud.vms()] == [vm_of[by_janitor]]
        result = subprocess.run(
            [sys.executable, "-m", "maxtext_sft.tasks.janitor", "--project", LOCAL_PROJECT],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": str(REPO / "plugins")},
        )
        assert result.returncode == 0, result.stderr
        assert "its lifetime ended" in result.stderr and vm_of[by_janitor] in result.stderr, result.stderr
        assert local_cloud.vms() == []
        assert not airflow.running("scheduler")
    finally:
        local_cloud.set_vm_file("maxtext-faults.json", "{}")
    # A graceful stop (SIGTERM, its default grace) leaves no process of this Airflow home; the
    # fixture's own stop at teardown then finds nothing to do.
    airflow.stop()
    assert not any(_group_alive(pgid) for pgid in groups.values())
    assert _marked_processes(airflow.home) == []


AUTOSTOP_MINUTES = 0.5


# Its Airflow comes back whole: the files that only act through the REST API go on using it.
@SHARED_AIRFLOW_GROUP
def test_with_airflow_dead_the_vm_stops_itself_after_its_training_and_a_returning_airflow_finishes_the_run(
    shared_airflow, local_cloud
):
    """SIGKILL the scheduler and the triggerer mid-training: no poke checks the VM any more. The
    training runs to its end; autostop_idle_minutes later the VM shuts its guest down and the
    instance is TERMINATED (billing no TPU time). Printed: the VM time billed after the training
    ended. Then Airflow comes back: the training sensor finds the VM stopped and the final step
    committed in storage (its final loss and loss curve from the step lines the training copied
    there), the export makes the VM again, and the run succeeds with no VM left."""
    from localcloud.connections import LOCAL_RUN_CONF
    from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
    from maxtext_sft.run.spec import RunSpec

    airflow = shared_airflow
    fault_tally.fault_injected()
    bucket = "scheduler-autostop"
    local_cloud.create_bucket(bucket, exist_ok=True)
    run_id = airflow.trigger({
        **LOCAL_RUN_CONF, "steps": 12, "poke_interval_seconds": 2, "autostop_idle_minutes": AUTOSTOP_MINUTES,
        "output_location": f"gs://{bucket}/{time.time_ns()}",
    })
    spec = RunSpec.from_dict(wait_until(lambda: airflow.xcom(run_id, "plan_run", "spec"), 120, "the run's spec"))
    wait_for_training_watched(airflow, run_id)
    airflow.kill_scheduler()
    airflow.kill("triggerer")
    compute = ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default")
    where = {"resource_id": spec.vm_name, "zone": spec.zone, "project_id": spec.project_id}
    try:
        stopped = wait_until(
            lambda: (i := compute.get_instance(**where)).status == "TERMINATED" and i, 300, "the VM to stop itself"
        )
        [exit_code] = (local_cloud.state_dir / "vms" / spec.vm_name / "home").glob(
            f"*/maxtext-sft-runs/{spec.run_name}/exit_code"
        )
        assert exit_code.read_text().strip() == "0"  # the training ran to its end with Airflow away
        training_ended = exit_code.stat().st_mtime
        stopped_at = datetime.fromisoformat(stopped.last_stop_timestamp).timestamp()
        billed_after_end = stopped_at - training_ended
        print(f"VM time billed after the training ended: {billed_after_end:.1f} s "
              f"(autostop_idle_minutes={AUTOSTOP_MINUTES:g}, Airflow dead)")
        # The bound, plus the watchdog's check interval and the guest's shutdown.
        assert AUTOSTOP_MINUTES * 60 <= billed_after_end <= AUTOSTOP_MINUTES * 60 + 20

        airflow.start_scheduler()
        airflow.start_component("triggerer")
        final = wait_for_run_end(airflow, run_id, timeout=420)
    finally:
        try:
            compute.delete_instance(request_id=None, **where)
        except Exception:  # noqa: BLE001 - gone already: the run deleted it
            pass
    states = airflow.task_states(run_id)
    assert final["state"] == "success", states
    assert local_cloud.vms() == []
    training = airflow.xcom(run_id, "wait_for_final_checkpoint")
    assert training["final_step"] == 12 and training["vm_recoveries"] == 0
    # The loss outlived the stopped VM: the training copied its step lines to storage as it exited.
    assert float(training["final_loss"]) > 0
    record = airflow.xcom(run_id, "collect_outputs")
    assert [step for step, _ in record["loss_history"]] == list(range(1, 13)) and record["loss_curve"]
    export_log = json.dumps(airflow.task_log(run_id, "export_to_hf"))
    assert "Made VM" in export_log  # the stopped VM was replaced by the step that needed one



@SHARED_AIRFLOW_GROUP
def test_through_iap_the_workers_and_the_triggerer_reach_the_vm_as_the_connections_account(shared_airflow, local_cloud):
    """With ssh_via_iap, Airflow's real components reach the VM through IAP: the workers' steps and
    the triggerer's waits each open their tunnel in their own process, under the Google connection's
    service account (no gcloud on either; cloud/iap_tunnel.py)."""
    from localcloud.connections import LOCAL_PROJECT, LOCAL_RUN_CONF, LOCAL_SERVICE_ACCOUNT

    airflow = shared_airflow
    member = f"serviceAccount:{LOCAL_SERVICE_ACCOUNT}"
    local_cloud.grant_iap_tunnel_user(LOCAL_PROJECT, member)
    try:
        run_id = airflow.trigger({**LOCAL_RUN_CONF, "steps": 4, "ssh_via_iap": True})
        final = wait_for_run_end(airflow, run_id, timeout=300)
    finally:
        local_cloud.revoke_iap_tunnel_user(LOCAL_PROJECT, member)
    assert final["state"] == "success", airflow.task_states(run_id)
    assert local_cloud.vms() == []
    vm_name = airflow.xcom(run_id, "plan_run", "spec")["vm_name"]
    tunnels = [e for e in local_cloud.iap_requests() if e.get("instance") == vm_name]
    assert {(e["caller"], e["outcome"]) for e in tunnels} == {(LOCAL_SERVICE_ACCOUNT, "connected")}, tunnels
    assert {e["user_agent"] for e in tunnels} == {"maxtext-sft-worker", "maxtext-sft-triggerer"}, tunnels
