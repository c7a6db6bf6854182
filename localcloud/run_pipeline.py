"""Run the pipeline once, end to end, in the local cloud, through Airflow's real scheduler.

    python -m localcloud.run_pipeline [--dag DAG_ID] [--maxtext real|fast] [--rehearsal] [--conf '{"steps": 10}']

Starts the local cloud (Compute Engine emulator whose VMs are sshd sandboxes on 127.0.0.N, a
Cloud Storage emulator, a Hugging Face Hub), then Airflow's components as separate processes
(api-server, scheduler, dag-processor, triggerer; SQLite; `localcloud.airflow_harness`) with
connections pointing at it, triggers one run of the
`maxtext_sft` DAG through the REST API with outputs to the local bucket and publishing to the
local Hub, waits for it, and prints the outcome, each task's duration, the VM's lifecycle,
where the outputs went and the run summary; with the real MaxText it then waits for the
downstream sample-generations run the new model started and prints its samples. Everything it
started is stopped at the end (process groups), and a new run starts from a clean state.
Exit code 0 only when the run succeeded and no VM is left.

It prints as it goes: each setup step with the seconds it took, then each task's state as it
changes (running, deferred, success...) and, while the training runs, its task log's step and
evaluation lines; a line every 30 s names what is still under way.

--rehearsal (or --dag maxtext_sft_rehearsal) runs `maxtext_sft_rehearsal` instead (`make
rehearse`): the same tasks on the rehearsal's CPU VM, booting the public Ubuntu family the
rehearsal's Params name by default (the local cloud serves the real MaxText image under it), and
prints the rehearsal's checks.

--dag maxtext_sft_slice (`make run DAG=maxtext_sft_slice`) runs the multi-host slice DAG: a
v6e-16 (4 hosts of ct6e-standard-4t) under a workload policy, an instance template and a managed
instance group in the local cloud's slice reservation, each host a sandboxed sshd VM training
with the MaxText stand-in (its multi-host mode; the real MaxText runs on one VM here:
bench/real_multihost.py runs it as two JAX processes outside the pipeline). Exit code 0 only when
the run succeeded and no host, group, template or policy is left.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path

from localcloud.airflow_harness import Airflow
from localcloud.cloud import LocalCloud
from localcloud.compute.first_boot import FirstBoot
from localcloud.connections import (
    BARE_IMAGE_KEY,
    LOCAL_PROJECT,
    LOCAL_RUN_CONF,
    LOCAL_SLICE_CONF,
    LOCAL_SLICE_HOSTS,
    LOCAL_SLICE_MACHINE_TYPE,
    LOCAL_ZONE,
    REAL_IMAGE_KEY,
    REHEARSAL_IMAGE_KEY,
    LOCAL_OUTPUTS_CONF,
    LOCAL_REHEARSAL_CONF,
    airflow_connection_env,
    generate_ssh_private_key,
    new_hf_token,
    prepare_local_cloud,
    real_maxtext_run_conf,
)
from localcloud.images import TUTORIAL_IMAGE, build_bare_image, build_fast_image, build_real_image

REPO = Path(__file__).resolve().parents[1]
STATE = REPO / ".localcloud" / "run"
DAG_ID = "maxtext_sft"
REHEARSAL_DAG_ID = "maxtext_sft_rehearsal"
SLICE_DAG_ID = "maxtext_sft_slice"
DAG_IDS = (DAG_ID, REHEARSAL_DAG_ID, SLICE_DAG_ID)
SAMPLES_DAG_ID = "maxtext_sft_sample_generations"  # scheduled on the tuned-model Asset
TRAINING_TASK = "wait_for_final_checkpoint"
# Task states worth a line as they come (queued and scheduled pass in a moment).
SHOWN_STATES = {"running", "deferred", "up_for_reschedule", "up_for_retry", "success", "failed", "skipped",
                "upstream_failed", "removed", "restarting"}
FINAL_STATES = {"success", "failed", "skipped", "upstream_failed", "removed"}
# What of the training task's log is printed as it comes: its progress lines and evaluations.
TRAINING_PROGRESS = re.compile(r"training progress: step \d+, loss \S+|eval metrics after step: .*")


def parse_time(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None


def report(airflow: Airflow, run: dict, cloud: LocalCloud, started: float) -> bool:
    run_id = run["dag_run_id"]
    tis = airflow.task_instances(run_id)
    print(f"\nDAG run {run_id}: {run['state'].upper()} in {time.monotonic() - started:.0f} s")
    # The run summary's phase durations: first start to end, across retries and a sensor's
    # reschedules (the REST API's `duration` is the last try's or poke's).
    summary = airflow.xcom(run_id, "summarize_run") or {}
    phase_seconds = {row["task_id"]: row["duration_seconds"] for row in summary.get("phases", [])}
    print(f"\n{'task':<28} {'state':<16} {'tries':>5} {'duration':>10}")
    for ti in sorted(tis, key=lambda t: t.get("start_date") or "~"):
        seconds = phase_seconds.get(ti["task_id"]) or ti.get("duration")
        duration = f"{seconds:.1f} s" if seconds is not None else "-"
        print(f"{ti['task_id']:<28} {ti['state'] or 'none':<16} {ti['try_number']:>5} {duration:>10}")

    print("\nVM lifecycle (Compute API requests seen by the emulator):")
    first = None
    for entry in cloud.requests():
        path = entry["path"].split("?")[0]
        if lifecycle_request(entry["method"], path):
            when = parse_time(entry.get("time"))
            first = first or when
            offset = f"+{(when - first).total_seconds():6.1f} s" if when and first else ""
            print(f"  {offset} {entry['method']:<6} {path} -> {entry['status']}")
    left = cloud.vms()
    print(f"\nInstances left: {len(left)} {[vm['name'] for vm in left] if left else ''}")
    if airflow.dag_id == SLICE_DAG_ID:
        left_of_slice = slice_leftovers(cloud, airflow, run_id)
        print(f"Slice resources left (group, template, policy): {len(left_of_slice)} {left_of_slice or ''}")
        left = left or left_of_slice
    record = airflow.xcom(run_id, "collect_outputs")
    if record:
        print("\nOutputs (the run record, also in storage):")
        for key in ("hf_export", "checkpoints", "base_checkpoint", "final_step", "final_loss", "eval_split", "eval_loss"):
            print(f"  {key:<16} {record.get(key)}")
        weights = record.get("hf_export_weight_files") or []
        print(f"  {'weights':<16} {record.get('hf_export_layout')}: {', '.join(weights)}")
        if record.get("training_log"):
            print(f"  {'training log':<16} {record['training_log']} (MaxText's full log)")
    published = airflow.xcom(run_id, "publish_to_hub")
    if published and published.get("published"):
        print(f"  published to     {cloud.hub.endpoint}/{published['repo_id']} ({published['branch']}), "
              f"commit {published['commit']}")
    elif published:
        print(f"  not published    {published['reason']}")
    if summary:
        vm = summary["vm"]
        print("\nRun summary (summarize_run; run-summary.json beside the run record):")
        print(f"  VM lifetime {vm['lifetime_seconds']} s, {vm['vm_hours']} VM-hours, "
              f"estimated ${vm['estimated_cost_usd']} at ${vm['hourly_price_usd']}/h")
        print(f"  final step {summary['final_step']}, loss {summary['final_loss']}; warnings: {summary['warnings']}")
        if "rehearsal_checks" in summary:
            print("\nRehearsal checks (the run summary's):")
            for row in summary["rehearsal_checks"]:
                print(f"  {row['result']:<8} {row['check']:<26} {row['detail'] or row['proves']}")
    return run["state"] == "success" and not left


# The collections whose inserts (POST to the collection) and deletes make a run's machines.
LIFECYCLE_COLLECTIONS = ("instances", "instanceTemplates", "instanceGroupManagers", "resourcePolicies")


def lifecycle_request(method: str, path: str) -> bool:
    """Whether a Compute API request makes or deletes an instance or a slice's group, template or policy."""
    collection = next((c for c in LIFECYCLE_COLLECTIONS if f"/{c}" in path), None)
    if collection is None:
        return False
    return method == "DELETE" or method == "POST" and path.endswith(f"/{collection}")


