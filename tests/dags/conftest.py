"""Fixtures that run the pipeline DAG against the local cloud: with `dag.test()`, or through Airflow's
real components (a scheduler, dag-processor, triggerer and api-server)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import itertools
import json
import os
import re
import sys
import threading
import time

import pytest

from localcloud.airflow_harness import Airflow
from localcloud.compute.first_boot import FirstBoot
from localcloud.connections import LOCAL_RUN_CONF
from tests.conftest import GC_THRESHOLDS, REPO


@dataclasses.dataclass
class PipelineRun:
    state: str
    run_id: str
    task_states: dict[str, str]
    xcoms: dict[str, object]
    try_numbers: dict[str, int] = dataclasses.field(default_factory=dict)  # each task's last try
    end_dates: dict[str, datetime.datetime | None] = dataclasses.field(default_factory=dict)  # each task's (UTC)
    log: str = ""  # every log line of the run's tasks, as the task logs show them

    def report(self) -> str:
        """For an assertion's message: the tasks that did not succeed, then the last errors the
        run's tasks raised (each traceback's final line), short enough to survive CI's excerpt."""
        unfinished = {task: state for task, state in sorted(self.task_states.items()) if state != "success"}
        errors = [line.strip()[:400] for line in self.log.splitlines() if ERROR_LINE.match(line)]
        return "\n".join([f"run {self.state}; tasks not succeeded: {unfinished}", *errors[-6:]])


# The last line of a traceback: "package.module.SomeError: message" (or a bare builtin name).
ERROR_LINE = re.compile(r"^\s*[\w.]*(Error|Exception|Exit|Timeout|NotFound|Failed)\w*: ")


class _Tee(io.TextIOBase):
    """sys.stdout for the length of a run: what the run's task loggers write, kept and passed on."""

    def __init__(self, passthrough):
        self.passthrough = passthrough
        self.kept = io.StringIO()

    def write(self, text):
        self.kept.write(text)
        return self.passthrough.write(text)

    def flush(self):
        self.passthrough.flush()


# dag.test() runs a deferred task's trigger inline, in its own process: no executor report can race
# an early event (apache/airflow#72716): the capacity gate may read again after a second.
DAG_TEST_SETTINGS = {"AIRFLOW__MAXTEXT_SFT__CAPACITY_FIRST_READ_SECONDS": "1"}


def parse_pipeline_dag(dag_id: str = "maxtext_sft"):
    """A freshly parsed DAG: its operators' loggers (cached on first use) bind to this run's stdout."""
    from airflow.dag_processing.dagbag import DagBag

    with pytest.MonkeyPatch.context() as patch:
        for name, value in DAG_TEST_SETTINGS.items():
            patch.setenv(name, value)
        bag = DagBag(str(REPO / "dags"))
    assert bag.import_errors == {}
    return bag.dags[dag_id]


# Run conf over run_pipeline's for a run of the real MaxText (minutes of training on CPU): the
# sensor checks every 5 s instead of every second (each check is a task run in the test's process
# and an SSH session: measured, 142 checks and 94 s of a core in one rehearsal's training).
REAL_MAXTEXT_DAG_TEST_CONF = {"poke_interval_seconds": 5}
# A whole-DAG test on the real MaxText may run past pytest.ini's 900 s: beside the suite on two
# cores the pipeline's took 630-924 s (CI once stopped it at 900 s, inside its own waits' bounds),
# and a machine of this kind can be twice as slow. Each stage keeps its own bound within it.
REAL_MAXTEXT_TIMEOUT = 2400


@pytest.fixture(scope="session")
def run_pipeline(airflow_db, pipeline_connections, local_cloud):
    """Run the DAG once: `conf` over the local defaults, with the given cloud and MaxText faults."""

    def run(
        conf: dict | None = None,
        *,
        maxtext_faults: dict | None = None,
        cloud_faults: dict | None = None,
        dag_id: str = "maxtext_sft",
    ):
        local_cloud.set_vm_file("maxtext-faults.json", json.dumps(maxtext_faults or {}))
        local_cloud.set_faults(cloud_faults or {})
        local_cloud.clear_requests()
        tee = _Tee(sys.stdout)
        try:
            sys.stdout = tee
            run_conf = {**LOCAL_RUN_CONF, "steps": 30, "poke_interval_seconds": 1, **(conf or {})}
            run = collect(parse_pipeline_dag(dag_id).test(run_conf=run_conf))
        finally:
            sys.stdout = tee.passthrough
            local_cloud.set_vm_file("maxtext-faults.json", "{}")
            local_cloud.set_faults({})
        run.log = tee.kept.getvalue()
        return run

    return run


