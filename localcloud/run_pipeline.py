"""Run the pipeline once, end to end, in the local cloud, through Airflow's real scheduler.

    python -m localcloud.run_pipeline [--maxtext real|fast] [--conf '{"steps": 10}']

Starts the local cloud (Compute Engine emulator whose VMs are sshd sandboxes on 127.0.0.N, a
Cloud Storage emulator, a Hugging Face Hub), then `airflow standalone` (scheduler, triggerer,
dag-processor, api-server; SQLite) with connections pointing at it, triggers one run of the
`maxtext_sft` DAG through the REST API with outputs to the local bucket and publishing to the
local Hub, waits for it, and prints the outcome, each task's duration, the VM's lifecycle and
where the outputs went. Everything it
started is stopped at the end (process groups), and a new run starts from a clean state.
Exit code 0 only when the run succeeded and no VM is left.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path

from localcloud.cloud import LocalCloud
from localcloud.connections import (
    LOCAL_RUN_CONF,
    REAL_IMAGE_KEY,
    LOCAL_OUTPUTS_CONF,
    airflow_connection_env,
    generate_ssh_private_key,
    new_hf_token,
    prepare_local_cloud,
    real_maxtext_run_conf,
)
from localcloud.images import TUTORIAL_IMAGE, build_fast_image, build_real_image

REPO = Path(__file__).resolve().parents[1]
STATE = REPO / ".localcloud" / "run"
DAG_ID = "maxtext_sft"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Airflow:
    """`airflow standalone` in its own process group, with a fresh home."""

    def __init__(self, home: Path, env: dict[str, str]):
        self.home = home
        self.port = free_port()
        self.env = env
        self.pidfile = home.parent / "airflow.pgid"
        self.process: subprocess.Popen | None = None
        self.token: str | None = None

    def start(self) -> None:
        stop_process_group(self.pidfile)  # a run killed before it could clean up
        shutil.rmtree(self.home, ignore_errors=True)
        self.home.mkdir(parents=True)
        env = {
            **self.env,
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{self.home}/airflow.db",
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "false",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "false",
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "true",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{self.port}/execution/",
            "PYTHONPATH": str(REPO / "plugins"),
        }
        log = open(self.home / "standalone.log", "wb")  # noqa: SIM115 - owned by the child
        self.process = subprocess.Popen(
            [sys.executable, "-m", "airflow", "standalone"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=self.home,
        )
        self.pidfile.write_text(str(self.process.pid))
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"airflow standalone exited; see {self.home / 'standalone.log'}")
            try:
                health = self.get("/api/v2/monitor/health", auth=False)
                if all(health[c]["status"] == "healthy" for c in ("scheduler", "triggerer", "dag_processor")):
                    self.token = self.get("/auth/token", auth=False)["access_token"]
                    if self.get(f"/api/v2/dags/{DAG_ID}", missing_ok=True):
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError("Airflow did not become healthy with the DAG parsed within 180 s")

    def request(self, method: str, path: str, body=None, auth=True, missing_ok=False):
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method)
        if auth:
            request.add_header("Authorization", f"Bearer {self.token}")
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, data=data, timeout=30) as response:
                return json.load(response)
        except urllib.error.HTTPError as error:
            if missing_ok and error.code == 404:
                return None
            raise RuntimeError(f"{method} {path}: {error.code} {error.read().decode()[:500]}") from error

    def get(self, path: str, **kwargs):
        return self.request("GET", path, **kwargs)

    def trigger(self, conf: dict) -> str:
        run = self.request("POST", f"/api/v2/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": conf})
        return run["dag_run_id"]

    def run(self, run_id: str) -> dict:
        return self.get(f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}")

    def task_instances(self, run_id: str) -> list[dict]:
        return self.get(f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances")["task_instances"]

    def task_states(self, run_id: str) -> dict[str, str | None]:
        return {ti["task_id"]: ti["state"] for ti in self.task_instances(run_id)}

    def xcom(self, run_id: str, task_id: str):
        """A task's return value, or None when it has none."""
        path = f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value"
        entry = self.get(path, missing_ok=True)
        return entry["value"] if entry else None

    def stop(self) -> None:
        stop_process_group(self.pidfile)


def stop_process_group(pidfile: Path, grace: float = 20) -> None:
    """SIGTERM the group recorded in `pidfile`, SIGKILL what is left after `grace` seconds."""
    if not pidfile.exists():
        return
    pgid = int(pidfile.read_text())
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pidfile.unlink()
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        try:  # reap our own child if it is the leader
            os.waitpid(pgid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.2)
    else:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    pidfile.unlink(missing_ok=True)


