"""What a DAG file costs to parse, in Airflow's own DAG processor and in a fresh process.

    .venv/bin/python -m bench.dag_parse [--jobs 20] [--loops 3] [--no-bytecode-cache]

A temporary dags folder holds the manual DAG file (dags/maxtext_sft.py), `job_count` declared
jobs (copies of include/jobs/ultrachat-gemma3-nightly.yaml under distinct names in a jobs folder
of their own, MAXTEXT_SFT_JOBS_DIR, each with a loader made from dags/job_ultrachat_gemma3_nightly.py)
and airflow-core's example_params_ui_tutorial.py, copied from the installed airflow package as
the yardstick. Airflow's dag-processor (localcloud.airflow_harness, SQLite) parses the folder for
`loops` rounds; each parse's duration is what Airflow itself records, `dag.last_parse_duration`
with its `last_parsed_time` (the manager's DagFileStat.last_duration: fork to result, the
database writes after it not included), read from the metadata database as it changes. The first
parse of each file is left out of the medians (it fills the bytecode cache; the processor's
parent also pre-imports a file's airflow.* modules once then, outside the recorded duration).

Two process-level costs beside it, each the median of `repeats` runs:
- fresh: `python -c` that parses the file and exits: interpreter, Airflow and the file (a cold
  start, what `python dags/FILE.py` or a CI import check pays);
- task: the parse alone in a process that has already imported what a task runner has before it
  parses its DAG file (airflow.sdk, the task runner): what every task try and sensor poke pays.

With `bytecode_cache` (the default) the processes write and read bytecode under a private
PYTHONPYCACHEPREFIX in the temporary folder, as a deployment whose packages were installed with
compiled bytecode does; without it they run as this environment does (PYTHONDONTWRITEBYTECODE
set and no bytecode in the virtualenv: every import compiles its source). Every process started
is stopped, and the temporary folder removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import airflow

from localcloud.airflow_harness import REPO, Airflow, AirflowError

JOB_TEMPLATE = REPO / "include" / "jobs" / "ultrachat-gemma3-nightly.yaml"
JOB_LOADER = REPO / "dags" / "job_ultrachat_gemma3_nightly.py"
MANUAL_DAG = REPO / "dags" / "maxtext_sft.py"
EXAMPLE_DAG = Path(airflow.__file__).parent / "example_dags" / "example_params_ui_tutorial.py"

# Run in a child: prints the seconds one parse of argv[1] took, after what a task runner imports
# before it parses its DAG file (the supervisor forks it with these loaded).
TASK_PARSE = """
import runpy, sys, time
import airflow.sdk, airflow.sdk.execution_time.task_runner
started = time.perf_counter()
runpy.run_path(sys.argv[1])
print(time.perf_counter() - started)
"""


def make_dags_folder(root: Path, job_count: int) -> dict[str, str]:
    """Fill root/dags and root/jobs; {DAG file name: kind} ("job", "manual" or "example")."""
    dags, jobs = root / "dags", root / "jobs"
    dags.mkdir()
    jobs.mkdir()
    kinds = {MANUAL_DAG.name: "manual", EXAMPLE_DAG.name: "example"}
    shutil.copy(MANUAL_DAG, dags / MANUAL_DAG.name)
    shutil.copy(EXAMPLE_DAG, dags / EXAMPLE_DAG.name)
    loader = JOB_LOADER.read_text()
    if JOB_TEMPLATE.name not in loader:
        raise ValueError(f"{JOB_LOADER} does not name {JOB_TEMPLATE.name}: cannot make loaders from it")
    for number in range(job_count):
        job = f"bench-job-{number:02d}.yaml"
        shutil.copy(JOB_TEMPLATE, jobs / job)
        loader_name = f"job_bench_{number:02d}.py"
        (dags / loader_name).write_text(loader.replace(JOB_TEMPLATE.name, job))
        kinds[loader_name] = "job"
    return kinds


def parse_env(root: Path, *, bytecode_cache: bool) -> dict[str, str]:
    env = {**os.environ, "MAXTEXT_SFT_JOBS_DIR": str(root / "jobs"), "PYTHONPATH": str(REPO / "plugins")}
    env.pop("PYTHONPYCACHEPREFIX", None)
    if bytecode_cache:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(root / "pycache")
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def recorded_parses(db: Path) -> list[tuple[str, str, float]]:
    """(relative file, last_parsed_time, last_parse_duration) of every parsed DAG, as Airflow stored them."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as connection:
            rows = connection.execute(
                "SELECT relative_fileloc, last_parsed_time, last_parse_duration FROM dag"
                " WHERE last_parse_duration IS NOT NULL"
            ).fetchall()
    except sqlite3.OperationalError:
        return []  # not migrated yet, or locked by a writer: read again at the next poll
    return [(str(fileloc), str(parsed), float(duration)) for fileloc, parsed, duration in rows]


def import_errors(db: Path) -> dict[str, str]:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as connection:
            return dict(connection.execute("SELECT filename, stacktrace FROM import_error").fetchall())
    except sqlite3.OperationalError:
        return {}