def collect(dag_run) -> PipelineRun:
    from airflow.models import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        tis = session.scalars(
            select(TaskInstance).where(TaskInstance.dag_id == dag_run.dag_id, TaskInstance.run_id == dag_run.run_id)
        ).all()
        xcoms = session.scalars(
            select(XComModel).where(XComModel.dag_id == dag_run.dag_id, XComModel.run_id == dag_run.run_id)
        ).all()
        return PipelineRun(
            state=str(dag_run.state),
            run_id=dag_run.run_id,
            task_states={ti.task_id: str(ti.state) for ti in tis},
            xcoms={f"{x.task_id}.{x.key}": XComModel.deserialize_value(x) for x in xcoms},
            try_numbers={ti.task_id: ti.try_number for ti in tis},
            end_dates={ti.task_id: ti.end_date for ti in tis},
        )


# ----- a first boot as unkind as a real VM's (localcloud/compute/first_boot.py) --------------------


@pytest.fixture
def first_boot(local_cloud):
    """first_boot(cloud_init_seconds, dpkg_lock_seconds): the VMs the test makes boot through
    cloud-init running and unattended-upgrades holding dpkg's lock; a FirstBootWatch over the run
    samples what the VMs showed. The session's cloud boots without a first boot again after."""
    watches: list[FirstBootWatch] = []

    def set_first_boot(cloud_init_seconds: float, dpkg_lock_seconds: float) -> FirstBootWatch:
        local_cloud.set_first_boot(FirstBoot(cloud_init_seconds, dpkg_lock_seconds))
        watches.append(FirstBootWatch(local_cloud))
        return watches[-1]

    yield set_first_boot
    for watch in watches:
        watch.close()
    local_cloud.set_first_boot(FirstBoot())


# The first boot of the real-MaxText runs' VMs: cloud-init runs 3 minutes, unattended-upgrades holds
# dpkg's lock 4 (the issue asks for "long enough to matter, e.g. 2 minutes"; public reports speak of
# minutes). Their images have MaxText, so install_maxtext.sh skips before any apt call and nothing
# waits for them; the tests assert the phase was still in force when the install step ended (its
# VM reached it 20-60 s after boot here), and the holders die with their VMs.
REAL_RUN_FIRST_BOOT = (180, 240)


