"""One run, one spec: everything a fine-tuning run needs, derived once from Params and run identity.

`RunSpec` is a frozen dataclass built by `build_run_spec` from the validated Params, the DAG
run's identity and the VM user's public key. Every later task reads it (through XCom) instead of
deriving names and paths on its own, so a task retry sees exactly the same VM name, run_name and
paths. It has no Airflow imports, so tests build specs without Airflow.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
import uuid
from collections.abc import Collection, Iterable, Mapping
from datetime import datetime
from typing import Any

PACKAGE_LABEL = "airflow-maxtext-sft"

# Values the tutorial sets (../shared/seed/workflow.md); the DAG's Params default to these.
TUTORIAL_DEFAULTS: dict[str, Any] = {
    "project_id": None,  # None: the Google connection's project, as the provider's operators do
    "zone": "us-east5-b",
    "reservation": None,  # required: a reservation-bound VM needs one
    "network": "default",
    "network_tag": "maxtext-sft",
    "vm_name_prefix": "maxtext-sft",
    "machine_type": "ct6e-standard-8t",
    "image_project": "ubuntu-os-accelerator-images",
    "image_family": "ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e",
    "boot_disk_size_gb": 200,
    "vm_hourly_price_usd": 20.0,  # a v6e-8 on a reservation, roughly: the run summary's cost estimate
    "service_account": "default",
    "model_name": "gemma3-4b",
    "model_revision": None,  # None: the Hub's default branch
    "base_model_id": None,  # None: the Hub id MaxText converts from (BASE_MODELS)
    "output_location": None,  # None: the tutorial's /dev/shm layout, gone with the VM
    "hub_repo_id": None,  # None: do not publish
    "hub_private": True,
    "hub_branch": "main",
    "hub_max_final_loss": None,
    "steps": 1000,
    "per_device_batch_size": 1,
    "dataset_name": "HuggingFaceH4/ultrachat_200k",
    "train_split": "train_sft",
    "train_data_columns": ["messages"],
    "dataset_revision": None,
    "maxtext_version": "0.2.2",
    "work_dir": "~",
    "use_pathways": False,
    "lazy_load_tensors": False,
    "convert_extra_args": [],
    "train_extra_args": [],
    "export_extra_args": [],
    "use_internal_ip": False,
    "os_login": False,  # True: OS Login grants SSH (the Google connection's account), not the ssh-keys metadata
    "ssh_via_iap": False,  # True: SSH through an IAP TCP tunnel (gcloud on the workers), no open port 22
    "ssh_connect_timeout_seconds": 30,
    "install_timeout_minutes": 60,
    "convert_timeout_minutes": 60,
    "export_timeout_minutes": 60,
    "training_timeout_hours": 12,
    "poke_interval_seconds": 60,
    "stall_timeout_seconds": 3600,  # no new training step for this long: the run fails
    "checkpoint_period": 10000,  # MaxText's default: a fresh run saves step 1 and the last step only
    "max_vm_recoveries": 2,  # how often a VM lost mid-training is recreated to resume
    "max_capacity_wait_minutes": 720,  # how long create_vm waits for a free machine in the reservation
    "max_run_duration_minutes": None,  # None: every step's time limit added up, plus a margin
    "cloud_enforced_lifetime": True,  # the VM's scheduling.maxRunDuration (Compute Engine deletes it)
}

# What a VM's lifetime adds to the steps' time limits: boot, SSH, uploads, teardown.
LIFETIME_MARGIN_MINUTES = 30
# Compute Engine's limits for scheduling.maxRunDuration.
MAX_RUN_DURATION_LIMITS_SECONDS = (30, 120 * 24 * 3600)

# Integer Params: (lowest, highest) allowed; the trigger form's schema uses the same bounds.
INT_BOUNDS: dict[str, tuple[int, int]] = {
    "boot_disk_size_gb": (10, 65536),
    "steps": (1, 10_000_000),
    "per_device_batch_size": (1, 4096),
    "ssh_connect_timeout_seconds": (1, 600),
    "install_timeout_minutes": (1, 24 * 60),
    "convert_timeout_minutes": (1, 24 * 60),
    "export_timeout_minutes": (1, 24 * 60),
    "training_timeout_hours": (1, 24 * 14),
    "poke_interval_seconds": (1, 3600),
    "stall_timeout_seconds": (10, 7 * 24 * 3600),
    "checkpoint_period": (1, 10_000_000),
    "max_vm_recoveries": (0, 10),
    "max_capacity_wait_minutes": (0, 7 * 24 * 60),  # 0: fail at once when the reservation is full
    "max_run_duration_minutes": (1, MAX_RUN_DURATION_LIMITS_SECONDS[1] // 60),
}

# TPU runtime environment per machine type (the tutorial's TPU_* exports for ct6e-standard-8t).
TPU_TOPOLOGIES: dict[str, dict[str, str]] = {
    "ct6e-standard-8t": {"accelerator_type": "v6e-8", "topology": "2x4", "chips_per_host_bounds": "2,4,1"},
    "ct6e-standard-4t": {"accelerator_type": "v6e-4", "topology": "2x2", "chips_per_host_bounds": "2,2,1"},
    "ct6e-standard-1t": {"accelerator_type": "v6e-1", "topology": "1x1", "chips_per_host_bounds": "1,1,1"},
}

# The models MaxText 0.2.2 converts from Hugging Face, each with the Hub checkpoint its converter
# downloads (maxtext/utils/globals.py HF_IDS; to_maxtext refuses any other model_name, on the VM)
# and, where the model's Hub card states one, its licence: the model card's `base_model` and
# `license` (None: the card names no licence).
BASE_MODELS: dict[str, tuple[str, str | None]] = {
    **{f"gemma2-{size}": (f"google/gemma-2-{size}", "gemma") for size in ("2b", "9b", "27b")},
    **{f"gemma3-{size}": (f"google/gemma-3-{size}-it", "gemma") for size in ("4b", "12b", "27b")},
    "gemma4-26b": ("google/gemma-4-26b-a4b-it", None),
    "gemma4-31b": ("google/gemma-4-31b-it", None),
    **{f"qwen2.5-{size}": (f"Qwen/Qwen2.5-{size.upper()}-Instruct", "apache-2.0") for size in ("1.5b", "7b", "14b")},
    "qwen3-0.6b": ("Qwen/Qwen3-0.6B", "apache-2.0"),
    "qwen3-4b": ("Qwen/Qwen3-4B", "apache-2.0"),
    "qwen3-4b-thinking-2507": ("Qwen/Qwen3-4B-Thinking-2507", "apache-2.0"),
    "qwen3-8b": ("Qwen/Qwen3-8B", "apache-2.0"),
    "qwen3-14b": ("Qwen/Qwen3-14B", "apache-2.0"),
    "qwen3-32b": ("Qwen/Qwen3-32B", "apache-2.0"),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B-Thinking-2507", "apache-2.0"),
    "qwen3-30b-a3b-base": ("Qwen/Qwen3-30B-A3B-Base", "apache-2.0"),
    "qwen3-235b-a22b": ("Qwen/Qwen3-235B-A22B-Thinking-2507", "apache-2.0"),
    "qwen3-480b-a35b": ("Qwen/Qwen3-Coder-480B-A35B-Instruct", "apache-2.0"),
    "qwen3-omni-30b-a3b": ("Qwen/Qwen3-Omni-30B-A3B-Instruct", None),
    "qwen3-next-80b-a3b": ("Qwen/Qwen3-Next-80B-A3B-Instruct", None),
    "llama3.1-8b": ("meta-llama/Llama-3.1-8B", "llama3.1"),
    "llama3.1-8b-Instruct": ("meta-llama/Llama-3.1-8B-Instruct", "llama3.1"),
    "llama3.1-70b": ("meta-llama/Llama-3.1-70B", "llama3.1"),
    "llama3.1-70b-Instruct": ("meta-llama/Llama-3.1-70B-Instruct", "llama3.1"),
    "llama3.1-405b": ("meta-llama/Llama-3.1-405B", "llama3.1"),
    "deepseek2-16b": ("deepseek-ai/DeepSeek-V2-Lite", None),
    "deepseek3-671b": ("deepseek-ai/DeepSeek-V3", None),
    "deepseek3.2-671b": ("deepseek-ai/DeepSeek-V3.2", None),
    "gpt-oss-20b": ("openai/gpt-oss-20b", "apache-2.0"),
    "gpt-oss-120b": ("openai/gpt-oss-120b", "apache-2.0"),
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-Instruct-v0.1", "apache-2.0"),
    "mixtral-8x22b": ("mistralai/Mixtral-8x22B-Instruct-v0.1", "apache-2.0"),
    "olmo3-7b": ("allenai/Olmo-3-7B-Instruct", None),
    "olmo3-7b-pt": ("allenai/Olmo-3-1025-7B", None),
    "olmo3-32b": ("allenai/Olmo-3-32B-Think", None),
}

# MaxText arguments the pipeline itself sets; extra args may not override them.
OWNED_KEYS: dict[str, frozenset[str]] = {
    "convert": frozenset(
        {"model_name", "base_output_directory", "hf_access_token", "lazy_load_tensors", "run_name", "revision"}
    ),
    "train": frozenset(
        {
            "run_name",
            "base_output_directory",
            "load_parameters_path",
            "model_name",
            "steps",
            "checkpoint_period",
            "hf_access_token",
            "per_device_batch_size",
            "hf_path",
            "train_split",
            "train_data_columns",
            "hf_train_files",
        }
    ),
    "export": frozenset(
        {"model_name", "load_parameters_path", "base_output_directory", "hf_access_token", "run_name"}
    ),
}

GCE_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
GCE_ZONE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")
PROJECT_ID = re.compile(r"^[a-z][-a-z0-9]{4,28}[a-z0-9]$|^[a-z][-a-z0-9.:]{0,61}[a-z0-9]$")
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
# A dataset: a Hub id, a folder on the VM in the Hub dataset's layout (staged by an image or disk),
# or a folder in a bucket in that layout, which may name the run's date: {{ ds }} or {{ ds_nodash }}
# (the run's logical date, as in Airflow's templates), filled in by build_run_spec.
DATE_TOKEN = re.compile(r"\{\{ ?(ds|ds_nodash) ?\}\}")
_GCS_FOLDER = r"^gs://[a-z0-9][a-z0-9._-]{1,61}[a-z0-9](/(?:[A-Za-z0-9._=-]|TOKEN)+)+/?$"
DATASET = re.compile(HUB_ID.pattern + r"|^/[A-Za-z0-9._/-]+$|" + _GCS_FOLDER.replace("|TOKEN", ""))
DATASET_PARAM = re.compile(HUB_ID.pattern + r"|^/[A-Za-z0-9._/-]+$|" + _GCS_FOLDER.replace("TOKEN", DATE_TOKEN.pattern))
SAFE_TOKEN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAXTEXT_VERSION = re.compile(r"^[0-9]+(\.[0-9]+){1,3}([a-z]+[0-9]*)?$")
# A path on the VM: absolute, or under the home directory ("~" or "~/..."); no shell metacharacters.
VM_PATH = re.compile(r"^(~|~/[A-Za-z0-9._/-]*|/[A-Za-z0-9._/-]+)$")
# One MaxText argument: key=value or --flag=value; the value is data, quoted on the way to the VM.
EXTRA_ARG = re.compile(r"^(--)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.DOTALL)
EMAIL = re.compile(r"^(default|[a-z0-9][-a-z0-9.]*@[a-z0-9][-a-z0-9.]*\.[a-z]+)$")
SSH_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
# gs://BUCKET[/PREFIX]: a bucket name and an optional object prefix without shell metacharacters.
GCS_URI = re.compile(r"^gs://[a-z0-9][a-z0-9._-]{1,61}[a-z0-9](/[A-Za-z0-9._=-]+)*/?$")
GIT_BRANCH = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,99}$")
# The longest string Param taken: a gs:// location is at most a bucket plus a 1024-byte object
# name, and nothing else the pipeline takes is longer. Longer values are refused before their
# pattern is tried (and before the error message quotes them).
MAX_STRING_CHARS = 1024
MAX_EXTRA_ARG_CHARS = 4096  # one extra MaxText argument (a JSON-valued one can be long)


class SpecError(ValueError):
    """A Param or connection value that cannot make a valid run; the message names the field."""


def did_you_mean(value: str, known: Iterable[str], what: str, n: int = 1) -> str:
    """The end of a refusal of `value`: the closest of `known`, or all of them as `what`."""
    known = sorted(known)
    close = difflib.get_close_matches(value, known, n=n)
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else f" ({what}: {', '.join(known)})"


def refuse_unknown_keys(conf: Mapping[str, Any], params: Collection[str]) -> None:
    """Refuse a run conf key that is no Param: Airflow passes it on unchecked, so a typo (`step`
    for `steps`) would be ignored and the run paid for with the default."""
    unknown = sorted(set(conf) - set(params))
    if unknown:
        others = f" (also unknown: {', '.join(map(repr, unknown[1:]))})" if unknown[1:] else ""
        hint = did_you_mean(unknown[0], params, "the Params")
        raise SpecError(f"run conf key {unknown[0]!r} is not a Param of this DAG{hint}{others}")


def _hash(text: str, length: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def label_value(text: str) -> str:
    """A GCE label value (lowercase letters, digits, '-', '_'; at most 63) that still reads like `text`."""
    value = re.sub(r"[^a-z0-9_-]", "-", text.lower())[:63]
    return value


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Names, paths and arguments of one DAG run's fine-tune."""

    dag_id: str
    run_id: str
    generation: int  # the DAG run's clear_number: a cleared run trains again under a new run_name
    project_id: str
    zone: str
    reservation: str
    network: str
    network_tag: str
    vm_name: str
    machine_type: str
    image_project: str
    image_family: str
    boot_disk_size_gb: int
    vm_hourly_price_usd: float  # only for the run summary's estimated cost; nothing is billed by it
    service_account: str
    ssh_user: str
    ssh_public_key: str
    model_name: str
    model_revision: str | None
    base_model_id: str | None  # Hub id of the base checkpoint, for the model card
    base_model_license: str | None
    output_location: str | None  # gs://bucket/prefix (no trailing slash), or None: outputs die with the VM
    hub_repo_id: str | None
    hub_private: bool
    hub_branch: str
    hub_max_final_loss: float | None
    steps: int
    per_device_batch_size: int
    dataset_name: str
    train_split: str
    train_data_columns: tuple[str, ...]
    dataset_revision: str | None  # a commit once plan_run has pinned the snapshot (Hub datasets)
    dataset_files: tuple[str, ...]  # the snapshot's files the run reads (train_files_pattern), for the record
    maxtext_version: str
    work_dir: str
    use_pathways: bool
    lazy_load_tensors: bool
    run_name: str
    convert_extra_args: tuple[str, ...]
    train_extra_args: tuple[str, ...]
    export_extra_args: tuple[str, ...]
    use_internal_ip: bool
    os_login: bool
    ssh_via_iap: bool
    ssh_connect_timeout_seconds: int
    install_timeout_minutes: int
    convert_timeout_minutes: int
    export_timeout_minutes: int
    training_timeout_hours: int
    poke_interval_seconds: int
    stall_timeout_seconds: int
    checkpoint_period: int
    max_vm_recoveries: int
    max_capacity_wait_minutes: int  # create_vm's bound on waiting for a free machine in the reservation
    max_run_duration_minutes: int  # the VM's lifetime: its expiry label, and maxRunDuration if enforced
    cloud_enforced_lifetime: bool

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
    def run_record_uri(self) -> str | None:
        return f"{self.run_output_dir}/run-record.json" if self.output_location else None

    def conversion_key(self) -> dict[str, Any]:
        """What a converted base checkpoint depends on: runs with equal keys share one conversion."""
        return {
            "model_name": self.model_name,
            "model_revision": self.model_revision or "default-branch",
            "maxtext_version": self.maxtext_version,
            "convert_args": self._conversion_flags(),
        }

    @property
    def base_checkpoint_cache(self) -> str | None:
        """Storage folder of this run's converted base checkpoint (see include/vm/convert_to_maxtext.sh)."""
        if not self.output_location:
            return None
        key = _hash(json.dumps(self.conversion_key(), sort_keys=True), 16)
        return f"{self.output_location}/base-checkpoints/{self.model_name}/{key}"

    @property
    def request_id(self) -> str:
        """Base of the insert's request id; CreateVmOperator makes it per try (see there)."""
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{self.project_id}/{self.zone}/{self.vm_name}"))

    @property
    def tpu(self) -> dict[str, str]:
        return TPU_TOPOLOGIES[self.machine_type]

    @property
    def labels(self) -> dict[str, str]:
        return {
            "managed-by": PACKAGE_LABEL,
            "airflow-dag": label_value(self.dag_id),
            "airflow-run": _hash(self.run_id, 16),
            "generation": str(self.generation),
        }

    # MaxText command lines (the tutorial's, with the token left to the environment).
    def convert_args(self) -> list[str]:
        return [
            f"model_name={self.model_name}",
            f"base_output_directory={self.maxtext_checkpoint_dir}",
            *self._conversion_flags(),
        ]

    def _conversion_flags(self) -> list[str]:
        """Every conversion argument but where it writes (what the conversion cache is keyed on)."""
        zarr_ocdbt = str(0 if self.use_pathways else 1)
        return [
            "scan_layers=True",
            "use_multimodal=False",
            "hardware=cpu",
            "skip_jax_distributed_system=true",
            f"checkpoint_storage_use_zarr3={zarr_ocdbt}",
            f"checkpoint_storage_use_ocdbt={zarr_ocdbt}",
            f"--lazy_load_tensors={self.lazy_load_tensors}",
            *([f"--revision={self.model_revision}"] if self.model_revision else []),
            *self.convert_extra_args,
        ]

    def train_args(self, base_checkpoint: str | None = None, *, resuming: bool = False) -> list[str]:
        """train_sft's arguments; `base_checkpoint` is the converted checkpoint the convert step reported.

        `resuming`: a recreated VM takes up the run from its latest checkpoint (MaxText restores it
        by run_name). It does not profile: Tunix refuses a profiling window that the steps left
        cannot hold, and the first attempt's trace is already in tensorboard/.
        """
        base_checkpoint = base_checkpoint or f"{self.maxtext_checkpoint_dir}0/items"
        columns = "[" + ", ".join(f"'{c}'" for c in self.train_data_columns) + "]"
        split = [f"train_split={self.train_split}"]
        hf_path = self.dataset_name
        if self.bucket_dataset:
            # `datasets`' parquet builder reads the bucket's files (gcsfs); as with a pinned Hub
            # revision, the split's files are named and `datasets` calls their split "train".
            hf_path = "parquet"
            split = [f"hf_train_files={self.dataset_name}/{self.train_files_pattern}", "train_split=train"]
        elif self.dataset_revision:
            # MaxText's loader takes no revision: revision-pinned files pin the snapshot instead.
            # `datasets` names the split of explicit data files "train"; the split Param picks
            # the files (UltraChat's data/<split>-*.parquet layout).
            split = [
                f"hf_train_files=hf://datasets/{self.dataset_name}@{self.dataset_revision}/{self.train_files_pattern}",
                "train_split=train",
            ]
        return [
            f"run_name={self.run_name}",
            f"base_output_directory={self.train_output_dir}",
            f"model_name={self.model_name}",
            f"load_parameters_path={base_checkpoint}",
            f"per_device_batch_size={self.per_device_batch_size}",
            f"steps={self.steps}",
            f"checkpoint_period={self.checkpoint_period}",
            f"hf_path={hf_path}",
            *split,
            f"train_data_columns={columns}",
            "profiler=xplane",
            *self.train_extra_args,
            *(["profiler=''"] if resuming else []),
        ]

    def export_args(self) -> list[str]:
        return [
            f"model_name={self.model_name}",
            f"load_parameters_path={self.final_checkpoint_path}",
            f"base_output_directory={self.hf_export_dir}",
            "scan_layers=True",
            "use_multimodal=False",
            "weight_dtype=bfloat16",
            *self.export_extra_args,
        ]

    @property
    def external_address(self) -> bool:
        """Whether the VM gets an external IP: only when the workers SSH to it over one."""
        return not (self.use_internal_ip or self.ssh_via_iap)

    def instance_body(self) -> dict[str, Any]:
        """The insert request body: the tutorial's gcloud request, with the differences commented.

        Field names are google-cloud-compute's (snake_case); on the wire they become the REST API's
        camelCase. URLs are partial: the client library resolves them against its endpoint.
        """
        project, zone = self.project_id, self.zone
        return {
            "name": self.vm_name,  # per DAG run, instead of the tutorial's fixed NAME
            "machine_type": f"projects/{project}/zones/{zone}/machineTypes/{self.machine_type}",
            "can_ip_forward": False,
            "deletion_protection": False,
            "disks": [
                {
                    "auto_delete": True,
                    "boot": True,
                    "initialize_params": {
                        "disk_size_gb": self.boot_disk_size_gb,
                        "source_image": (
                            f"projects/{self.image_project}/zones/-/imageFamilyViews/{self.image_family}"
                        ),
                    },
                    "mode": "READ_WRITE",
                    "type_": "PERSISTENT",
                }
            ],
            # The tutorial's external address, unless the workers reach the VM inside the VPC or
            # through IAP: then none (what `gcloud ... --no-address` sends), so a project under the
            # compute.vmExternalIpAccess policy can run it (the VM's egress then needs Cloud NAT).
            "network_interfaces": [
                {
                    **(
                        {"access_configs": [{"name": "external-nat", "type_": "ONE_TO_ONE_NAT"}]}
                        if self.external_address
                        else {}
                    ),
                    "network": f"projects/{project}/global/networks/{self.network}",
                }
            ],
            "reservation_affinity": {
                "consume_reservation_type": "SPECIFIC_RESERVATION",
                "key": "compute.googleapis.com/reservation-name",
                "values": [self.reservation],
            },
            "scheduling": {
                "automatic_restart": True,
                "instance_termination_action": "DELETE",
                "on_host_maintenance": "TERMINATE",
                "provisioning_model": "RESERVATION_BOUND",
                # A hard lifetime: Compute Engine deletes the VM even if Airflow is gone.
                **(
                    {"max_run_duration": {"seconds": self.max_run_duration_minutes * 60}}
                    if self.cloud_enforced_lifetime
                    else {}
                ),
            },
            # A stable tag a firewall rule can target, instead of the per-run VM name.
            "tags": {"items": [self.network_tag]},
            # Identify the package, DAG and run, so a janitor can find VMs whose run is gone.
            "labels": self.labels,
            # The pipeline's SSH key (the guest agent creates the user), guest attributes on (the
            # guest agent publishes the sshd host keys there, which every SSH step verifies), and
            # the full run identity that label values cannot hold; gcloud sent an empty metadata object.
            "metadata": {
                "items": [
                    # With OS Login the guest ignores ssh-keys: the key is imported into the profile.
                    {"key": "enable-oslogin", "value": "TRUE"}
                    if self.os_login
                    else {"key": "ssh-keys", "value": f"{self.ssh_user}:{self.ssh_public_key} {self.ssh_user}"},
                    {"key": "enable-guest-attributes", "value": "TRUE"},
                    {"key": "airflow-dag-id", "value": self.dag_id},
                    {"key": "airflow-run-id", "value": self.run_id},
                ]
            },
            # gcloud attaches the project's default service account; the capture endpoint had none.
            # cloud-platform scope so the VM can write its outputs to storage (IAM still decides).
            "service_accounts": [
                {"email": self.service_account, "scopes": ["https://www.googleapis.com/auth/cloud-platform"]}
            ],
        }

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for key, value in data.items():
            if isinstance(value, tuple):
                data[key] = list(value)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSpec:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items() if k in fields}
        return cls(**values)


