"""Real MaxText 0.2.2 as a two-host multi-controller JAX run, on this machine: not a test, not CI.

    python -m bench.real_multihost [--steps 4] [--work-dir DIR] [--keep]

What the MaxText stand-in's multi-host mode imitates (localcloud/maxtext_standin/maxtext/
_distributed.py), done by the real thing at toy size: the local cloud's real image (built if the
cache lacks it), the rehearsal's toy kit (include/vm/prepare_rehearsal.sh), a conversion, then
train_sft as two JAX CPU processes over loopback. On CPU, MaxText initializes jax.distributed
itself (max_utils.initialize_jax_for_cpu: coordinator JAX_COORDINATOR_ADDRESS at port 1234,
process id JOB_INDEX x PROCESSES_IN_JOB + JOB_COMPLETION_INDEX, JAX_PROCESS_COUNT processes, the
variables XPK sets), so the toy's skip_jax_distributed_system=true is left out. On a TPU slice the
same MaxText call is jax.distributed.initialize() with no arguments, placed by the TPU_* variables
start_training.sh exports instead.

Checks what the stand-in relies on and prints it with the wall-clock times as one JSON object:
both processes exit 0, each logs every "completed step" line and writes its own metrics file,
only process 0 starts the distributed service, and each checkpoint holds one OCDBT part and one
array-metadata file per process (ocdbt.process_N/, array_metadatas/process_N). Exits 1 when a
check fails. Measured twice on the 2-core development machine (2026-12): kit 26-27 s, conversion
29-31 s, training 307-321 s for 4 steps (each process compiles the step on its own: the first
step takes ~170 s, the others seconds), all checks passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from localcloud import images

REPO = Path(__file__).resolve().parents[1]
PROCESSES = 2
CPU_COORDINATOR_PORT = 1234  # max_utils.initialize_jax_for_cpu's fixed port ("used in XPK")


def toy_args(kit: Path) -> dict:
    return json.loads((REPO / "include/rehearsal/toy_args.json").read_text().replace("{kit}", str(kit)))


def run_timed(argv: list[str], env: dict, log: Path) -> float:
    started = time.monotonic()
    with log.open("w") as out:
        subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=3600)
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--work-dir", type=Path, help="default: a new temporary folder")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (its logs, checkpoints)")
    args = parser.parse_args(argv)

    image = images.build_real_image()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="real-multihost-"))
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "maxtext_venv").exists():
        (work / "maxtext_venv").symlink_to(image / "maxtext_venv")
    kit = work / "rehearsal-kit"
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH", "HF_TOKEN")}
    env["HOME"] = str(work)
    python = str(work / "maxtext_venv/bin/python3")
    results: dict = {"work_dir": str(work), "processes": PROCESSES, "steps": args.steps}
    procs: list[subprocess.Popen] = []
    try:
        results["kit_seconds"] = run_timed(["bash", str(REPO / "include/vm/prepare_rehearsal.sh"), str(work)], env,
                                           work / "kit.log")
        toy = toy_args(kit)
        env["PYTHONPATH"] = str(kit / "site")  # what activate_maxtext_venv does on a rehearsal VM
        results["convert_seconds"] = run_timed([
            python, "-m", "maxtext.checkpoint_conversion.to_maxtext", "model_name=gemma3-4b",
            f"base_output_directory={work}/mt/", "scan_layers=True", "use_multimodal=False", "hardware=cpu",
            "skip_jax_distributed_system=true", "checkpoint_storage_use_zarr3=1", "checkpoint_storage_use_ocdbt=1",
            "--lazy_load_tensors=False", *toy["convert"]], env, work / "convert.log")

        train = [python, "-m", "maxtext.trainers.post_train.sft.train_sft", "run_name=R",
                 f"base_output_directory={work}/pt", "model_name=gemma3-4b", f"load_parameters_path={work}/mt/0/items",
                 "per_device_batch_size=1", f"steps={args.steps}", "checkpoint_period=2",
                 f"hf_path={toy['dataset']['path']}", f"train_split={toy['dataset']['split']}",
                 "train_data_columns=['messages']",
                 *(arg for arg in toy["train"] if arg != "skip_jax_distributed_system=true")]
        started = time.monotonic()
        for i in range(PROCESSES):
            host_env = {**env, "JAX_COORDINATOR_ADDRESS": "127.0.0.1", "JOB_INDEX": "0",
                        "JOB_COMPLETION_INDEX": str(i), "PROCESSES_IN_JOB": str(PROCESSES),
                        "JAX_PROCESS_COUNT": str(PROCESSES)}
            with (work / f"train{i}.log").open("w") as out:
                procs.append(subprocess.Popen([*train, f"metrics_file={work}/metrics{i}.jsonl"], env=host_env,
                                              stdout=out, stderr=subprocess.STDOUT))
        results["exit_codes"] = [proc.wait(timeout=3600) for proc in procs]
        results["train_seconds"] = time.monotonic() - started

        logs = [(work / f"train{i}.log").read_text() for i in range(PROCESSES)]
        steps = [[int(s) for s in re.findall(r"completed step: (\d+),", log)] for log in logs]
        metrics = [[json.loads(line)["step"] for line in (work / f"metrics{i}.jsonl").read_text().splitlines()
                    if "learning/loss" in line] for i in range(PROCESSES)]
        service = [f"Starting JAX distributed service on [::]:{CPU_COORDINATOR_PORT}" in log for log in logs]
        checkpoints = sorted(int(p.name) for p in (work / "pt/R/checkpoints").iterdir() if p.name.isdigit())
        last = work / "pt/R/checkpoints" / str(args.steps) / "model_params"
        layout = {
            "ocdbt_parts": sorted(p.name for p in last.glob("ocdbt.process_*")),
            "array_metadatas": sorted(p.name for p in (last / "array_metadatas").glob("process_*")),
            "shared": sorted(p.name for p in last.iterdir() if not p.name.startswith(("ocdbt.", "array_"))),
        }
        wanted = list(range(1, args.steps + 1))
        results.update({"steps_logged": steps, "metrics_steps": metrics, "service_started_by": service,
                        "checkpoints": checkpoints, "last_checkpoint": layout})
        results["checks"] = {
            "every process exits 0": results["exit_codes"] == [0] * PROCESSES,
            "every process logs every step": all(s == wanted for s in steps),
            "every process writes its metrics file": all(m == wanted for m in metrics),
            "only process 0 starts the service": service == [True] + [False] * (PROCESSES - 1),
            "one OCDBT part and one array-metadata file per process": (
                layout["ocdbt_parts"] == [f"ocdbt.process_{i}" for i in range(PROCESSES)]
                and layout["array_metadatas"] == [f"process_{i}" for i in range(PROCESSES)]),
        }
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if not args.keep and args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results, indent=1))
    return 0 if all(results.get("checks", {"none": False}).values()) else 1


if __name__ == "__main__":
    sys.exit(main())
