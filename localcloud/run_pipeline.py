"""Run the pipeline once, end to end, in the local cloud, through Airflow's real scheduler.

    python -m localcloud.run_pipeline [--maxtext real|fast] [--rehearsal] [--conf '{"steps": 10}']

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

--rehearsal runs `maxtext_sft_rehearsal` instead (`make rehearse`): the same tasks on the
rehearsal's CPU VM, booting the public Ubuntu family the rehearsal's Params name by default
(the local cloud serves the real MaxText image under it), and prints the rehearsal's checks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

from localcloud.airflow_harness import Airflow
from localcloud.cloud import LocalCloud
from localcloud.connections import (
    BARE_IMAGE_KEY,
    LOCAL_RUN_CONF,
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
SAMPLES_DAG_ID = "maxtext_sft_sample_generations"  # scheduled on the tuned-model Asset


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
        for key in ("hf_export", "checkpoints", "base_checkpoint", "final_step", "final_loss", "eval_split", "eval_loss"):
            print(f"  {key:<16} {record.get(key)}")
        weights = record.get("hf_export_weight_files") or []
        print(f"  {'weights':<16} {record.get('hf_export_layout')}: {', '.join(weights)}")
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


def report_samples(airflow: Airflow, timeout: float) -> bool:
    """The downstream DAG the tuned-model Asset event started: its samples, once it has ended."""
    deadline = time.monotonic() + timeout
    path = f"/api/v2/dags/{SAMPLES_DAG_ID}/dagRuns"
    while time.monotonic() < deadline:
        runs = [r for r in airflow.get(path)["dag_runs"] if r["state"] in ("success", "failed")]
        if runs:
            break
        time.sleep(2)
    else:
        print(f"\n{SAMPLES_DAG_ID}: no run ended within {timeout:.0f} s")
        return False
    run = runs[0]
    print(f"\n{SAMPLES_DAG_ID} ({run['run_type']}): {run['state'].upper()}")
    for model in airflow.xcom(run["dag_run_id"], "generate_samples", dag_id=SAMPLES_DAG_ID) or []:
        print(f"  model {model['model']}")
        for sample in model["samples"]:
            print(f"    {sample['prompt']!r} -> {sample['completion']!r}")
    return run["state"] == "success"


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
    parser.add_argument("--rehearsal", action="store_true", help=f"run {REHEARSAL_DAG_ID} (the CPU-VM rehearsal)")
    args = parser.parse_args(argv)
    dag_id = REHEARSAL_DAG_ID if args.rehearsal else DAG_ID
    # SIGTERM unwinds like Ctrl-C, so the finally below stops Airflow and the local cloud.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    # A clean local cloud each time: no bucket, Hub repo or VM of an earlier run (the Airflow
    # harness likewise starts from an empty home).
    shutil.rmtree(STATE / "cloud", ignore_errors=True)
    STATE.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"Building the local VM image for --maxtext={args.maxtext} (cached; the real one takes minutes once) ...")
    fast_image = build_fast_image()
    # The bare image too: run conf may name its family (BARE_IMAGE_CONF) to install MaxText for real.
    cloud = LocalCloud(STATE / "cloud", images={TUTORIAL_IMAGE: fast_image, BARE_IMAGE_KEY: build_bare_image()})
    if args.maxtext == "real":
        real_image = build_real_image()
        # The rehearsal brings its own toy (its kit) and reads the Hub's model and dataset.
        base_conf = {**LOCAL_RUN_CONF, **LOCAL_REHEARSAL_CONF} if args.rehearsal else real_maxtext_run_conf(
            real_image, outputs=True)
    else:
        base_conf = {**LOCAL_RUN_CONF, **LOCAL_OUTPUTS_CONF}
    conf = {**base_conf, **json.loads(args.conf)}
    airflow = None
    try:
        cloud.start()
        if args.maxtext == "real":
            cloud.add_image(REAL_IMAGE_KEY, real_image)
        cloud.add_image(REHEARSAL_IMAGE_KEY, real_image if args.maxtext == "real" else fast_image)
        hf_token = new_hf_token()
        prepare_local_cloud(cloud, hf_token)
        env = {**os.environ, **airflow_connection_env(cloud, generate_ssh_private_key(), hf_token)}
        if args.maxtext == "real":  # the sample DAG generates in the image's venv (torch is there)
            env["AIRFLOW__MAXTEXT_SFT__GENERATION_PYTHON"] = str(real_image / "maxtext_venv" / "bin" / "python3")
        print(f"Compute Engine emulator: {cloud.compute_endpoint}", flush=True)
        print(f"Cloud Storage emulator: {cloud.storage_endpoint}; Hugging Face Hub: {cloud.hub.endpoint}", flush=True)
        airflow = Airflow(STATE / "airflow-home", env, dag_id=dag_id)
        print("Starting Airflow (api-server, scheduler, dag-processor, triggerer; SQLite) ...", flush=True)
        airflow.start()
        print(f"Airflow API on http://127.0.0.1:{airflow.port}; triggering {dag_id} with conf {json.dumps(conf)}")
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
        if ok and args.maxtext == "real" and not args.rehearsal:  # the stand-in's export is not a model transformers loads
            ok = report_samples(airflow, timeout=600)
        print(f"\nTask logs: {airflow.home / 'logs'}")
        return 0 if ok else 1
    finally:
        if airflow:
            airflow.stop()
        cloud.stop()


if __name__ == "__main__":
    sys.exit(main())
