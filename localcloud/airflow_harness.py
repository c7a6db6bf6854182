"""Airflow as separate component processes sharing one home and one metadata database.

    airflow = Airflow(home, env, database_url=postgres_url)   # None: SQLite in the home
    airflow.start()            # db migrate, then api-server, scheduler, dag-processor, triggerer
    run_id = airflow.trigger({"steps": 10})
    airflow.kill_scheduler()   # SIGKILL to the scheduler's process group alone
    airflow.start_scheduler()  # a new scheduler on the same database
    airflow.stop()             # everything that remains

    Airflow(home, env, database_url=postgres_url, celery_broker_url=redis_url, celery_workers=2)
                               # CeleryExecutor, as docker-compose.yaml deploys it: the tasks run
                               # on Celery workers, each with a home and temp folder of its own

Unlike `airflow standalone`, each component is its own `python -m airflow COMPONENT` process in
its own session (process group), so one can be killed while the others keep running. The
api-server serves the REST API and the execution API the task runners use
(`[core] execution_api_server_url`); the scheduler runs tasks with the LocalExecutor (its
workers are in the scheduler's group, each task runner in a group of its own). Every process
started for a home carries `LOCALCLOUD_AIRFLOW_HOME=<home>` in its environment, which is how
`stop()` finds what a killed component left behind (task runners) and how `start()` finds what
a dead run left behind in the same home. Auth is the simple auth manager with every user an
admin: `GET /auth/token` hands out the API token, no password involved. `Airflow(..., users={"admin":
"pw"})` instead declares those users (admins) with those passwords: the UI asks them to log in and
the API token comes from `POST /auth/token` with the first user's name and password.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
CELERY_APP = "airflow.providers.celery.executors.celery_executor.app"
# A Celery worker's hostname, which task instances record: on one machine, each worker says its
# own (as each container of a compose deployment has its own).
WORKER_HOSTNAME_VAR = "LOCALCLOUD_WORKER_HOSTNAME"
HOME_MARK = "LOCALCLOUD_AIRFLOW_HOME"
# What a task process of the project's DAGs imports beyond Airflow: the DAG builders (with the
# Google provider's operators and client libraries), the SSH steps' hook, the sensors the DAG
# files name, and the task runner itself. See _component_env.
TASK_MODULES = (
    "airflow.sdk.execution_time.task_runner",
    "maxtext_sft.builders.pipeline",
    "airflow.providers.ssh.hooks.ssh",
    "airflow.providers.standard.sensors.external_task",
)
# Set for the scheduler alone (_component_env): the other components would start a forkserver of
# their own, importing TASK_MODULES (~6 s of CPU), only to fork the triggerer's serve-logs.
FORKSERVER_SETTINGS = ("AIRFLOW__CORE__MP_START_METHOD", "AIRFLOW__CORE__MP_FORKSERVER_PRELOAD")
SIMPLE_AUTH_MANAGER = "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"


class AirflowError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _live_pids(predicate) -> list[int]:
    """Pids of live (non-zombie) processes, other than ours, for which predicate(pid, pgrp) holds."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        pid = int(name)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and predicate(pid, int(fields[2])):
            found.append(pid)
    return found


def _group_members(pgid: int) -> list[int]:
    return _live_pids(lambda _pid, pgrp: pgrp == pgid)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


