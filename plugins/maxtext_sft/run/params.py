"""What a user may ask of a fine-tune: every Param declared once, in `PARAMS`.

One row per Param: name, type, default (the tutorial's value), limits (pattern, bounds, choices,
length), help text, the trigger form's title (the field's label) and section, and whether it may
be empty (a field that may not is marked required in the form). From this table come the trigger form's JSON schema
(`form_schema`; run/dag_params.py makes Airflow Params of it), the check of every value a run is given,
whether from the form, a run conf or a declared-job file (`check_params`), and the typed values
the run's spec answers by name (run/spec.py). Adding a Param is one row here plus the code that uses
it. No Airflow imports.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any, Literal

from maxtext_sft.run.catalog import BASE_MODELS, TPU_SLICES, TPU_TOPOLOGIES

# Patterns each string must match whole (checked with fullmatch; the form's schema gets an end
# anchor that Python's re.search honours too, see `whole_value`).
GCE_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
GCE_ZONE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")
PROJECT_ID = re.compile(r"^[a-z][-a-z0-9]{4,28}[a-z0-9]$|^[a-z][-a-z0-9.:]{0,61}[a-z0-9]$")
# A reservation by name (the run's project's) or by the path a shared one is consumed by.
RESERVATION = re.compile(r"^(projects/(" + PROJECT_ID.pattern.replace("^", "").replace("$", "") + r")/reservations/)?"
                         + GCE_NAME.pattern.lstrip("^"))
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
# One MaxText argument: key=value or --flag=value; the value is data (newlines too, never a NUL),
# quoted on the way to the VM.
EXTRA_ARG = re.compile(r"^(--)?([A-Za-z_][A-Za-z0-9_]*)=([^\x00]*)$")
EMAIL = re.compile(r"^(default|[a-z0-9][-a-z0-9.]*@[a-z0-9][-a-z0-9.]*\.[a-z]+)$")
# gs://BUCKET[/PREFIX]: a bucket name and an optional object prefix without shell metacharacters.
GCS_URI = re.compile(r"^gs://[a-z0-9][a-z0-9._-]{1,61}[a-z0-9](/[A-Za-z0-9._=-]+)*/?$")
GIT_BRANCH = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,99}$")
# The longest string Param taken: a gs:// location is at most a bucket plus a 1024-byte object
# name, and nothing else the pipeline takes is longer. Longer values are refused before their
# pattern is tried (and before the error message quotes them).
MAX_STRING_CHARS = 1024
MAX_EXTRA_ARG_CHARS = 4096  # one extra MaxText argument (a JSON-valued one can be long)

# Compute Engine's limits for scheduling.maxRunDuration.
MAX_RUN_DURATION_LIMITS_SECONDS = (30, 120 * 24 * 3600)
# Where a run's TPU comes from (the `capacity` Param); run/compute_body.py makes each one's body.
CAPACITIES = ("reservation", "flex-start", "spot", "on-demand")

# Airflow validates every Param with jsonschema each time it serializes an operator (the DAG's
# Params are every task's), in the DAG processor, the scheduler and each task: about 3,000
# validations a parse here. jsonschema first checks the schema itself against its draft's
# meta-schema; 2020-12 (the default) is four times as slow to check as draft 7, which has every
# keyword these schemas use (apache/airflow#28059, #32434: Params slowing the DAG processor).
SCHEMA_DRAFT = "http://json-schema.org/draft-07/schema#"

# Trigger-form sections.
CLOUD = "Google Cloud"
VM = "TPU VM"
MODEL = "Model and data"
MAXTEXT = "MaxText"
OUTPUTS = "Outputs and publishing"
TIMING = "Timeouts, polling and recovery"
REHEARSAL = "Rehearsal"


class SpecError(ValueError):
    """A Param or connection value that cannot make a valid run; the message names the field
    (`param`, when it is one Param's value)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class Declared:
    """One Param: what the form shows, what a value must be, and what a run gets by default."""

    name: str
    type: Literal["string", "integer", "number", "boolean", "array"]
    default: Any
    description: str  # help text under the field, in a user's words
    section: str
    title: str = ""  # the field's label in the form; every row has one (test_param_declaration)
    nullable: bool = False  # None is a value (its meaning in the description)
    pattern: re.Pattern[str] | None = None  # strings, and an array's items
    what: str = ""  # what a value that fails the pattern or choices is not: "a zone such as us-east5-b"
    max_length: int | None = None  # strings and an array's items; default MAX_STRING_CHARS
    minimum: float | None = None
    maximum: float | None = None
    choices: Collection[str] | None = None
    min_items: int | None = None

    def but(self, **changes: Any) -> Declared:
        """This Param with other values (another DAG's Param of the same kind)."""
        return dataclasses.replace(self, **changes)


def _timeout(name: str, title: str, what: str, default: int, high: int, **more: Any) -> Declared:
    return Declared(name, "integer", default, what, TIMING, title=title, minimum=1, maximum=high, **more)


# Help text is for the person at the trigger form: what the field does for them, its unit, what
# empty means; other fields are named by their titles (the form shows no Param names).
PARAMS: tuple[Declared, ...] = (
    # Google Cloud
    Declared("project_id", "string", None,
             "The Google Cloud project the TPU VM runs in. Empty: the project of Airflow's Google Cloud "
             "connection.", CLOUD, title="Project",
             nullable=True, pattern=PROJECT_ID, what="a Google Cloud project id"),
    Declared("zone", "string", "us-east5-b", "The zone of the reservation, where the VM is created, e.g. us-east5-b.",
             CLOUD, title="Zone", pattern=GCE_ZONE, what="a zone such as us-east5-b"),
    Declared("capacity", "string", "reservation",
             "Where the TPU comes from. reservation: a reservation you hold (the tutorial's; name it below). "
             "flex-start: queued until Compute Engine has a machine (up to the request's validity), then up to "
             "7 days uninterrupted; preemptible quota. spot: at once when there is a machine, far cheaper, but "
             "taken back at any time: the run resumes on a new VM from its last checkpoint (needs an Output "
             "location). on-demand: the list price, never taken back.", CLOUD, title="TPU capacity",
             choices=CAPACITIES, what="a capacity type"),
    Declared("reservation", "string", None,
             "With TPU capacity 'reservation' (required then): the capacity reservation the TPU VM runs on, in "
             "the zone above: its name, or projects/OWNER/reservations/NAME for one another project shares with "
             "this one. Empty for the other capacity types.", CLOUD, title="TPU reservation",
             nullable=True, pattern=RESERVATION, what="a reservation name or projects/OWNER/reservations/NAME"),
    Declared("network", "string", "default", "The VPC network the VM joins; 'default' is the project's default network.",
             CLOUD, title="VPC network", pattern=GCE_NAME, what="a network name"),
    Declared("subnetwork", "string", None,
             "The subnetwork the VM joins, in the zone's region. Required on a custom-mode network (most company "
             "VPCs, and every Shared VPC); empty on an auto-mode network such as 'default'.", CLOUD,
             title="VPC subnetwork", nullable=True, pattern=GCE_NAME, what="a subnetwork name"),
    Declared("network_project", "string", None,
             "The project that owns the network and subnetwork: a Shared VPC's host project. Empty: the project "
             "the VM runs in.", CLOUD, title="Network host project",
             nullable=True, pattern=PROJECT_ID, what="a Google Cloud project id"),
    Declared("network_tag", "string", "maxtext-sft",
             "A tag put on every VM of this pipeline, so that firewall rules (the one that lets SSH in) can "
             "name them.", CLOUD, title="Network tag", pattern=GCE_NAME, what="a network tag"),
    Declared("service_account", "string", "default",
             "The service account the VM runs as, by its email; it writes to the Output location. 'default': "
             "the project's Compute Engine default service account.", CLOUD, title="VM service account",
             pattern=EMAIL, what="'default' or a service account email"),
    # TPU VM
    Declared("vm_name_prefix", "string", "maxtext-sft",
             "The start of the VM's name; the run adds a short hash of its id and a generation number.", VM,
             title="VM name prefix", pattern=GCE_NAME, what="a GCE name prefix", max_length=40),  # the run suffix takes the rest
    Declared("machine_type", "string", "ct6e-standard-8t",
             "The TPU machine the reservation holds, e.g. ct6e-standard-8t (a v6e-8).", VM, title="TPU machine type",
             pattern=GCE_NAME, choices=sorted(TPU_TOPOLOGIES), what="a TPU machine type the pipeline knows"),
    Declared("image_project", "string", "ubuntu-os-accelerator-images",
             "The project that publishes the VM's boot image.", VM, title="Boot image project",
             pattern=PROJECT_ID, what="an image project"),
    Declared("image_family", "string", "ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e",
             "The VM boots the newest image of this family; a family of baked images (MaxText already "
             "installed) skips the install.", VM, title="Boot image family", pattern=GCE_NAME, what="an image family"),
    Declared("boot_disk_size_gb", "integer", 200, "Size of the VM's boot disk, in GB.", VM,
             title="Boot disk size (GB)", minimum=10, maximum=65536),
    Declared("vm_hourly_price_usd", "number", 20.0,
             "What the VM costs per hour on a reservation, in US dollars; the run summary's estimated cost is "
             "the VM's billed hours times the price of the run's TPU capacity. Default: roughly a v6e-8 on a "
             "reservation. It changes nothing else.", VM, title="VM price per hour on a reservation (USD)", minimum=0),
    # No defaults: no price for a v6e machine per capacity type was found in a public source this
    # project could cite (Compute Engine's Spot VM pricing page gives only the discount's range).
    *(
        Declared(f"{name}_hourly_price_usd", "number", None,
                 f"What the VM costs per hour {how}, in US dollars (Cloud TPU pricing for your region{more}). "
                 "Empty: unknown, and the summary shows no cost for it.", VM, title=f"VM price per hour {how} (USD)",
                 nullable=True, minimum=0)
        for name, how, more in (
            ("on_demand", "on demand", ""),
            ("spot", "as Spot", "; Spot prices are 60-91% below on-demand, Compute Engine's Spot VM pricing page"),
            ("flex_start", "with flex-start", ""),
        )
    ),
    Declared("use_internal_ip", "boolean", False,
             "Connect to the VM's internal IP (Airflow's workers run inside the VPC network). The VM then gets "
             "no external IP: reaching PyPI and the Hugging Face Hub needs Cloud NAT.", VM,
             title="Connect by internal IP"),
    Declared("os_login", "boolean", False,
             "Log in to the VM with OS Login, as the Google Cloud connection's account (its key imported for "
             "the OS Login key lifetime, renewed while the run logs in), instead of a key in the VM's metadata. "
             "Needs the Compute OS Admin Login role.", VM,
             title="Log in with OS Login"),
    Declared("os_login_key_lifetime_seconds", "integer", 3600,
             "With OS Login: seconds the imported key stays valid. It is renewed while a wait still logs in "
             "(when half of it has passed), so a leaked key stops working soon after the run.", VM,
             title="OS Login key lifetime (s)", minimum=20, maximum=24 * 3600),
    Declared("ssh_via_iap", "boolean", False,
             "Reach the VM through an Identity-Aware Proxy tunnel, as the Google connection's account (the "
             "firewall lets SSH in from 35.235.240.0/20 only). The account needs the IAP-secured Tunnel User "
             "role. The VM gets no external IP: its internet access needs Cloud NAT.", VM, title="SSH through IAP"),
    # Model and data
    Declared("model_name", "string", "gemma3-4b",
             "The model to fine-tune, by its MaxText name, e.g. gemma3-4b; its weights come from the Hugging "
             "Face Hub.", MODEL, title="Base model",
             pattern=SAFE_TOKEN, choices=sorted(BASE_MODELS),
             what="a model MaxText 0.2.2 converts from Hugging Face"),
    Declared("model_revision", "string", None,
             "The branch, tag or commit of the base model on the Hugging Face Hub. Empty: its default branch.",
             MODEL, title="Base model revision",
             nullable=True, pattern=SAFE_TOKEN, what="a branch, tag or commit id"),
    Declared("base_model_id", "string", None,
             "The base model's Hugging Face id (owner/name) that the tuned model's card names. Empty: the "
             "model MaxText downloads.", MODEL, title="Base model id for the model card",
             nullable=True, pattern=HUB_ID, what="a Hugging Face model id (owner/name)"),
    Declared("dataset_name", "string", "HuggingFaceH4/ultrachat_200k",
             "A Hugging Face dataset id (owner/name), a folder on the VM, or gs://bucket/folder, each holding "
             "data/<split>-*.parquet files. A gs:// folder may name the run's date as {{ ds }} or "
             "{{ ds_nodash }}.", MODEL, title="Training dataset", pattern=DATASET_PARAM,
             what="a Hugging Face dataset id (owner/name), an absolute folder on the VM, or gs://bucket/folder"),
    Declared("dataset_revision", "string", None,
             "The branch, tag or commit of a Hugging Face dataset. Empty: the commit current at the end of "
             "the run's data interval.", MODEL, title="Dataset revision",
             nullable=True, pattern=SAFE_TOKEN, what="a branch, tag or commit id"),
    Declared("train_split", "string", "train_sft", "The dataset split to train on, e.g. train_sft.", MODEL,
             title="Training split", pattern=SAFE_TOKEN, what="a split name"),
    Declared("train_data_columns", "array", ["messages"],
             "The dataset columns the training reads, one per line (a chat dataset: messages).", MODEL,
             title="Data columns", pattern=SAFE_TOKEN, what="a column name", min_items=1),
    # Held-out evaluation: MaxText's own eval loop (eval_interval = steps) measures the base model
    # before the first step and the tuned model after the last, on the same batches.
    Declared("eval_split", "string", "test_sft",
             "The held-out split the base model and the tuned model are evaluated on, e.g. test_sft. "
             "Empty: no evaluation, and publishing is not gated on it.", MODEL,
             title="Evaluation split", nullable=True, pattern=SAFE_TOKEN, what="a split name"),
    Declared("eval_steps", "integer", 25,
             "How many batches of the evaluation split each evaluation reads (each as large as a training "
             "batch).", MODEL, title="Evaluation batches", minimum=1, maximum=100_000),
    Declared("steps", "integer", 1000, "How many steps to train.", MODEL, title="Training steps",
             minimum=1, maximum=10_000_000),
    Declared("per_device_batch_size", "integer", 1,
             "Examples each TPU chip takes per step; a step's batch is this times the number of chips.", MODEL,
             title="Batch size per chip", minimum=1, maximum=4096),
    # MaxText
    Declared("maxtext_version", "string", "0.2.2", "The MaxText version installed on the VM, e.g. 0.2.2.", MAXTEXT,
             title="MaxText version", pattern=MAXTEXT_VERSION, what="a MaxText version such as 0.2.2"),
    Declared("work_dir", "string", "~",
             "The folder on the VM for MaxText's Python environment and the training logs; ~ is the login "
             "user's home.", MAXTEXT, title="Working folder on the VM",
             pattern=VM_PATH, what="an absolute path or one under ~ on the VM"),
    Declared("use_pathways", "boolean", False, "Run MaxText on Pathways; off: McJAX, as the tutorial does.", MAXTEXT,
             title="Use Pathways"),
    Declared("lazy_load_tensors", "boolean", False,
             "Load the base checkpoint's tensors one at a time while converting it (less memory, slower).",
             MAXTEXT, title="Load tensors lazily when converting"),
    *(
        Declared(f"{step}_extra_args", "array", [],
                 f"More arguments for MaxText's {what}, one per line: key=value or --flag=value.",
                 MAXTEXT, title=title, pattern=EXTRA_ARG, what="'key=value' or '--flag=value'",
                 max_length=MAX_EXTRA_ARG_CHARS)
        for step, title, what in (
            ("convert", "Extra conversion arguments", "conversion of the base checkpoint (to_maxtext)"),
            ("train", "Extra training arguments", "training (train_sft)"),
            ("export", "Extra export arguments", "export to Hugging Face format (to_huggingface)"),
        )
    ),
    # Outputs and publishing
    Declared("output_location", "string", None,
             "A gs://bucket/prefix for the checkpoints, the converted base checkpoint and the exported model. "
             "Empty: they stay in the VM's memory (/dev/shm) and go with it; only the export is copied to "
             "the Airflow worker.", OUTPUTS, title="Output location",
             nullable=True, pattern=GCS_URI, what="a gs://bucket/prefix location"),
    Declared("hub_repo_id", "string", None,
             "The Hugging Face repo (owner/name) the tuned model is published to. Empty: not published.",
             OUTPUTS, title="Publish to Hub repo", nullable=True, pattern=HUB_ID, what="a Hugging Face repo id (owner/name)"),
    Declared("hub_private", "boolean", True, "Create the Hub repo as private.", OUTPUTS, title="Private Hub repo"),
    Declared("hub_branch", "string", "main", "The branch of the Hub repo the model is committed to.", OUTPUTS,
             title="Hub branch", pattern=GIT_BRANCH, what="a branch name"),
    Declared("hub_max_final_loss", "number", None,
             "Publish only if the training's final loss is at most this. Empty: whatever the loss.", OUTPUTS,
             title="Publish only at loss at most", nullable=True),
    Declared("hub_min_eval_improvement", "number", 0.0,
             "Publish only if the tuned model's evaluation loss is at least this much below that of the model "
             "last published to the same repo and branch (on the same evaluation split). It must always be "
             "below the base model's.", OUTPUTS, title="Publish only if better than the last by",
             minimum=0.0, maximum=100.0),
    # Timeouts, polling and recovery
    Declared("ssh_connect_timeout_seconds", "integer", 30,
             "Seconds an SSH connection may take to connect and log in.", TIMING,
             title="SSH connect timeout (s)", minimum=1, maximum=600),
    Declared("ssh_ready_timeout_seconds", "integer", 600,
             "Seconds a new VM may take to accept the SSH login; then the run fails, naming why (a firewall, "
             "the guest agent).", TIMING, title="Wait for SSH (s)", minimum=10, maximum=3600),
    _timeout("install_timeout_minutes", "Install time limit (min)", "Minutes the MaxText install may take.",
             60, 24 * 60),
    _timeout("convert_timeout_minutes", "Conversion time limit (min)",
             "Minutes the conversion of the base checkpoint may take.", 60, 24 * 60),
    _timeout("export_timeout_minutes", "Export time limit (min)",
             "Minutes the export of the tuned model to Hugging Face format may take.", 60, 24 * 60),
    _timeout("training_timeout_hours", "Training time limit (h)", "Hours the training may take.", 12, 24 * 14),
    Declared("poke_interval_seconds", "integer", 60, "Seconds between two checks of the training.", TIMING,
             title="Check the training every (s)", minimum=1, maximum=3600),
    Declared("stall_timeout_seconds", "integer", 3600,
             "Fail the run when no training step completes for this many seconds.", TIMING,
             title="Stalled training after (s)", minimum=10, maximum=7 * 24 * 3600),
    Declared("unreachable_timeout_seconds", "integer", 600,
             "A training VM that answers no SSH for this many seconds is lost: it is recreated and resumes "
             "(with an Output location), else the run fails and the VM is deleted.", TIMING,
             title="Lost VM after (s)", minimum=10, maximum=24 * 3600),
    Declared("autostop_idle_minutes", "number", 30,
             "Minutes with no training process, no step running and no check from Airflow after which the VM "
             "shuts itself down (stopped: no TPU billed), so a dead Airflow costs minutes, not the VM's "
             "lifetime. Keep it well above the training check interval and the gaps between tasks.", TIMING,
             title="VM stops itself when idle for (min)", minimum=0.5, maximum=24 * 60),
    Declared("checkpoint_period", "integer", None,
             "Save a checkpoint every this many steps (and at the last): what a recreated VM resumes from. "
             "Empty: with an Output location every tenth of the steps, at least every 1000; without one "
             "MaxText's 10000 (checkpoints on the VM go with it: the first and last step only).", MAXTEXT,
             title="Checkpoint every (steps)", nullable=True, minimum=1, maximum=10_000_000),
    Declared("checkpoints_kept", "integer", 2,
             "With an Output location: how many of the newest training checkpoints stay in storage; older "
             "ones are deleted as newer ones are saved (the final step's is the newest). Empty: keep all.",
             MAXTEXT, title="Checkpoints kept", nullable=True, minimum=1, maximum=1000),
    Declared("max_vm_recoveries", "integer", 2,
             "How many times a VM lost mid-training is recreated to resume from the latest checkpoint in the "
             "Output location. 0: never; the run fails.", TIMING, title="VM recoveries at most",
             minimum=0, maximum=10),
    Declared("max_preemptions", "integer", 10,
             "With TPU capacity 'spot': how many times the VM may be preempted (each time the training resumes "
             "on a new VM from its last checkpoint) before the run fails. Preemptions do not count as lost VMs.",
             TIMING, title="Spot preemptions at most", minimum=0, maximum=100),
    Declared("flex_start_valid_minutes", "integer", 120,
             "With TPU capacity 'flex-start': how long the request waits in Compute Engine's queue for a machine "
             "(its requestValidForDuration), holding no worker slot; then the run fails and nothing is left.",
             TIMING, title="Flex-start request valid for (min)", minimum=2, maximum=120),
    Declared("max_capacity_wait_minutes", "integer", 720,
             "Minutes the run waits, holding no worker slot, for a free machine in the reservation (which "
             "every run using it shares); then it fails. 0: fail at once when the reservation is full.",
             TIMING, title="Wait for reserved capacity (min)", minimum=0, maximum=7 * 24 * 60),
    Declared("max_run_duration_minutes", "integer", None,
             "Minutes the VM may live (its expiry label; Compute Engine's limit if the cloud enforces it). "
             "Empty: every step's time limit added up, plus 30 minutes.", TIMING, title="VM lifetime (min)",
             nullable=True, minimum=1, maximum=MAX_RUN_DURATION_LIMITS_SECONDS[1] // 60),
    Declared("cloud_enforced_lifetime", "boolean", True,
             "Let Compute Engine delete the VM at the end of its lifetime, even when Airflow is down.", TIMING,
             title="Cloud deletes the VM at its lifetime"),
)

# The rehearsal DAG's own Params (fine_tune_dag(rehearsal=True)): the VM it runs on instead of the
# TPU VM. machine_type, reservation and image_* stay the real run's: the rehearsal reads the
# reservation (exists, matches machine_type) but does not consume it.
REHEARSAL_PARAMS: tuple[Declared, ...] = (
    Declared("rehearsal_machine_type", "string", "e2-standard-8",
             "The cheap on-demand CPU machine the rehearsal runs on instead of the TPU machine (it uses no "
             "reservation).", REHEARSAL, title="Rehearsal machine type", pattern=GCE_NAME, what="a machine type"),
    Declared("rehearsal_image_project", "string", "ubuntu-os-cloud",
             "The project of the rehearsal VM's public CPU boot image.", REHEARSAL,
             title="Rehearsal boot image project", pattern=PROJECT_ID, what="an image project"),
    Declared("rehearsal_image_family", "string", "ubuntu-2204-lts",
             "The image family of the rehearsal VM's boot disk (Ubuntu 22.04, as the TPU image).", REHEARSAL,
             title="Rehearsal boot image family", pattern=GCE_NAME, what="an image family"),
)
# What the rehearsal DAG's form starts from, where it differs from the real run's: a few toy steps;
# the cheap machine's price for its cost line (e2-standard-8 on demand is roughly $0.27 an hour in
# US regions: Compute Engine's VM instance pricing, E2 standard machine types); and a branch of its
# own, so that publishing the toy proves write access without a commit on the repo's main.
REHEARSAL_DEFAULTS: dict[str, Any] = {"steps": 3, "vm_hourly_price_usd": 0.27, "hub_branch": "rehearsal"}


# The slice DAG's own Param (fine_tune_dag(tpu_slice=True)): the multi-host slice it trains on,
# one of the shapes Compute Engine documents (catalog.TPU_SLICES). Its hosts' machine type is the
# slice's: the DAG's machine_type default is that type, and plan_run refuses another.
SLICE_PARAMS: tuple[Declared, ...] = (
    Declared("tpu_slice", "string", "v6e-16",
             "The multi-host TPU slice to train on: its hosts (4 chips each) form one slice linked by ICI, "
             "e.g. v6e-16 is 4 hosts of ct6e-standard-4t with topology 4x4. The reservation must hold that "
             "many ct6e-standard-4t machines, and the Output location is required (checkpoints cannot live "
             "on one host's memory).", VM, title="TPU slice", choices=sorted(TPU_SLICES, key=lambda s: int(s[4:])),
             pattern=re.compile(r"^v6e-\d+$"), what="a multi-host v6e slice"),
)
# A host has half a v6e-8's chips: roughly half its price (the summary multiplies by the hosts).
SLICE_DEFAULTS: dict[str, Any] = {"machine_type": "ct6e-standard-4t", "vm_hourly_price_usd": 10.0}


def all_params(rehearsal: bool = False, tpu_slice: bool = False) -> tuple[Declared, ...]:
    """The Params of the fine-tune DAG, of its rehearsal, or of its multi-host slice DAG."""
    return PARAMS + (REHEARSAL_PARAMS if rehearsal else ()) + (SLICE_PARAMS if tpu_slice else ())


def declared(table: Iterable[Declared] | None = None) -> dict[str, Declared]:
    """The Params of `table` (the pipeline's, read now) by name."""
    return {param.name: param for param in (PARAMS if table is None else table)}


def defaults(table: Iterable[Declared] | None = None) -> dict[str, Any]:
    return {name: param.default for name, param in declared(table).items()}


def did_you_mean(value: str, known: Iterable[str], what: str, n: int = 1) -> str:
    """The end of a refusal of `value`: the closest of `known`, or all of them as `what`."""
    known = sorted(known)
    close = difflib.get_close_matches(value, known, n=n)
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else f" ({what}: {', '.join(known)})"


def refuse_unknown_keys(values: Mapping[str, Any], params: Collection[str], what: str = "run conf key") -> None:
    """Refuse a key that is no Param: Airflow passes a run conf's on unchecked, so a typo (`step`
    for `steps`) would be ignored and the run paid for with the default."""
    unknown = sorted(set(values) - set(params))
    if unknown:
        others = f" (also unknown: {', '.join(map(repr, unknown[1:]))})" if unknown[1:] else ""
        hint = did_you_mean(unknown[0], params, "the Params")
        raise SpecError(f"{what} {unknown[0]!r} is not a Param of this DAG{hint}{others}")


def _string(param: Declared, value: Any, name: str) -> str:
    limit = param.max_length or MAX_STRING_CHARS
    if isinstance(value, str) and len(value) > limit:
        raise SpecError(f"Param {name!r}: {len(value)} characters, at most {limit}: {value[:40]!r}...", param.name)
    if not isinstance(value, str) or (param.pattern is not None and not param.pattern.fullmatch(value)):
        raise SpecError(f"Param {name!r}: {value!r} is not {param.what}", param.name)
    if param.choices is not None and value not in param.choices:
        hint = did_you_mean(value, param.choices, "known", n=3)
        raise SpecError(f"Param {name!r}: {value!r} is not {param.what}{hint}", param.name)
    return value


def check_value(param: Declared, value: Any) -> Any:
    """`value` as the Param's type (an array a tuple, a number a float), or SpecError naming it."""
    name = param.name
    if value is None and param.nullable:
        return None
    if param.type == "boolean":
        if not isinstance(value, bool):
            raise SpecError(f"Param {name!r}: {value!r} is not true or false", name)
        return value
    if param.type == "string":
        return _string(param, value, name)
    if param.type == "array":
        if not isinstance(value, (list, tuple)) or len(value) < (param.min_items or 0):
            at_least = f" of at least {param.min_items} item(s)" if param.min_items else ""
            raise SpecError(f"Param {name!r}: {value!r} is not a list{at_least}, each {param.what}", name)
        return tuple(_string(param, item, name) for item in value)
    # integer or number; bool is an int to Python, and NaN or infinity would make no sense here
    kind = "an integer" if param.type == "integer" else "a number"
    if (
        isinstance(value, bool)
        or not isinstance(value, int if param.type == "integer" else (int, float))
        or not math.isfinite(value)
    ):
        raise SpecError(f"Param {name!r}: {value!r} is not {kind}", name)
    low = -math.inf if param.minimum is None else param.minimum
    high = math.inf if param.maximum is None else param.maximum
    if not low <= value <= high:
        raise SpecError(f"Param {name!r}: {value!r} is not {kind} in [{low}, {high}]", name)
    return value if param.type == "integer" else float(value)


def check_params(values: Mapping[str, Any], table: Iterable[Declared] | None = None) -> dict[str, Any]:
    """Every Param of `table` (the pipeline's by default): its value in `values` or its default,
    checked and typed. A key that is no Param is refused, naming the closest."""
    params = declared(table)
    refuse_unknown_keys(values, params, what="key")
    return {name: check_value(param, values.get(name, param.default)) for name, param in params.items()}


def whole_value(pattern: str) -> str:
    """`pattern` (anchored with ^ and $) that matches only a whole string. Airflow validates with
    Python's re.search, whose `$` also matches before a final newline, so "team/model\\n" would
    pass `^...$`; `(?![\\s\\S])` is the end of the string in Python and in the browser's
    ECMAScript alike."""
    return f"(?:{pattern})(?![\\s\\S])"


def form_schema(param: Declared) -> dict[str, Any]:
    """The Param's JSON schema for Airflow's trigger form and its validation (draft 7)."""
    def string_schema() -> dict[str, Any]:
        schema: dict[str, Any] = {"maxLength": param.max_length or MAX_STRING_CHARS}
        if param.pattern is not None:
            schema["pattern"] = whole_value(param.pattern.pattern)
        if param.choices is not None:
            schema["enum"] = list(param.choices)
        return schema

    # Airflow's form marks a field required, and disables Trigger while it is empty, when its type
    # does not allow null; Airflow then also refuses a run whose conf leaves it empty.
    schema: dict[str, Any] = {"$schema": SCHEMA_DRAFT, "type": ["null", param.type] if param.nullable else param.type}
    if param.type == "string":
        schema.update(string_schema())
    elif param.type == "array":
        schema["items"] = {"type": "string", **string_schema()}
        if param.min_items:
            schema["minItems"] = param.min_items
    elif param.type in ("integer", "number"):
        schema.update({k: v for k, v in (("minimum", param.minimum), ("maximum", param.maximum)) if v is not None})
    return schema