def slice_leftovers(cloud: LocalCloud, airflow: Airflow, run_id: str) -> list[str]:
    """What of the slice plan_run named the Compute API still has (its group, template, policy)."""
    names = {key: airflow.xcom(run_id, "plan_run", key=key) for key in
             ("project_id", "zone", "region", "policy_name", "template_name", "group_name")}
    if not names["group_name"]:
        return []
    project = f"projects/{names['project_id']}"
    resources = {
        f"group {names['group_name']}": f"{project}/zones/{names['zone']}/instanceGroupManagers/{names['group_name']}",
        f"template {names['template_name']}": f"{project}/global/instanceTemplates/{names['template_name']}",
        f"policy {names['policy_name']}": f"{project}/regions/{names['region']}/resourcePolicies/{names['policy_name']}",
    }
    left = []
    for name, path in resources.items():
        try:
            with urllib.request.urlopen(cloud.compute_endpoint + path, timeout=30):
                left.append(name)
        except urllib.error.HTTPError as error:
            if error.code != 404:
                raise
    return left


class Progress:
    """Prints a run's progress as it goes: each task's state as it changes, the training task's
    step and evaluation lines (read from its log, as the UI shows it, every 10 s), and a line
    every 30 s that names what is still under way."""

    def __init__(self, airflow: Airflow | None, started: float):
        self.airflow = airflow
        self.started = started
        self.states: dict[tuple[str, str], str] = {}
        self.log_read: dict[tuple[str, str, int], int] = {}  # log entries already read, per try
        self.log_done: set[tuple[str, str, int]] = set()  # tries whose log was read after they ended
        self.last_line = time.monotonic()
        self.last_log_read = 0.0

    def say(self, text: str) -> None:
        print(f"  {time.monotonic() - self.started:6.0f} s  {text}", flush=True)
        self.last_line = time.monotonic()

    def poll(self, run_id: str, dag_id: str) -> dict:
        """One look at the run: prints what changed; returns the run."""
        run = self.airflow.run(run_id, dag_id=dag_id)
        tis = self.airflow.task_instances(run_id, dag_id=dag_id)
        # The training's lines first: its last ones come before the line that says it ended.
        if training := next((ti for ti in tis if ti["task_id"] == TRAINING_TASK), None):
            self._training_lines(run_id, dag_id, training)
        for ti in sorted(tis, key=lambda t: t.get("start_date") or "~"):
            key, state = (dag_id, ti["task_id"]), ti["state"]
            if state in SHOWN_STATES and self.states.get(key) != state:
                took = f" ({ti['duration']:.1f} s)" if state in FINAL_STATES and ti.get("duration") else ""
                tries = f" (try {ti['try_number']})" if ti.get("try_number", 1) > 1 and state == "running" else ""
                self.say(f"{ti['task_id']}: {state}{took}{tries}")
            self.states[key] = state
        if time.monotonic() - self.last_line >= 30:
            under_way = [f"{ti['task_id']} ({ti['state']})" for ti in tis if ti["state"] in
                         ("running", "deferred", "up_for_reschedule", "queued", "up_for_retry")]
            self.say(f"still under way: {', '.join(under_way) or 'the scheduler (no task running)'}")
        return run

    def _training_lines(self, run_id: str, dag_id: str, ti: dict) -> None:
        """The training task's new progress and evaluation lines: every 10 s while it runs or waits,
        and once more when it has ended."""
        key = (dag_id, run_id, ti["try_number"])
        if ti["state"] in FINAL_STATES:
            if key in self.log_done:
                return
            self.log_done.add(key)
        elif ti["state"] in (None, "scheduled", "queued") or time.monotonic() - self.last_log_read < 10:
            return
        self.last_log_read = time.monotonic()
        try:
            entries = self.airflow.task_log(run_id, TRAINING_TASK, try_number=ti["try_number"], dag_id=dag_id,
                                            missing_ok=True)
        except Exception:  # noqa: BLE001 - a log not readable yet: the next look reads it
            return
        for entry in entries[self.log_read.get(key, 0):]:
            event = entry.get("event", "") if isinstance(entry, dict) else str(entry)
            if match := TRAINING_PROGRESS.search(str(event)):
                self.say(f"{TRAINING_TASK}: {match.group(0)}")
        self.log_read[key] = len(entries)

    def wait(self, run_id: str, dag_id: str, timeout: float) -> dict:
        """Poll until the run ends (or `timeout`): the run."""
        deadline = time.monotonic() + timeout
        while True:
            run = self.poll(run_id, dag_id)
            if run["state"] in ("success", "failed") or time.monotonic() >= deadline:
                return run
            time.sleep(2)  # polling interval of the REST API