def _require(params: Mapping[str, Any], name: str, pattern: re.Pattern[str], what: str) -> str:
    value = params.get(name)
    if isinstance(value, str) and len(value) > MAX_STRING_CHARS:
        raise SpecError(f"Param {name!r}: {len(value)} characters, at most {MAX_STRING_CHARS}: {value[:40]!r}...")
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise SpecError(f"Param {name!r}: {value!r} is not {what}")
    return value


def _int_in(params: Mapping[str, Any], name: str) -> int:
    low, high = INT_BOUNDS[name]
    value = params.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SpecError(f"Param {name!r}: {value!r} is not an integer in [{low}, {high}]")
    return value


def _bool(params: Mapping[str, Any], name: str) -> bool:
    value = params.get(name)
    if not isinstance(value, bool):
        raise SpecError(f"Param {name!r}: {value!r} is not true or false")
    return value


def _non_negative_number(params: Mapping[str, Any], name: str) -> float:
    value = params.get(name)
    # bool is an int to Python, and NaN or infinity would make every cost meaningless.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise SpecError(f"Param {name!r}: {value!r} is not a non-negative number")
    return float(value)


def _optional(params: Mapping[str, Any], name: str, pattern: re.Pattern[str], what: str) -> str | None:
    return None if params.get(name) is None else _require(params, name, pattern, what)


