"""Sample generations from a tuned model: fetch its export, run include/eval/generate_samples.py.

The generation needs torch and transformers, which Airflow's environment does not carry: it runs
with the interpreter named by the Airflow config `[maxtext_sft] generation_python` (env
AIRFLOW__MAXTEXT_SFT__GENERATION_PYTHON), e.g. a venv on the workers, or MaxText's own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from airflow.sdk import conf
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException
from maxtext_sft.cloud.export_files import export_folder
from maxtext_sft.cloud.storage import StorageEndpointHook
from maxtext_sft.results.outputs import ExportLayout, ExportLayoutError, check_export_folder
from maxtext_sft.run.paths import include_dir
from maxtext_sft.run.sizing import gb

GENERATION_TIMEOUT_SECONDS = 1800


def generation_python() -> str:
    """The interpreter that generates. Unset: the deployment has not opted in, so the task is
    skipped, saying how to opt in (a failure after every fine-tune would teach users to ignore red);
    set to something that is no file: a broken setting, which fails."""
    python = conf.get("maxtext_sft", "generation_python", fallback="")
    how = "AIRFLOW__MAXTEXT_SFT__GENERATION_PYTHON) to a Python with torch and transformers"
    if not python:
        raise AirflowSkipException(f"No samples generated: [maxtext_sft] generation_python is unset; set it (or {how}")
    if not Path(python).is_file():
        raise AirflowFailException(f"[maxtext_sft] generation_python is {python}, which is no file: set it (or {how}")
    return python


def _generation_env(scratch: str) -> dict[str, str]:
    """Only what the generation needs: not the worker's environment, which may carry connections."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def fetch_model(location: str, scratch: Path, *, gcp_conn_id: str) -> tuple[Path, ExportLayout]:
    """The folder of the export at `location` (gs://..., downloaded into `scratch`, or HOST:/path
    on this worker) and its checked layout (one model.safetensors, or the index and every shard
    it names)."""
    folder = export_folder(location, scratch, gcp_conn_id=gcp_conn_id)
    try:
        return folder, check_export_folder(folder)
    except ExportLayoutError as error:
        raise AirflowFailException(f"The model at {location} is incomplete: {error}") from None


# generate_samples.py loads the weights as float32, twice their bf16 bytes on disk, and needs room
# beside them for the interpreter, torch and the activations of a short greedy generation.
LOAD_MEMORY_PER_MODEL_BYTE = 2.5


def model_bytes(location: str, *, gcp_conn_id: str) -> int:
    """Size of the export at `location` (gs://..., or HOST:/path on this worker) before copying it."""
    if location.startswith("gs://"):
        return sum(StorageEndpointHook(gcp_conn_id=gcp_conn_id).sizes_under(location).values())
    folder = Path(location.partition(":")[2])
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def available_memory_bytes() -> int:
    """Memory the kernel can give a new process without swapping (Linux MemAvailable)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def check_worker_can_load(size: int, *, available_memory: int, free_disk: int, location: str) -> None:
    """Refuse, with the numbers, a model this worker cannot copy or load: a real 4B export is
    7.8 GB and needs about 20 GB of memory here, which a small Airflow worker does not have."""
    need = int(size * LOAD_MEMORY_PER_MODEL_BYTE)
    problems = []
    if size > free_disk:
        problems.append(f"its temporary folder has {gb(free_disk)} free for the model's {gb(size)}")
    if need > available_memory:
        problems.append(f"loading it takes about {gb(need)} of memory and {gb(available_memory)} is available")
    if problems:
        raise AirflowFailException(
            f"This worker cannot generate from {location}: " + "; ".join(problems)
            + ". Run this DAG on a worker queue with the room (e.g. default_args queue), or for a model this size "
            "on an accelerator machine."
        )


def sample_generations(model: dict[str, Any], *, gcp_conn_id: str, max_new_tokens: int, log) -> dict[str, Any]:
    """Generate one completion per prompt of include/eval/prompts.txt from the model of an Asset event."""
    python = generation_python()
    check_worker_can_load(
        model_bytes(model["location"], gcp_conn_id=gcp_conn_id),
        available_memory=available_memory_bytes(),
        free_disk=shutil.disk_usage(tempfile.gettempdir()).free,
        location=model["location"],
    )
    with tempfile.TemporaryDirectory(prefix="tuned-model-") as folder:
        model_dir, export = fetch_model(model["location"], Path(folder), gcp_conn_id=gcp_conn_id)
        log.info("Generating from %s (run %s, dataset %s@%s; %s weights: %s)", model["location"], model["run_name"],
                 model["dataset"], model["dataset_revision"], export.layout, list(export.weight_files))
        eval_dir = include_dir() / "eval"
        done = subprocess.run(
            [python, str(eval_dir / "generate_samples.py"), str(model_dir), str(eval_dir / "prompts.txt"),
             str(max_new_tokens)],
            capture_output=True, text=True, timeout=GENERATION_TIMEOUT_SECONDS, env=_generation_env(folder),
        )
    if done.returncode != 0:
        raise AirflowFailException(f"Generation failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    samples, missing = result["samples"], result["missing_weights"]
    if missing:
        log.warning("%s weights the model expects are not in its files (randomly initialised): %s",
                    len(missing), missing[:20])
    for sample in samples:
        log.info("%r -> %r", sample["prompt"], sample["completion"])
    return {"model": model["location"], "run_name": model["run_name"], "weight_layout": export.layout,
            "weight_files": list(export.weight_files), "missing_weights": missing, "samples": samples}