def report_samples(airflow: Airflow, progress: Progress, timeout: float) -> bool:
    """The downstream DAG the tuned-model Asset event started: its samples, once it has ended."""
    print(f"\nWaiting for {SAMPLES_DAG_ID}, which the tuned model's Asset event starts ...", flush=True)
    deadline = time.monotonic() + timeout
    path = f"/api/v2/dags/{SAMPLES_DAG_ID}/dagRuns"
    while time.monotonic() < deadline:
        runs = airflow.get(path)["dag_runs"]
        if runs and progress.poll(runs[0]["dag_run_id"], SAMPLES_DAG_ID)["state"] in ("success", "failed"):
            break
        if not runs and time.monotonic() - progress.last_line >= 30:
            progress.say(f"no {SAMPLES_DAG_ID} run yet")
        time.sleep(2)  # polling interval of the REST API
    else:
        print(f"\n{SAMPLES_DAG_ID}: no run ended within {timeout:.0f} s")
        return False
    run = airflow.get(f"{path}/{runs[0]['dag_run_id']}")
    print(f"\n{SAMPLES_DAG_ID} ({run['run_type']}): {run['state'].upper()}")
    for model in airflow.xcom(run["dag_run_id"], "generate_samples", dag_id=SAMPLES_DAG_ID) or []:
        print(f"  model {model['model']}")
        for sample in model["samples"]:
            print(f"    {sample['prompt']!r} -> {sample['completion']!r}")
    return run["state"] == "success"