def processor_parses(
    root: Path, kinds: dict[str, str], env: dict[str, str], *, loops: int, interval: int, timeout: float
) -> dict[str, list[float]]:
    """{DAG file name: the durations of its first `loops` parses, in order}, from Airflow's record."""
    processor_env = {
        **env,
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": str(interval),
        "AIRFLOW__DAG_PROCESSOR__DAG_FILE_PROCESSOR_TIMEOUT": "600",  # a slow parse is measured, not killed
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
    }
    airflow_ = Airflow(root / "airflow-home", processor_env, dags_folder=root / "dags")
    db = airflow_.home / "airflow.db"
    seen: dict[str, dict[str, float]] = {name: {} for name in kinds}
    try:
        airflow_.start_dag_processor()
        deadline = time.monotonic() + timeout
        while any(len(parses) < loops for parses in seen.values()):
            for fileloc, parsed, duration in recorded_parses(db):
                name = Path(fileloc).name
                if name in seen:
                    seen[name].setdefault(parsed, duration)
            errors = import_errors(db)
            if errors:
                raise AirflowError(f"the DAG processor could not import: {json.dumps(errors)[:3000]}")
            if not airflow_.running("dag-processor"):
                raise AirflowError(f"the dag-processor exited: {airflow_.log_tail('dag-processor')}")
            if time.monotonic() > deadline:
                counts = {name: len(parses) for name, parses in seen.items()}
                raise AirflowError(f"timed out after {timeout:.0f} s waiting for {loops} parses of each file: {counts}")
            time.sleep(0.5)  # polling interval: each file is parsed at most every `interval` s
    finally:
        airflow_.stop()
    return {name: [parses[when] for when in sorted(parses)][:loops] for name, parses in seen.items()}


def process_seconds(code: str, path: Path, env: dict[str, str], *, whole_process: bool) -> float:
    """One child's time: its wall time (`whole_process`) or the number it prints. It runs beside the
    dags folder, not in it: dags/maxtext_sft.py would hide the maxtext_sft package."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True, timeout=600, cwd=path.parent.parent
    )
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"parsing {path.name} in a child failed: {done.stderr[-3000:]}")
    return elapsed if whole_process else float(done.stdout.split()[-1])


def measure_parse_cost(
    job_count: int = 20,
    *,
    loops: int = 3,
    interval: int = 10,
    repeats: int = 3,
    bytecode_cache: bool = True,
    timeout: float = 1800,
) -> dict:
    """Seconds per parse of a declared job's DAG file, the manual DAG file and Airflow's
    example_params_ui_tutorial.py: in the DAG processor (median over every file of the kind and
    every parse after the first) and per process (fresh, task). See the module's docstring."""
    if job_count < 1 or loops < 2:
        raise ValueError("need at least one job and two parsing loops (the first is left out)")
    root = Path(tempfile.mkdtemp(prefix="maxtext-sft-parse-bench-"))
    try:
        kinds = make_dags_folder(root, job_count)
        env = parse_env(root, bytecode_cache=bytecode_cache)
        parses = processor_parses(root, kinds, env, loops=loops, interval=interval, timeout=timeout)
        samples = {kind: [d for name, ds in parses.items() if kinds[name] == kind for d in ds[1:]] for kind in set(kinds.values())}
        files = {"job": root / "dags" / "job_bench_00.py", "manual": root / "dags" / MANUAL_DAG.name,
                 "example": root / "dags" / EXAMPLE_DAG.name}
        result: dict = {
            "job_count": job_count,
            "loops": loops,
            "bytecode_cache": bytecode_cache,
            "load_average": os.getloadavg(),
            "processor": {kind: statistics.median(values) for kind, values in samples.items()},
            "processor_first_parse": {
                kind: statistics.median(ds[0] for name, ds in parses.items() if kinds[name] == kind) for kind in files
            },
            "fresh_process": {},
            "task_parse": {},
            "processor_parses": parses,
        }
        parse_file = "import runpy, sys; runpy.run_path(sys.argv[1])"
        for kind, path in files.items():
            result["fresh_process"][kind] = statistics.median(
                process_seconds(parse_file, path, env, whole_process=True) for _ in range(repeats)
            )
            result["task_parse"][kind] = statistics.median(
                process_seconds(TASK_PARSE, path, env, whole_process=False) for _ in range(repeats)
            )
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20, help="declared jobs in the folder")
    parser.add_argument("--loops", type=int, default=3, help="parses of each file (the first is left out)")
    parser.add_argument("--interval", type=int, default=10, help="[dag_processor] min_file_process_interval")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each per-process measurement")
    parser.add_argument("--no-bytecode-cache", action="store_true", help="compile every import, as this environment does")
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")
    args = parser.parse_args()
    result = measure_parse_cost(
        args.jobs, loops=args.loops, interval=args.interval, repeats=args.repeats, bytecode_cache=not args.no_bytecode_cache
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return
    load = ", ".join(f"{value:.1f}" for value in result["load_average"])
    print(f"{args.jobs} declared jobs, {args.loops} parsing loops, bytecode cache "
          f"{'on' if result['bytecode_cache'] else 'off'}; load average at the end {load}")
    print(f"{'seconds per parse':<34}{'job file':>10}{'manual DAG':>12}{'example':>10}")
    rows = [("DAG processor (median)", "processor"), ("DAG processor, first parse", "processor_first_parse"),
            ("fresh process (python -c)", "fresh_process"), ("task process (parse alone)", "task_parse")]
    for label, key in rows:
        values = result[key]
        print(f"{label:<34}{values['job']:>10.2f}{values['manual']:>12.2f}{values['example']:>10.2f}")


if __name__ == "__main__":
    main()