def _outputs(p: Mapping[str, Any], model_name: str) -> dict[str, Any]:
    """The output and publishing Params, checked together (the model card names the base model)."""
    location = _optional(p, "output_location", GCS_URI, "a gs://bucket/prefix location")
    known_id, known_license = BASE_MODELS[model_name]  # build_run_spec refused any other model
    base_model_id = _optional(p, "base_model_id", HUB_ID, "a Hugging Face model id (owner/name)") or known_id
    limit = p.get("hub_max_final_loss")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit != limit):
        raise SpecError(f"Param 'hub_max_final_loss': {limit!r} is not a number")
    repo_id = _optional(p, "hub_repo_id", HUB_ID, "a Hugging Face repo id (owner/name)")
    return {
        "output_location": location.rstrip("/") if location else None,
        "base_model_id": base_model_id,
        "base_model_license": known_license if base_model_id == known_id else None,
        "hub_repo_id": repo_id,
        "hub_private": _bool(p, "hub_private"),
        "hub_branch": _require(p, "hub_branch", GIT_BRANCH, "a branch name"),
        "hub_max_final_loss": None if limit is None else float(limit),
    }


def validate_extra_args(step: str, args: Any) -> tuple[str, ...]:
    """Extra MaxText arguments: `key=value` or `--flag=value`, never a key the pipeline owns."""
    name = f"{step}_extra_args"
    if not isinstance(args, (list, tuple)):
        raise SpecError(f"Param {name!r}: expected a list of 'key=value' strings, got {args!r}")
    checked = []
    for arg in args:
        match = EXTRA_ARG.match(arg) if isinstance(arg, str) else None
        if not match:
            raise SpecError(f"Param {name!r}: {arg!r} is not 'key=value' or '--flag=value'")
        key = match.group(2)
        if key in OWNED_KEYS[step]:
            raise SpecError(f"Param {name!r}: {key!r} is set by the pipeline and cannot be overridden")
        if "\x00" in arg or len(arg) > MAX_EXTRA_ARG_CHARS:
            raise SpecError(f"Param {name!r}: {arg[:40]!r}... has a NUL byte or is over {MAX_EXTRA_ARG_CHARS} characters")
        checked.append(arg)
    return tuple(checked)


