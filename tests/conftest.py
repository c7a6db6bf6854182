"""Test-wide setup: an isolated Airflow home (SQLite), configured before anything imports Airflow;
the local cloud; and a private PostgreSQL server for the tests that run a real scheduler."""

from __future__ import annotations

import fcntl
import gc
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from pathlib import Path

import pytest

from localcloud.cloud import LocalCloud, LocalCloudError
from localcloud.connections import (
    BARE_IMAGE_KEY,
    REHEARSAL_IMAGE_KEY,
    airflow_connection_env,
    generate_ssh_private_key,
    new_hf_token,
    prepare_local_cloud,
)
from localcloud.images import TUTORIAL_IMAGE, build_bare_image, build_fast_image
from localcloud.postgres import PostgresInUse, PostgresServer
from tests.dags import fault_tally

REPO = Path(__file__).resolve().parents[1]
_AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="maxtext-sft-airflow-"))
# The PostgreSQL clusters' folders, POSTGRES_ROOT-0, -1...: reachable by the unprivileged user
# PostgreSQL runs as (pytest's own temp folders are private to root) and the same for every run of
# this checkout, so a run finds and stops a server a killed run left behind. A session takes the
# first folder no live session holds (two sessions of one checkout can run side by side).
POSTGRES_ROOT = Path(tempfile.gettempdir()) / f"maxtext-sft-postgres-{hashlib.sha256(str(REPO).encode()).hexdigest()[:12]}"
POSTGRES_SLOTS = 8
# The cyclic garbage collector's thresholds for the session's processes and its Airflow's
# (tests/airflow_site). At Python's (700, 10, 10), importing Airflow, the providers and their
# clients sets off full collections over the million objects they leave, 0.3 s of CPU each: 15-23 %
# of an Airflow component's CPU in a 95-s test, measured. At these, a scheduler-run test and three
# dag.test() runs took 91 CPU-s instead of 99 (process accounting). Little of it is garbage.
GC_THRESHOLDS = (50_000, 20, 20)
gc.set_threshold(*GC_THRESHOLDS)

os.environ.update(
    {
        "AIRFLOW_HOME": str(_AIRFLOW_HOME),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "false",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "false",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{_AIRFLOW_HOME}/airflow.db",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        # Retries in seconds, not the production half minute.
        "AIRFLOW__MAXTEXT_SFT__RETRY_DELAY_SECONDS": "1",
        # The local Hub has no Xet storage (see localcloud.connections); huggingface_hub reads this
        # when first imported, so it is set before anything imports it.
        "HF_HUB_DISABLE_XET": "1",
    }
)