class Airflow:
    """api-server, scheduler, dag-processor and triggerer of one Airflow home, each its own process group."""

    def __init__(
        self,
        home: Path,
        env: dict[str, str],
        *,
        database_url: str | None = None,
        dag_id: str = "maxtext_sft",
        parallelism: int = 4,
        dags_folder: Path | None = None,
        celery_broker_url: str | None = None,
        celery_workers: int = 2,
        users: dict[str, str] | None = None,
        database_migrated: bool = False,
        installed_package: Path | None = None,
        site_dirs: tuple[Path, ...] = (),
    ) -> None:
        self.home = Path(home).resolve()
        self.port = free_port()
        self.base_env = dict(env)
        self.database_url = database_url or f"sqlite:///{self.home}/airflow.db"
        self.dag_id = dag_id
        self.parallelism = parallelism
        self.dags_folder = Path(dags_folder) if dags_folder else REPO / "dags"
        self.celery_broker_url = celery_broker_url
        self.workers = [f"celery-worker-{n}" for n in range(1, celery_workers + 1)] if celery_broker_url else []
        self.components = COMPONENTS + tuple(self.workers)
        self.users = dict(users or {})
        # True: database_url already holds Airflow's current schema (a copy of a migrated
        # template), so start() skips `airflow db migrate`.
        self.database_migrated = database_migrated
        # A site directory with the wheel installed (its package and dist-info): the components
        # import maxtext_sft and find its plugins (entry points) there only, with an empty plugins
        # folder, as on Cloud Composer 3, whose scheduler and triggerer load no plugins folder.
        # None: this repository's plugins/ is the plugins folder and on the path (compose, Astro).
        self.installed_package = Path(installed_package) if installed_package else None
        # Folders put first on the components' PYTHONPATH: a sitecustomize.py in one runs at the
        # start of every Python process of this Airflow (the tests tune the garbage collector so).
        self.site_dirs = tuple(Path(folder) for folder in site_dirs)
        self.processes: dict[str, subprocess.Popen] = {}
        self.token: str | None = None
        self.request_timeout = 30.0  # s: one REST API request's (see request)
        self._env: dict[str, str] | None = None

    # ----- lifecycle --------------------------------------------------------------------------

    def start(self, timeout: float = 240) -> None:
        """Migrate the database, start the four components and wait until they are healthy and
        the DAG is parsed (a dead run's leftovers in the same home are killed first)."""
        deadline = time.monotonic() + timeout
        self._prepare()
        try:
            self._migrate(deadline)
            for name in self.components:
                self.start_component(name)
            self._wait_until(self._ready, deadline, "Airflow to be healthy with the DAG parsed")
            if self.workers:
                self._wait_until(self._workers_ready, deadline, f"Celery workers {self.workers} to answer a ping")
        except BaseException:
            self.stop()
            raise

    def start_dag_processor(self, timeout: float = 240) -> None:
        """Migrate the database and start the dag-processor alone: enough to parse the DAGs folder
        and record each file's parse in the metadata database (bench/dag_parse.py)."""
        self._prepare()
        try:
            self._migrate(time.monotonic() + timeout)
            self.start_component("dag-processor")
        except BaseException:
            self.stop()
            raise

    def _prepare(self) -> None:
        """A fresh home (what a dead run left in it killed first) and the components' environment."""
        self._kill_marked()
        shutil.rmtree(self.home, ignore_errors=True)
        self.home.mkdir(parents=True)
        self._env = {**self._component_env(), **self._auth_settings()}
        atexit.register(self.stop)

    def start_component(self, name: str) -> None:
        """Start one component (again, after a kill) in a session of its own."""
        if name not in self.components:
            raise ValueError(f"unknown component {name!r}; one of {self.components}")
        if self._env is None:
            raise AirflowError("start() the harness first")
        if self.running(name):
            raise AirflowError(f"{name} is already running (pid {self.processes[name].pid})")
        if name in self.workers:
            self.processes[name] = self._spawn_worker(name)
        elif name == "scheduler":
            self.processes[name] = self._spawn(name, [name])
        else:
            env = {key: value for key, value in self._env.items() if key not in FORKSERVER_SETTINGS}
            self.processes[name] = self._spawn(name, [name], env=env)

    def cli(self, *airflow_args: str, timeout: float = 300) -> str:
        """Run `airflow ARGS` (e.g. `backfill create ...`) as a user of this deployment would; its output."""
        if self._env is None:
            raise AirflowError("start() the harness first")
        done = subprocess.run(
            [sys.executable, "-m", "airflow", *airflow_args], env=self._env, cwd=self.home,
            capture_output=True, text=True, timeout=timeout,
        )
        if done.returncode != 0:
            raise AirflowError(f"airflow {' '.join(airflow_args)} exited {done.returncode}: {done.stderr[-3000:]}")
        return done.stdout

    def start_scheduler(self) -> None:
        self.start_component("scheduler")

    def kill(self, name: str) -> None:
        """SIGKILL one component's process group (the others keep running); returns once it is gone."""
        process = self.processes.pop(name, None)
        if process is None:
            return
        _signal_group(process.pid, signal.SIGKILL)
        process.wait()
        self._wait_until(lambda: not _group_members(process.pid), time.monotonic() + 30, f"{name}'s group to die")

    def kill_scheduler(self) -> None:
        self.kill("scheduler")

    def running(self, name: str) -> bool:
        process = self.processes.get(name)
        return process is not None and process.poll() is None

    def stop(self, grace: float = 20) -> None:
        """Stop every component left (SIGTERM, SIGKILL after `grace` s), the api-server last, then
        anything else started for this home (task runners a killed scheduler left)."""
        atexit.unregister(self.stop)
        components = [name for name in self.components if name != "api-server" and name in self.processes]
        self._terminate(components, grace)
        self._terminate([name for name in ("api-server",) if name in self.processes], grace)
        self._kill_marked()
        self.token = None

    def __enter__(self) -> Airflow:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_path(self, name: str) -> Path:
        return self.home / f"{name}.log"

    def log_tail(self, name: str, size: int = 3000) -> str:
        try:
            return self.log_path(name).read_text(errors="replace")[-size:]
        except FileNotFoundError:
            return ""

    # ----- REST API ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(self, method: str, path: str, body=None, auth=True, missing_ok=False):
        # A read that times out is asked again, once: on a loaded machine (the whole suite on two
        # cores) an api-server has taken over 30 s to answer one read (CI: a test failed on it).
        # A write is not: it may have happened.
        timeouts_left = 1 if method == "GET" else 0
        attempt = 0
        while True:
            attempt += 1
            request = urllib.request.Request(f"{self.url}{path}", method=method)
            if auth:
                if self.token is None:
                    self.token = self._new_token()
                request.add_header("Authorization", f"Bearer {self.token}")
            data = None
            if body is not None:
                data = json.dumps(body).encode()
                request.add_header("Content-Type", "application/json")
            try:
                with urllib.request.urlopen(request, data=data, timeout=self.request_timeout) as response:
                    return json.load(response)
            except urllib.error.HTTPError as error:
                if missing_ok and error.code == 404:
                    return None
                if auth and error.code == 401 and attempt == 1:
                    self.token = None  # expired: a new one, once
                    continue
                raise AirflowError(f"{method} {path}: {error.code} {error.read().decode()[:500]}") from error
            except TimeoutError:
                if not timeouts_left:
                    raise
                timeouts_left -= 1

    def get(self, path: str, **kwargs):
        return self.request("GET", path, **kwargs)

    def health(self) -> dict:
        return self.get("/api/v2/monitor/health", auth=False)

    def trigger(self, conf: dict, dag_id: str | None = None) -> str:
        run = self.request(
            "POST", f"/api/v2/dags/{dag_id or self.dag_id}/dagRuns", {"logical_date": None, "conf": conf}
        )
        return run["dag_run_id"]

    def run(self, run_id: str, dag_id: str | None = None) -> dict:
        return self.get(f"/api/v2/dags/{dag_id or self.dag_id}/dagRuns/{run_id}")

    def task_instances(self, run_id: str, dag_id: str | None = None) -> list[dict]:
        return self.get(f"/api/v2/dags/{dag_id or self.dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]

    def task_states(self, run_id: str, dag_id: str | None = None) -> dict[str, str | None]:
        return {ti["task_id"]: ti["state"] for ti in self.task_instances(run_id, dag_id)}

    def xcom(self, run_id: str, task_id: str, key: str = "return_value", dag_id: str | None = None):
        """A task's XCom (its return value by default), or None when it has none."""
        path = f"/api/v2/dags/{dag_id or self.dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}"
        entry = self.get(path, missing_ok=True)
        return entry["value"] if entry else None

    def task_log(self, run_id: str, task_id: str, try_number: int = 1, dag_id: str | None = None,
                 missing_ok: bool = False) -> list:
        """A task try's log as the REST API gives it: structured entries (dicts) or lines; with
        missing_ok, none for a task that never ran (the API answers 404)."""
        path = f"/api/v2/dags/{dag_id or self.dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}"
        found = self.get(f"{path}?full_content=true", missing_ok=missing_ok)
        return [] if found is None else found["content"]

    # ----- internals --------------------------------------------------------------------------

    def _component_env(self) -> dict[str, str]:
        env = {
            **self.base_env,
            "PATH": f"{Path(sys.executable).parent}:{self.base_env.get('PATH', os.environ.get('PATH', '/usr/bin:/bin'))}",
            HOME_MARK: str(self.home),
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.database_url,
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__AUTH_MANAGER": SIMPLE_AUTH_MANAGER,
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "true",
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(self._plugins_folder()),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "false",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "false",
            "AIRFLOW__CORE__PARALLELISM": str(self.parallelism),
            "AIRFLOW__CORE__UNIT_TEST_MODE": "false",
            # A DAG file's parse may take longer than Airflow's 30 s on two cores that a whole test
            # suite shares: CI saw a declared job's file (0.12 s when quiet) time out at 31 s, and its
            # retry 30 s later came after a test had asked for that DAG. The DAG files are this repo's.
            "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "150",
            "AIRFLOW__DAG_PROCESSOR__DAG_FILE_PROCESSOR_TIMEOUT": "180",
            # One secret for every component: the api-server checks the tokens the scheduler
            # signs for task runners.
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(64),
            # One Fernet key for every component, as the official compose file sets it: a trigger the
            # scheduler writes (a task started on the triggerer) is decrypted by the triggerer. Left
            # unset, each component that starts before airflow.cfg exists writes a key of its own.
            "AIRFLOW__CORE__FERNET_KEY": base64.urlsafe_b64encode(secrets.token_bytes(32)).decode(),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            # As in a deployment: plugins/ is importable, or the installed package is.
            "PYTHONPATH": os.pathsep.join(map(str, (*self.site_dirs, self.installed_package or REPO / "plugins"))),
        }
        if self.celery_broker_url:
            env.update(self._celery_env())
        else:
            # The LocalExecutor's workers start from a forkserver that imported the tasks'
            # modules once, so each task process forks with the client libraries loaded instead
            # of importing them (~2 s of CPU a task: measured, a scheduler test's CPU 100 s ->
            # 57 s). Airflow 3.3's settings; a deployment on the LocalExecutor can set the same
            # (docs/deployment.md). Not for Celery: its worker's helpers would take the
            # forkserver too, whose socket path under the worker's temp folder is too long.
            env["AIRFLOW__CORE__MP_START_METHOD"] = "forkserver"
            env["AIRFLOW__CORE__MP_FORKSERVER_PRELOAD"] = ",".join(TASK_MODULES)
        return env

    def _plugins_folder(self) -> Path:
        if self.installed_package is None:
            return REPO / "plugins"
        empty = self.home / "plugins"
        empty.mkdir(parents=True, exist_ok=True)
        return empty

    def _celery_env(self) -> dict[str, str]:
        """CeleryExecutor settings, as docker-compose.yaml gives them: Redis as the broker, the
        metadata database as the result backend, and one log folder every component shares
        (compose mounts ./logs into each container), so the api-server reads any worker's log."""
        driverless = self.database_url.split("://", 1)[1]
        return {
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__CELERY__BROKER_URL": self.celery_broker_url,
            "AIRFLOW__CELERY__RESULT_BACKEND": f"db+postgresql://{driverless}",
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(self.home / "logs"),
        }

    def _spawn_worker(self, name: str) -> subprocess.Popen:
        """`airflow celery worker` with a home, temp folder and hostname of its own: a file one
        task leaves on its worker is not there for a task on the other one."""
        own = self.home / name
        for folder in ("home", "tmp"):
            (own / folder).mkdir(parents=True, exist_ok=True)
        env = {
            **self._env,
            "AIRFLOW_HOME": str(own),
            "HOME": str(own / "home"),
            "TMPDIR": str(own / "tmp"),
            WORKER_HOSTNAME_VAR: name,
            "AIRFLOW__CORE__HOSTNAME_CALLABLE": "localcloud.airflow_harness.worker_hostname",
            "PYTHONPATH": f"{self._env['PYTHONPATH']}:{REPO}",  # for the hostname callable above
        }
        # No log server: the logs are in the shared folder (and two would want one port).
        arguments = ["celery", "worker", "--celery-hostname", f"{name}@%h", "--skip-serve-logs", "--pid", str(own / "worker.pid")]
        return self._spawn(name, arguments, env=env)

    def _workers_ready(self) -> bool:
        for name in self.workers:
            if not self.running(name):
                raise AirflowError(f"{name} exited during start-up: {self.log_tail(name)}")
        done = subprocess.run(
            [sys.executable, "-m", "celery", "--app", CELERY_APP, "inspect", "ping", "--timeout", "2"],
            env=self._env, cwd=self.home, capture_output=True, text=True, timeout=60,
        )
        return all(f"{name}@" in done.stdout for name in self.workers)  # "->  NAME@HOST: OK"

    def _auth_settings(self) -> dict[str, str]:
        """With `users`, those users instead of every user an admin, their passwords in a file in
        the home (written here: the auth manager only generates passwords it lacks)."""
        if not self.users:
            return {}
        passwords_file = self.home / "simple_auth_manager_passwords.json"
        passwords_file.write_text(json.dumps(self.users))
        return {
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "false",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(f"{name}:admin" for name in self.users),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords_file),
        }

    def _new_token(self) -> str:
        """An admin's API token: the simple auth manager hands one out to anyone when every user
        is an admin (`simple_auth_manager_all_admins`), else to a user who gives a password."""
        if not self.users:
            return self.get("/auth/token", auth=False)["access_token"]
        username, password = next(iter(self.users.items()))
        login = {"username": username, "password": password}
        return self.request("POST", "/auth/token", login, auth=False)["access_token"]

    def _spawn(self, log_name: str, airflow_args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """`airflow ARGS` in a session of its own, its output appended to HOME/LOG_NAME.log."""
        with open(self.log_path(log_name), "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "airflow", *airflow_args],
                env=env or self._env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.home,
                start_new_session=True,
            )

    def _migrate(self, deadline: float) -> None:
        if self.database_migrated:
            return
        log_path = self.log_path("db-migrate")
        process = self._spawn("db-migrate", ["db", "migrate"])
        try:
            code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()
            raise AirflowError(f"airflow db migrate timed out; see {log_path}") from None
        if code != 0:
            raise AirflowError(f"airflow db migrate exited {code}: {self.log_tail('db-migrate')}")

    def _ready(self) -> bool:
        for name in COMPONENTS:
            if not self.running(name):
                raise AirflowError(f"airflow {name} exited during start-up: {self.log_tail(name)}")
        try:
            health = self.health()
            if not all(health[c]["status"] == "healthy" for c in ("scheduler", "triggerer", "dag_processor")):
                return False
            return bool(self.get(f"/api/v2/dags/{self.dag_id}", missing_ok=True))
        except (OSError, KeyError, AirflowError):
            return False  # the api-server is not up yet, or the components not yet heartbeating

    @staticmethod
    def _wait_until(condition, deadline: float, what: str, interval: float = 0.5) -> None:
        while not condition():
            if time.monotonic() > deadline:
                raise AirflowError(f"timed out waiting for {what}")
            time.sleep(interval)  # polling interval; the condition is re-checked each time

    def _terminate(self, names: list[str], grace: float) -> None:
        """SIGTERM these components' groups together, SIGKILL a group still alive after `grace`."""
        processes = {name: self.processes.pop(name) for name in names}
        for process in processes.values():
            _signal_group(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in processes.values():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            while _group_members(process.pid) and time.monotonic() < deadline:
                time.sleep(0.1)  # polling interval while the group's other members exit
        for process in processes.values():
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()
            self._wait_until(lambda pgid=process.pid: not _group_members(pgid), time.monotonic() + 30, "a group to die")

    def _kill_marked(self) -> None:
        """SIGKILL every process (and its group) started for this home that is still alive."""
        mark = f"{HOME_MARK}={self.home}".encode()

        def marked(pid: int, _pgrp: int) -> bool:
            try:
                return mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                return False

        deadline = time.monotonic() + 30
        while True:
            left = _live_pids(marked)
            if not left:
                return
            for pid in left:
                try:
                    pgid = os.getpgid(pid)
                    if pgid != os.getpgid(0):
                        _signal_group(pgid, signal.SIGKILL)
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise AirflowError(f"processes {left} of {self.home} did not die")
            time.sleep(0.1)  # polling interval while the kernel reaps them


def worker_hostname() -> str:
    """`[core] hostname_callable` of the harness's Celery workers: the worker's own name."""
    return os.environ[WORKER_HOSTNAME_VAR]