# Every VM of `make run` boots as a fresh Ubuntu cloud image does (compute/first_boot.py): cloud-init
# runs for a minute and unattended-upgrades holds dpkg's lock for three (public reports speak of
# minutes). The default runs boot images that already have MaxText, so nothing waits for them;
# a run conf that boots the bare image (BARE_IMAGE_CONF) installs through them.
MAKE_RUN_FIRST_BOOT = FirstBoot(cloud_init_seconds=60, dpkg_lock_seconds=180)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; `dag` and `maxtext` resolved (the slice runs on the stand-in)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conf", default="{}", help="JSON run conf merged over the local defaults")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds to wait for the run")
    parser.add_argument("--dag", choices=DAG_IDS, default=None, help=f"the DAG to run (default: {DAG_ID})")
    parser.add_argument(
        "--maxtext",
        choices=("real", "fast"),
        default=None,
        help="real: MaxText 0.2.2 at toy size (the default, but for the slice); fast: the stand-in used by the "
             "fault tests (the slice's default and only choice)",
    )
    parser.add_argument("--rehearsal", action="store_true", help=f"run {REHEARSAL_DAG_ID} (the CPU-VM rehearsal)")
    parser.add_argument(
        "--first-boot",
        default=f"{MAKE_RUN_FIRST_BOOT.cloud_init_seconds:g},{MAKE_RUN_FIRST_BOOT.dpkg_lock_seconds:g}",
        metavar="CLOUD_INIT_S,DPKG_LOCK_S",
        help="each VM's first boot: seconds of cloud-init running, seconds of unattended-upgrades holding dpkg's "
             "lock (default %(default)s; 0,0: none)",
    )
    args = parser.parse_args(argv)
    try:
        cloud_init, dpkg_lock = (float(part) for part in args.first_boot.split(","))
        args.first_boot = FirstBoot(cloud_init, dpkg_lock)
    except ValueError as error:
        parser.error(f"--first-boot takes CLOUD_INIT_S,DPKG_LOCK_S (seconds, 0 to 3600): {error}")
    if args.rehearsal and args.dag not in (None, REHEARSAL_DAG_ID):
        parser.error(f"--rehearsal runs {REHEARSAL_DAG_ID}, not {args.dag}")
    args.dag = REHEARSAL_DAG_ID if args.rehearsal else args.dag or DAG_ID
    args.rehearsal = args.dag == REHEARSAL_DAG_ID
    if args.dag == SLICE_DAG_ID and args.maxtext == "real":
        parser.error(f"{SLICE_DAG_ID} runs with --maxtext fast: the local cloud trains a slice with the stand-in's "
                     "multi-host mode (bench/real_multihost.py runs the real MaxText as two JAX processes)")
    args.maxtext = args.maxtext or ("fast" if args.dag == SLICE_DAG_ID else "real")
    try:
        args.conf = json.loads(args.conf)
    except json.JSONDecodeError as error:
        parser.error(f"--conf is not JSON: {error}")
    if not isinstance(args.conf, dict):
        parser.error("--conf must be a JSON object")
    return args


# `make run`'s toy training on the real MaxText, sized for a first run in minutes. Measured on the
# 2-core machine (cached image, load average 1-2): MaxText's start-up ~45 s, the evaluation of the
# base model before step 1 ~15 s, step 1 ~35 s (its compilation), each further step ~3 s with its
# checkpoint, the evaluation after the last step ~20 s. Three steps still save, prune (the newest two
# kept) and export a checkpoint, and run the eval loop twice (3 batches each); the waits check every
# 5 s, as the real-MaxText pipeline test's do (the local default is 10).
MAKE_RUN_TOY = {"steps": 3, "poke_interval_seconds": 5}