def vm_name_for(prefix: str, dag_id: str, run_id: str, generation: int) -> str:
    """A valid GCE name, unique per DAG run and generation, identical on every task retry."""
    return f"{prefix}-{_hash(f'{dag_id}/{run_id}', 10)}-g{generation}"


def run_name_for(dag_id: str, run_id: str, generation: int, started: datetime) -> str:
    """MaxText's run_name: the tutorial's timestamp, made unique per DAG run and generation."""
    return f"{started:%Y-%m-%d-%H-%M-%S}-{_hash(f'{dag_id}/{run_id}', 8)}-g{generation}"


def build_run_spec(
    params: Mapping[str, Any],
    *,
    dag_id: str,
    run_id: str,
    generation: int,
    started: datetime,
    default_project_id: str | None,
    ssh_user: str,
    ssh_public_key: str,
) -> RunSpec:
    """Validate every Param and derive the run's spec; raises SpecError naming the first bad field."""
    p = {**TUTORIAL_DEFAULTS, **params}
    project_id = p["project_id"] or default_project_id
    if not isinstance(project_id, str) or not PROJECT_ID.fullmatch(project_id):
        raise SpecError(
            f"Param 'project_id': {project_id!r} is not a Google Cloud project id "
            "(set the Param or the Google connection's project)"
        )
    if p["reservation"] is None:
        raise SpecError("Param 'reservation': required (the VM is RESERVATION_BOUND)")
    reservation = _require(p, "reservation", GCE_NAME, "a reservation name")
    machine_type = _require(p, "machine_type", GCE_NAME, "a machine type")
    if machine_type not in TPU_TOPOLOGIES:
        raise SpecError(f"Param 'machine_type': {machine_type!r} is not one of {sorted(TPU_TOPOLOGIES)}")
    prefix = _require(p, "vm_name_prefix", GCE_NAME, "a GCE name prefix")
    if len(prefix) > 40:
        raise SpecError("Param 'vm_name_prefix': at most 40 characters (the run suffix takes the rest)")
    columns = p["train_data_columns"]
    if not isinstance(columns, (list, tuple)) or not columns:
        raise SpecError(f"Param 'train_data_columns': {columns!r} is not a non-empty list of column names")
    for column in columns:
        if not isinstance(column, str) or not SAFE_TOKEN.fullmatch(column):
            raise SpecError(f"Param 'train_data_columns': {column!r} is not a column name")
    revision = p["dataset_revision"]
    if revision is not None and (not isinstance(revision, str) or not SAFE_TOKEN.fullmatch(revision)):
        raise SpecError(f"Param 'dataset_revision': {revision!r} is not a branch, tag or commit id")
    if revision is not None and str(p["dataset_name"]).startswith(("/", "gs://")):
        raise SpecError("Param 'dataset_revision': only a Hub dataset has revisions, not a folder")
    dataset_name = p["dataset_name"]
    if isinstance(dataset_name, str) and dataset_name.startswith("gs://"):
        dataset_name = DATE_TOKEN.sub(
            lambda token: f"{started:%Y-%m-%d}" if token.group(1) == "ds" else f"{started:%Y%m%d}", dataset_name
        ).rstrip("/")
    model_name = _require(p, "model_name", SAFE_TOKEN, "a MaxText model name such as gemma3-4b")
    if model_name not in BASE_MODELS:
        hint = did_you_mean(model_name, BASE_MODELS, "known", n=3)
        raise SpecError(f"Param 'model_name': {model_name!r} is not a model MaxText 0.2.2 converts from Hugging Face{hint}")
    outputs = _outputs(p, model_name)
    if not SSH_USER.fullmatch(ssh_user) or ssh_user == "root":
        raise SpecError(
            f"SSH connection login {ssh_user!r}: need a non-root user name (Compute Engine refuses root)"
        )
    if not re.fullmatch(r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp\d+) [A-Za-z0-9+/=]+$", ssh_public_key):
        raise SpecError("SSH connection: the private key does not give a usable public key")
    return RunSpec(
        dag_id=dag_id,
        run_id=run_id,
        generation=generation,
        project_id=project_id,
        zone=_require(p, "zone", GCE_ZONE, "a zone such as us-east5-b"),
        reservation=reservation,
        network=_require(p, "network", GCE_NAME, "a network name"),
        network_tag=_require(p, "network_tag", GCE_NAME, "a network tag"),
        vm_name=vm_name_for(prefix, dag_id, run_id, generation),
        machine_type=machine_type,
        image_project=_require(p, "image_project", PROJECT_ID, "an image project"),
        image_family=_require(p, "image_family", GCE_NAME, "an image family"),
        boot_disk_size_gb=_int_in(p, "boot_disk_size_gb"),
        vm_hourly_price_usd=_non_negative_number(p, "vm_hourly_price_usd"),
        service_account=_require(p, "service_account", EMAIL, "'default' or a service account email"),
        ssh_user=ssh_user,
        ssh_public_key=ssh_public_key,
        model_name=model_name,
        model_revision=_optional(p, "model_revision", SAFE_TOKEN, "a branch, tag or commit id"),
        **outputs,
        steps=_int_in(p, "steps"),
        per_device_batch_size=_int_in(p, "per_device_batch_size"),
        dataset_name=_require(
            {"dataset_name": dataset_name}, "dataset_name", DATASET,
            "a Hugging Face dataset id (owner/name), an absolute folder on the VM, or gs://bucket/folder",
        ),
        train_split=_require(p, "train_split", SAFE_TOKEN, "a split name"),
        train_data_columns=tuple(columns),
        dataset_revision=revision,
        dataset_files=(),
        maxtext_version=_require(p, "maxtext_version", MAXTEXT_VERSION, "a MaxText version such as 0.2.2"),
        work_dir=_require(p, "work_dir", VM_PATH, "an absolute path or one under ~ on the VM"),
        use_pathways=_bool(p, "use_pathways"),
        lazy_load_tensors=_bool(p, "lazy_load_tensors"),
        run_name=run_name_for(dag_id, run_id, generation, started),
        convert_extra_args=validate_extra_args("convert", p["convert_extra_args"]),
        train_extra_args=validate_extra_args("train", p["train_extra_args"]),
        export_extra_args=validate_extra_args("export", p["export_extra_args"]),
        use_internal_ip=_bool(p, "use_internal_ip"),
        os_login=_bool(p, "os_login"),
        ssh_via_iap=_bool(p, "ssh_via_iap"),
        ssh_connect_timeout_seconds=_int_in(p, "ssh_connect_timeout_seconds"),
        install_timeout_minutes=_int_in(p, "install_timeout_minutes"),
        convert_timeout_minutes=_int_in(p, "convert_timeout_minutes"),
        export_timeout_minutes=_int_in(p, "export_timeout_minutes"),
        training_timeout_hours=_int_in(p, "training_timeout_hours"),
        poke_interval_seconds=_int_in(p, "poke_interval_seconds"),
        stall_timeout_seconds=_int_in(p, "stall_timeout_seconds"),
        checkpoint_period=_int_in(p, "checkpoint_period"),
        max_vm_recoveries=_int_in(p, "max_vm_recoveries"),
        max_capacity_wait_minutes=_int_in(p, "max_capacity_wait_minutes"),
        max_run_duration_minutes=_lifetime_minutes(p),
        cloud_enforced_lifetime=_bool(p, "cloud_enforced_lifetime"),
    )


def _lifetime_minutes(p: Mapping[str, Any]) -> int:
    """The VM's lifetime: the Param, or every step's time limit added up plus a margin."""
    if p.get("max_run_duration_minutes") is not None:
        return _int_in(p, "max_run_duration_minutes")
    limits = [_int_in(p, f"{step}_timeout_minutes") for step in ("install", "convert", "export")]
    training = _int_in(p, "training_timeout_hours") * 60
    return min(sum(limits) + training + LIFETIME_MARGIN_MINUTES, INT_BOUNDS["max_run_duration_minutes"][1])