def poll(condition, timeout: float, what: str | None = None, *, interval: float = 0.1):
    """The first truthy value of `condition()`, polled every `interval` for up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what or condition}: not true after {timeout} s"
        time.sleep(interval)  # polling interval; the condition is re-read each time


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_AIRFLOW_HOME, ignore_errors=True)
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: its tally goes to the controller
        session.config.workeroutput["fault_tally"] = dict(fault_tally.TALLY)


_GROUP_KEY = pytest.StashKey[str]()  # an item's xdist group (its file, or itself when spread)


def pytest_configure(config):
    # pytest-xdist (3.x) deals out loadgroup's groups largest first by their number of tests, not in
    # collection order: the order below would be undone, and the real-MaxText files (one or two
    # tests each, minutes of work) dealt out among the last. Keep the collection order.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def expected_cost(item) -> int:
    """How long a test takes, roughly, as a rank (0: the longest): the real-MaxText pipeline runs
    (minutes of CPU each) and the floor's run (minutes, a pytest of its own), then the tests that
    run Airflow's real components (they use the session's PostgreSQL server: a scheduler start-up
    and whole runs), then the other whole-DAG runs and the tests of the real image, then the rest
    (seconds)."""
    real, e2e = item.get_closest_marker("real_maxtext"), item.get_closest_marker("e2e")
    if (real and e2e) or item.get_closest_marker("floor"):
        return 0
    if "postgres_server" in item.fixturenames:
        return 1
    if real or e2e or "run_pipeline" in item.fixturenames:
        return 2
    return 3


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """For pytest-xdist's `--dist loadgroup` (make test): a file's tests stay on one worker, so
    its module-scoped fixtures (one pipeline run that many tests read, say) run once; a file
    marked `spread` (independent whole-DAG runs, like the fault matrix) is dealt out test by test."""
    for item in items:
        if item.get_closest_marker("spread") is None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    # The longest first: the workers take groups in the order of their first test (pytest_configure
    # above), so the real-MaxText runs start at once on both workers and the seconds-long tests
    # fill both workers' tails (measured on a whole run: the workers ended 11 s apart; dealt largest
    # group first, the same tests would have left one worker idle for the last 161 s). A group goes
    # where its costliest test would; the sort is stable, so files keep their order within a rank.
    group_cost: dict[str, int] = {}
    for item in items:
        marker = item.get_closest_marker("xdist_group")
        group = marker.kwargs.get("name", marker.args[0] if marker.args else "") if marker else item.nodeid
        group_cost[group] = min(group_cost.get(group, 3), expected_cost(item))
        item.stash[_GROUP_KEY] = group
    items.sort(key=lambda item: group_cost[item.stash[_GROUP_KEY]])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: add up the fault tallies of the workers."""
    fault_tally.add(node.workeroutput.get("fault_tally", {}))


def pytest_unconfigure(config):
    """The fault tests' tally is the test output's last line (when any of them ran), printed once:
    by the controller when tests ran in parallel workers."""
    if fault_tally.TALLY["faults injected"] and not hasattr(config, "workeroutput"):
        print(fault_tally.tally_line())


def made_once(config, tmp_path_factory, name: str, make) -> Path:
    """A file the whole test run shares, made by `make(path)` in the first pytest-xdist worker that
    asks for it; the others wait on its lock, then read it."""
    root = tmp_path_factory.getbasetemp()
    if hasattr(config, "workerinput"):  # a worker (not the environment: a pytest it starts inherits that)
        root = root.parent  # the controller's temp folder, this run's: every worker's folder is in it
    path = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if not path.exists():
            partial = path.with_name(f"{name}.partial")
            make(partial)
            partial.rename(path)
    return path


def migrate(database_url: str) -> None:
    """`airflow db migrate` on the database at `database_url` (~4 s of CPU)."""
    subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"],
        check=True,
        capture_output=True,
        env={**os.environ, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": database_url},
    )


@pytest.fixture(scope="session")
def airflow_db(pytestconfig, tmp_path_factory) -> Path:
    """A migrated metadata database in the session's Airflow home: a copy of one SQLite file that
    the first worker migrated for every worker."""
    migrated = made_once(pytestconfig, tmp_path_factory, "airflow-migrated.db", lambda path: migrate(f"sqlite:///{path}"))
    shutil.copyfile(migrated, _AIRFLOW_HOME / "airflow.db")
    return _AIRFLOW_HOME


