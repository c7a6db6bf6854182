"""Names and paths derived from one run: the VM's name, MaxText's run_name, where each output
goes, the labels and request id of the VM. `RunPaths` is one part of spec.RunSpec (which has the
values these read); no Airflow imports."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from datetime import datetime

PACKAGE_LABEL = "airflow-maxtext-sft"


def short_hash(text: str, length: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def label_value(text: str) -> str:
    """A GCE label value (lowercase letters, digits, '-', '_'; at most 63) that still reads like `text`."""
    return re.sub(r"[^a-z0-9_-]", "-", text.lower())[:63]


# Orbax writes this into a checkpoint step folder on GCS after every other file of the step.
ORBAX_COMMIT_MARKER = "commit_success.txt"
# What start_training.sh copies into the run's folder in storage as the training exits (its
# STEP_LINES_URI, METRICS_URI and LOG_URI arguments): the log's step lines, MaxText's metrics file
# and its full log.
TRAINING_STEPS_NAME = "training-steps.log"
TRAINING_METRICS_NAME = "training-metrics.jsonl"
TRAINING_LOG_NAME = "training.log"


def split_gcs_uri(uri: str) -> tuple[str, str]:
    """gs://bucket/some/prefix -> ("bucket", "some/prefix")."""
    if not uri.startswith("gs://"):
        raise ValueError(f"not a gs:// URI: {uri!r}")
    bucket, _, name = uri[len("gs://") :].partition("/")
    return bucket, name.strip("/")


# The recovery ledger's objects (vm/recovery.py): N.json per recovery, N-resumed.json once its
# training resumed.
LEDGER_ENTRY = re.compile(r"([0-9]+)\.json")


def ledger_entry_name(number: int) -> str:
    return f"{number}.json"


def ledger_resumed_name(number: int) -> str:
    return f"{number}-resumed.json"


def ledger_entry_number(name: str) -> int | None:
    """N of a ledger entry's object name "N.json"; None for any other object."""
    match = LEDGER_ENTRY.fullmatch(name)
    return int(match.group(1)) if match else None


def vm_name_for(prefix: str, dag_id: str, run_id: str, generation: int) -> str:
    """A valid GCE name, unique per DAG run and generation, identical on every task retry."""
    return f"{prefix}-{short_hash(f'{dag_id}/{run_id}', 10)}-g{generation}"


def run_name_for(dag_id: str, run_id: str, generation: int, started: datetime) -> str:
    """MaxText's run_name: the tutorial's timestamp, made unique per DAG run and generation."""
    return f"{started:%Y-%m-%d-%H-%M-%S}-{short_hash(f'{dag_id}/{run_id}', 8)}-g{generation}"