def run_conf(args: argparse.Namespace, real_image: Path | None) -> dict:
    """The run conf the run is triggered with: the local defaults of its DAG and --maxtext, then --conf."""
    if args.dag == SLICE_DAG_ID:
        base_conf = {**LOCAL_RUN_CONF, **LOCAL_SLICE_CONF}
    elif args.maxtext == "real":
        # The rehearsal brings its own toy (its kit) and reads the Hub's model and dataset.
        base_conf = {**LOCAL_RUN_CONF, **LOCAL_REHEARSAL_CONF} if args.rehearsal else {
            **real_maxtext_run_conf(real_image, outputs=True), **MAKE_RUN_TOY}
    else:
        base_conf = {**LOCAL_RUN_CONF, **LOCAL_OUTPUTS_CONF}
    return {**base_conf, **args.conf}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dag_id = args.dag
    # SIGTERM unwinds like Ctrl-C, so the finally below stops Airflow and the local cloud.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    # A clean local cloud each time: no bucket, Hub repo or VM of an earlier run (the Airflow
    # harness likewise starts from an empty home).
    shutil.rmtree(STATE / "cloud", ignore_errors=True)
    STATE.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    progress = Progress(None, started)
    progress.say(f"Building the local VM images for --maxtext={args.maxtext} (cached; the real one takes about "
                 "2 minutes once) ...")
    fast_image = build_fast_image()
    # The bare image too: run conf may name its family (BARE_IMAGE_CONF) to install MaxText for real.
    cloud = LocalCloud(STATE / "cloud", images={TUTORIAL_IMAGE: fast_image, BARE_IMAGE_KEY: build_bare_image()},
                       first_boot=args.first_boot)
    real_image = build_real_image() if args.maxtext == "real" else None
    conf = run_conf(args, real_image)
    progress.say("VM images ready")
    airflow = None
    try:
        cloud.start()
        if real_image:
            cloud.add_image(REAL_IMAGE_KEY, real_image)
        cloud.add_image(REHEARSAL_IMAGE_KEY, real_image or fast_image)
        hf_token = new_hf_token()
        prepare_local_cloud(cloud, hf_token)
        if dag_id == SLICE_DAG_ID:
            cloud.add_reservation(conf["reservation"], LOCAL_SLICE_HOSTS, LOCAL_SLICE_MACHINE_TYPE, zone=LOCAL_ZONE,
                                  project=LOCAL_PROJECT)
        env = {**os.environ, **airflow_connection_env(cloud, generate_ssh_private_key(), hf_token)}
        if real_image:  # the sample DAG generates in the image's venv (torch is there)
            env["AIRFLOW__MAXTEXT_SFT__GENERATION_PYTHON"] = str(real_image / "maxtext_venv" / "bin" / "python3")
        progress.say(f"Local cloud started: Compute Engine emulator {cloud.compute_endpoint}")
        print(f"  Each VM's first boot: cloud-init runs {args.first_boot.cloud_init_seconds:g} s, unattended-upgrades"
              f" holds dpkg's lock {args.first_boot.dpkg_lock_seconds:g} s", flush=True)
        print(f"  Cloud Storage emulator: {cloud.storage_endpoint}; Hugging Face Hub: {cloud.hub.endpoint}", flush=True)
        airflow = Airflow(STATE / "airflow-home", env, dag_id=dag_id)
        progress.airflow = airflow
        progress.say("Starting Airflow (api-server, scheduler, dag-processor, triggerer; SQLite) ...")
        airflow.start()
        progress.say(f"Airflow API on http://127.0.0.1:{airflow.port}; triggering {dag_id} with conf {json.dumps(conf)}")
        run_id = airflow.trigger(conf)
        run = progress.wait(run_id, dag_id, args.timeout)
        ok = report(airflow, run, cloud, started)
        if ok and args.maxtext == "real" and dag_id == DAG_ID:  # the stand-in's export is not a model transformers loads
            ok = report_samples(airflow, progress, timeout=600)
        print(f"\nTask logs: {airflow.home / 'logs'}")
        print(f"{'Succeeded' if ok else 'Failed'} in {time.monotonic() - started:.0f} s")
        return 0 if ok else 1
    finally:
        progress.say("Stopping Airflow and the local cloud ...")
        if airflow:
            # 5 s for each component to exit on SIGTERM, then SIGKILL (the harness's default is 20):
            # measured, the scheduler or the triggerer sometimes takes 10-30 s, and nothing of this
            # home is kept (the next run starts from an empty one).
            airflow.stop(grace=5)
        progress.say("Airflow stopped")
        cloud.stop()
        progress.say("Local cloud stopped")


if __name__ == "__main__":
    sys.exit(main())