class FirstBootWatch:
    """What the cloud's VMs showed of their first boot, sampled every 2 s in a thread until
    closed: (UTC time, VM name, vm.first_boot_state()), read from the host (the compute emulator's
    vms(): cloud-init's state in the VM's /run, the VM's unattended-upgr)."""

    def __init__(self, cloud) -> None:
        self.samples: list[tuple[datetime.datetime, str, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(cloud,), name="first-boot-watch", daemon=True)
        self._thread.start()

    def _sample(self, cloud) -> None:
        while not self._stop.wait(2):  # the sampling interval (each sample scans /proc); nothing waits on it
            now = datetime.datetime.now(datetime.timezone.utc)
            self.samples += [(now, vm["name"], vm["first_boot"]) for vm in cloud.vms()]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def in_force_after(self, when: datetime.datetime) -> list[str]:
        """The VMs seen at or after `when` with cloud-init running and dpkg's lock held: as the
        holder starts before the VM's sshd answers, these were in their first boot until then."""
        return sorted({name for at, name, state in self.samples if at >= when
                       and state["cloud_init"] == "running" and state["dpkg_lock_holder"]})


# ----- Airflow's real components (localcloud.airflow_harness) on the session's PostgreSQL --------


# Most conditions read Airflow's REST API: each read costs its api-server 17-36 ms of CPU
# (measured), and a suite of tests that each wait out runs of minutes polls thousands of times.
# Every state these waits look for lasts for seconds (a run's end for good), so 2 s misses none.
WAIT_POLL_SECONDS = 2


def wait_until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(WAIT_POLL_SECONDS)  # polling interval; the condition is re-read each time
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def wait_for_training_watched(airflow, run_id: str) -> None:
    wait_until(
        lambda: airflow.task_states(run_id).get("wait_for_final_checkpoint") in ("running", "up_for_reschedule", "deferred"),
        240,
        "training to be watched",
    )


def wait_for_run_end(airflow, run_id: str, timeout: float = 240, dag_id: str | None = None) -> dict:
    def ended():
        run = airflow.run(run_id, dag_id)
        return run if run["state"] in ("success", "failed") else None

    return wait_until(ended, timeout, "the run to end")


# What every test's Airflow runs with, unless the test sets its own:
AIRFLOW_TEST_SETTINGS = {
    # An event of a deferral a worker made waits out the executor's report of that deferral
    # (apache/airflow#72716): by default 60 s, which a run of the stand-in (a training of seconds)
    # sat out after its training and after each recovery. 10 s is twice what the recovery and
    # capacity tests have passed with beside the whole suite.
    "AIRFLOW__MAXTEXT_SFT__CAPACITY_FIRST_READ_SECONDS": "10",
    # A test's DAG files do not change: re-parsed every 2 minutes, not 30 s (1.75 CPU-s a minute
    # of each Airflow's life, measured). A first parse that timed out on a loaded machine (with
    # the harness's 150 s for a parse) is still retried within the waits of the tests for it.
    "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "120",
    # An idle scheduler loops every second (1.07 CPU-s a minute of each Airflow's life more than
    # at 2 s, measured); a loop that finds work runs the next at once, so a run's tasks still
    # follow each other without waiting, and a task's end is seen within 2 s.
    "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "2",
    # The session's garbage-collector thresholds (tests/conftest.py), set by tests/airflow_site.
    "TESTS_GC_THRESHOLDS": ",".join(map(str, GC_THRESHOLDS)),
}
# Put first on the PYTHONPATH of every test Airflow's components.
AIRFLOW_SITE = REPO / "tests" / "airflow_site"


# At a test's end nothing waits on Airflow's graceful exit (measured: 13 s for the scheduler,
# dag-processor and triggerer, 6 s more for the api-server): what is still up after this is killed,
# with the task runners it left. The killed-scheduler test (test_pipeline_scheduler.py) checks
# the graceful stop itself.
TEARDOWN_STOP_GRACE_SECONDS = 3


@contextlib.contextmanager
def airflow_on_fresh_database(home, env: dict, postgres_server, migrated_database, prefix="scheduler", **options):
    """Airflow started on a fresh copy of the migrated database, with AIRFLOW_TEST_SETTINGS under
    `env`; stopped, and the copy dropped, at exit."""
    database, url = migrated_database(prefix)
    instance = Airflow(home, {**AIRFLOW_TEST_SETTINGS, **env}, database_url=url, database_migrated=True,
                       site_dirs=(AIRFLOW_SITE,), **options)
    try:
        instance.start()
        yield instance
    finally:
        instance.stop(grace=TEARDOWN_STOP_GRACE_SECONDS)
        postgres_server.drop_database(database)


@pytest.fixture
def start_airflow(tmp_path, pipeline_connections, postgres_server, migrated_database):
    """start_airflow(settings, **harness_options): Airflow on a fresh migrated database, stopped
    (and its database dropped) at the end of the test."""
    homes = (tmp_path / f"airflow-home-{n}" for n in itertools.count())
    with contextlib.ExitStack() as started:

        def start(settings: dict | None = None, **options) -> Airflow:
            env = {**os.environ, **pipeline_connections, **(settings or {})}
            return started.enter_context(
                airflow_on_fresh_database(next(homes), env, postgres_server, migrated_database, **options)
            )

        yield start


@contextlib.contextmanager
def module_airflow(tmp_path_factory, pipeline_connections, postgres_server, migrated_database,
                   settings: dict | None = None, **options):
    """Airflow with the project's DAGs for a module-scoped fixture: `settings` over the
    environment and the pipeline's connections, in an Airflow home of its own (harness options as
    airflow_on_fresh_database takes them); its start-up, half a minute of two busy cores, is paid
    once for the module's tests."""
    env = {**os.environ, **pipeline_connections, **(settings or {})}
    home = tmp_path_factory.mktemp("airflow-home")
    with airflow_on_fresh_database(home, env, postgres_server, migrated_database, **options) as instance:
        yield instance


# The tests that each start and finish runs of their own and leave Airflow's components as they
# found them (none killed for good, no settings of their own) share one Airflow across files:
# marked with this group, they run one after another on one worker (--dist loadgroup), and their
# Airflow is stopped after the group's last test (pytest_runtest_teardown below), not kept to the
# session's end, where its idle loops would cost about 4.5 s of CPU a minute.
SHARED_AIRFLOW_GROUP = pytest.mark.xdist_group("shared_airflow")


class _SharedAirflow:
    """The shared Airflow, started on first use and again if asked for after a stop (a run without
    pytest-xdist may put another file's tests between the group's)."""

    def __init__(self):
        self.stack = contextlib.ExitStack()
        self.instance: Airflow | None = None

    def get(self, *fixtures) -> Airflow:
        if self.instance is None:
            self.instance = self.stack.enter_context(module_airflow(*fixtures))
        return self.instance

    def stop(self) -> None:
        self.instance = None
        self.stack.close()


_shared_airflow = _SharedAirflow()


@pytest.fixture(scope="module")
def shared_airflow(tmp_path_factory, pipeline_connections, postgres_server, migrated_database):
    """One Airflow for the tests of SHARED_AIRFLOW_GROUP's files."""
    return _shared_airflow.get(tmp_path_factory, pipeline_connections, postgres_server, migrated_database)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop the shared Airflow after the last test that uses it, before the fixtures it stands on
    (the session's PostgreSQL server) are torn down."""
    if "shared_airflow" in item.fixturenames and (nextitem is None or "shared_airflow" not in nextitem.fixturenames):
        _shared_airflow.stop()