class RunPaths:
    """Where a run's files go, on the VM and in storage, and how its VM is named and labelled."""

    # Paths on the VM (the tutorial's /dev/shm layout); with an output location, MaxText's run
    # folder and the export live in storage instead:
    #   OUTPUT/runs/RUN_NAME/{checkpoints,tensorboard}/   MaxText's run folder, written as it trains
    #   OUTPUT/runs/RUN_NAME/hf-export/                   the tuned model in Hugging Face format
    #   OUTPUT/runs/RUN_NAME/run-record.json              where everything went (written last)
    #   OUTPUT/runs/RUN_NAME/vm-recoveries/N.json         the VM was lost and recreated (N-th time)
    #   OUTPUT/base-checkpoints/MODEL/KEY/                converted base checkpoints, shared by runs
    @property
    def hub_dataset(self) -> bool:
        """The dataset is on the Hub (it has revisions), not a folder on the VM or in a bucket."""
        return not self.dataset_name.startswith(("/", "gs://"))

    @property
    def bucket_dataset(self) -> bool:
        return self.dataset_name.startswith("gs://")

    @property
    def train_files_pattern(self) -> str:
        """The training split's files in a Hub dataset (UltraChat's data/<split>-*.parquet layout)."""
        return f"data/{self.train_split}-*.parquet"

    @property
    def eval_files_pattern(self) -> str | None:
        """The held-out split's files, in the same layout; None when the run does not evaluate."""
        return f"data/{self.eval_split}-*.parquet" if self.eval_split else None

    @property
    def durable(self) -> bool:
        return self.output_location is not None

    @property
    def scratch_dir(self) -> str:
        return f"/dev/shm/{self.model_name}"

    @property
    def maxtext_checkpoint_dir(self) -> str:
        """Where the conversion writes: the tutorial's folder on the VM, or with an output location
        this run's attempt in the shared cache (see include/vm/convert_to_maxtext.sh)."""
        if self.output_location:
            return f"{self.base_checkpoint_cache}/attempts/{self.run_name}/"
        return f"{self.scratch_dir}/mt-format/"

    @property
    def train_output_dir(self) -> str:
        if self.output_location:
            return f"{self.output_location}/runs/"
        return f"{self.scratch_dir}/post-train/"

    @property
    def run_output_dir(self) -> str:
        return f"{self.train_output_dir}{self.run_name}"

    @property
    def checkpoints_dir(self) -> str:
        return f"{self.run_output_dir}/checkpoints"

    @property
    def final_checkpoint_path(self) -> str:
        return f"{self.checkpoints_dir}/{self.steps}/model_params"

    @property
    def final_commit_marker_uri(self) -> str:
        """The final step's Orbax commit marker: with an output location, the training is done once it exists."""
        return f"{self.checkpoints_dir}/{self.steps}/{ORBAX_COMMIT_MARKER}"

    @property
    def hf_export_dir(self) -> str:
        """Where the export is written on the VM."""
        return f"{self.scratch_dir}/hf-trained/"

    @property
    def hf_export_uri(self) -> str | None:
        """Where the export is uploaded, next to the run's checkpoints; None without an output location."""
        return f"{self.run_output_dir}/hf-export" if self.output_location else None

    @property
    def vm_recoveries_uri(self) -> str | None:
        """Folder of the run's recovery ledger (one object per recreated VM); None without an output location."""
        return f"{self.run_output_dir}/vm-recoveries" if self.output_location else None

    @property
    def training_steps_uri(self) -> str | None:
        """The training's per-step lines, copied next to its checkpoints when it exits: the final
        loss outlives the VM. None without an output location."""
        return f"{self.run_output_dir}/{TRAINING_STEPS_NAME}" if self.output_location else None

    @property
    def training_metrics_uri(self) -> str | None:
        """MaxText's metrics file (train and eval losses by step), copied there when the training
        exits: the loss history and the eval results outlive the VM. None without an output location."""
        return f"{self.run_output_dir}/{TRAINING_METRICS_NAME}" if self.output_location else None

    @property
    def training_log_uri(self) -> str | None:
        """MaxText's full log (its config dump and warnings too: the task log shows only some of
        it), copied there when the training exits. None without an output location."""
        return f"{self.run_output_dir}/{TRAINING_LOG_NAME}" if self.output_location else None

    @property
    def run_record_uri(self) -> str | None:
        return f"{self.run_output_dir}/run-record.json" if self.output_location else None

    @property
    def base_checkpoint_cache(self) -> str | None:
        """Storage folder of this run's converted base checkpoint (see include/vm/convert_to_maxtext.sh)."""
        if not self.output_location:
            return None
        key = short_hash(json.dumps(self.conversion_key(), sort_keys=True), 16)
        return f"{self.output_location}/base-checkpoints/{self.model_name}/{key}"

    @property
    def request_id(self) -> str:
        """Base of the insert's request id; CreateVmOperator makes it per try (see there)."""
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{self.project_id}/{self.zone}/{self.vm_name}"))

    @property
    def labels(self) -> dict[str, str]:
        return {
            "managed-by": PACKAGE_LABEL,
            "airflow-dag": label_value(self.dag_id),
            "airflow-run": short_hash(self.run_id, 16),
            "generation": str(self.generation),
        }