@pytest.fixture(scope="session")
def postgres_server():
    """A private PostgreSQL server for the session (fresh cluster, stopped at the end)."""
    servers = [PostgresServer(POSTGRES_ROOT.with_name(f"{POSTGRES_ROOT.name}-{slot}")) for slot in range(POSTGRES_SLOTS)]
    for server in servers:
        try:
            server.start()
            break
        except PostgresInUse:
            continue
    else:
        raise PostgresInUse(f"all {POSTGRES_SLOTS} PostgreSQL folders {POSTGRES_ROOT}-N are held by live sessions")
    try:
        for other in servers:
            if other is not server:
                other.reap_leftover()  # what killed sessions left in folders no one holds
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def migrated_database(postgres_server, pytestconfig, tmp_path_factory):
    """new_database(prefix) -> (name, url): a fresh database of the session server holding
    Airflow's schema, copied from a template (CREATE DATABASE ... TEMPLATE copies files: a second
    instead of an `airflow db migrate` per Airflow started). The first worker migrates its
    template and dumps it as SQL; the others' templates load that SQL."""
    template = "airflow_migrated_template"
    ready = False

    def new_database(prefix: str) -> tuple[str, str]:
        nonlocal ready
        if not ready:
            url = postgres_server.create_database(template)
            made_here = []

            def migrate_and_dump(path: Path) -> None:
                migrate(url)
                postgres_server.dump_database(template, path)
                made_here.append(path)

            dump = made_once(pytestconfig, tmp_path_factory, "airflow-migrated-postgres.sql", migrate_and_dump)
            if not made_here:
                postgres_server.load_database(template, dump)
            ready = True
        name = f"{prefix}_{uuid.uuid4().hex[:8]}"
        return name, postgres_server.create_database(name, template=template)

    return new_database


@pytest.fixture(scope="session")
def postgres_url(postgres_server) -> str:
    """The SQLAlchemy URL of the session server's `airflow` database (not migrated)."""
    return postgres_server.url


@pytest.fixture(scope="session")
def local_cloud(tmp_path_factory):
    fast = build_fast_image()
    # The rehearsal's public Ubuntu family boots the fast image too (tests of its real run add theirs).
    images = {TUTORIAL_IMAGE: fast, BARE_IMAGE_KEY: build_bare_image(), REHEARSAL_IMAGE_KEY: fast}
    state = tmp_path_factory.mktemp("cloud")
    with LocalCloud(state, images=images, keep_deleted_shm=True) as cloud:
        yield cloud


@pytest.fixture(autouse=True)
def no_vm_outlives_its_test(request):
    """Delete the VMs a test made and left in the session's local cloud (a failure or a timeout
    mid-run), as the cloud would at their lifetime: the next tests on this worker assert that no
    VM is left, and one failure must not fail them all. The test that left one fails on its own
    assertions. VMs that existed before the test (a module fixture's) are its fixture's to delete."""
    if "local_cloud" not in request.fixturenames:
        yield
        return
    cloud = request.getfixturevalue("local_cloud")
    before = {vm["name"] for vm in cloud.vms()}
    yield
    for vm in cloud.vms():
        if vm["name"] not in before:
            try:
                cloud.terminate_vm(vm["name"], "DELETE", project=vm.get("project"), zone=vm.get("zone"))
            except LocalCloudError:
                pass  # gone meanwhile (a delete that was still under way)


@pytest.fixture(scope="session")
def hf_token() -> str:
    return new_hf_token()


@pytest.fixture(scope="session")
def pipeline_connections(local_cloud, hf_token):
    prepare_local_cloud(local_cloud, hf_token)
    env = airflow_connection_env(local_cloud, generate_ssh_private_key(), hf_token)
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def local_bucket(local_cloud, name: str):
    """Bucket `name` of the local cloud (created if missing), as google-cloud-storage sees it."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    local_cloud.create_bucket(name, exist_ok=True)
    client = storage.Client(
        project="local-project", credentials=AnonymousCredentials(), client_options={"api_endpoint": local_cloud.storage_url}
    )
    return client.bucket(name)


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """`make dist`'s wheel, built from this checkout with the locked build backend (no download)."""
    uv = shutil.which("uv")
    assert uv, "uv is not on PATH (make venv installs it)"
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run([uv, "build", "--wheel", "--no-build-isolation", "--python", sys.executable, "-o", str(out), str(REPO)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    [found] = out.glob("*.whl")
    return found


@pytest.fixture(scope="session")
def wheel_site(wheel, tmp_path_factory) -> Path:
    """The wheel unpacked as a site directory (what pip puts in site-packages: the package and its
    dist-info, whose entry points importlib.metadata reads)."""
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site