def parse_time(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None


def report(airflow: Airflow, run: dict, cloud: LocalCloud, started: float) -> bool:
    run_id = run["dag_run_id"]
    tis = airflow.task_instances(run_id)
    print(f"\nDAG run {run_id}: {run['state'].upper()} in {time.monotonic() - started:.0f} s")
    print(f"\n{'task':<28} {'state':<16} {'tries':>5} {'duration':>10}")
    for ti in sorted(tis, key=lambda t: t.get("start_date") or "~"):
        duration = f"{ti['duration']:.1f} s" if ti.get("duration") is not None else "-"
        print(f"{ti['task_id']:<28} {ti['state'] or 'none':<16} {ti['try_number']:>5} {duration:>10}")

    print("\nVM lifecycle (Compute API requests seen by the emulator):")
    first = None
    for entry in cloud.requests():
        path = entry["path"]
        if "/instances" not in path or entry["method"] == "GET" and "operations" in path:
            continue
        if entry["method"] in ("POST", "DELETE"):
            when = parse_time(entry.get("time"))
            first = first or when
            offset = f"+{(when - first).total_seconds():6.1f} s" if when and first else ""
            print(f"  {offset} {entry['method']:<6} {path.split('?')[0]} -> {entry['status']}")
    left = cloud.vms()
    print(f"\nInstances left: {len(left)} {[vm['name'] for vm in left] if left else ''}")
    record = airflow.xcom(run_id, "collect_outputs")
    if record:
        print("\nOutputs (the run record, also in storage):")
        for key in ("hf_export", "checkpoints", "base_checkpoint", "final_step", "final_loss"):
            print(f"  {key:<16} {record.get(key)}")
    published = airflow.xcom(run_id, "publish_to_hub")
    if published:
        print(f"  published to     {cloud.hub.endpoint}/{published['repo_id']} ({published['branch']}), "
              f"commit {published['commit']}")
    return run["state"] == "success" and not left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conf", default="{}", help="JSON run conf merged over the local defaults")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds to wait for the run")
    parser.add_argument(
        "--maxtext",
        choices=("real", "fast"),
        default="real",
        help="real: MaxText 0.2.2 at toy size (default); fast: the stand-in used by the fault tests",
    )
    args = parser.parse_args(argv)

    STATE.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"Building the local VM image for --maxtext={args.maxtext} (cached; the real one takes minutes once) ...")
    fast_image = build_fast_image()
    cloud = LocalCloud(STATE / "cloud", images={TUTORIAL_IMAGE: fast_image})
    if args.maxtext == "real":
        real_image = build_real_image()
        base_conf = real_maxtext_run_conf(real_image, outputs=True)
    else:
        base_conf = {**LOCAL_RUN_CONF, **LOCAL_OUTPUTS_CONF}
    conf = {**base_conf, **json.loads(args.conf)}
    airflow = None
    try:
        cloud.start()
        if args.maxtext == "real":
            cloud.add_image(REAL_IMAGE_KEY, real_image)
        hf_token = new_hf_token()
        prepare_local_cloud(cloud, hf_token)
        env = {**os.environ, **airflow_connection_env(cloud, generate_ssh_private_key(), hf_token)}
        print(f"Compute Engine emulator: {cloud.compute_endpoint}", flush=True)
        print(f"Cloud Storage emulator: {cloud.storage_endpoint}; Hugging Face Hub: {cloud.hub.endpoint}", flush=True)
        airflow = Airflow(STATE / "airflow-home", env)
        print("Starting airflow standalone ...", flush=True)
        airflow.start()
        print(f"Airflow API on http://127.0.0.1:{airflow.port}; triggering {DAG_ID} with conf {json.dumps(conf)}")
        run_id = airflow.trigger(conf)
        run = airflow.run(run_id)
        deadline = time.monotonic() + args.timeout
        last = None
        while run["state"] not in ("success", "failed") and time.monotonic() < deadline:
            time.sleep(2)
            run = airflow.run(run_id)
            states = airflow.task_states(run_id)
            running = sorted(t for t, state in states.items() if state in ("running", "up_for_reschedule", "queued"))
            if running != last:
                print(f"  {time.monotonic() - started:6.0f} s  {', '.join(running) or '...'}", flush=True)
                last = running
        ok = report(airflow, run, cloud, started)
        print(f"\nTask logs: {airflow.home / 'logs'}")
        return 0 if ok else 1
    finally:
        if airflow:
            airflow.stop()
        cloud.stop()


if __name__ == "__main__":
    sys.exit(main())
