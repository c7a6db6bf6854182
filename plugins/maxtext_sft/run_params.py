"""What a user may ask of a fine-tune: every Param declared once, in `PARAMS`.

One row per Param: name, type, default (the tutorial's value), limits (pattern, bounds, choices,
length), help text and trigger-form section. From this table come the trigger form's JSON schema
(`form_schema`; params.py makes Airflow Params of it), the check of every value a run is given,
whether from the form, a run conf or a declared-job file (`check_params`), and the typed values
the run's spec answers by name (spec.py). Adding a Param is one row here plus the code that uses
it. No Airflow imports.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any, Literal

from maxtext_sft.catalog import BASE_MODELS, TPU_TOPOLOGIES

# Patterns each string must match whole (checked with fullmatch; the form's schema gets an end
# anchor that Python's re.search honours too, see `whole_value`).
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
    description: str
    section: str
    nullable: bool = False  # None is a value (its meaning in the description)
    required_because: str | None = None  # None is refused, saying why (the form still opens empty)
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


def _timeout(name: str, what: str, default: int, high: int, **more: Any) -> Declared:
    return Declared(name, "integer", default, what, TIMING, minimum=1, maximum=high, **more)


PARAMS: tuple[Declared, ...] = (
    # Google Cloud
    Declared("project_id", "string", None, "Project of the VM; empty: the Google connection's project.", CLOUD,
             nullable=True, pattern=PROJECT_ID, what="a Google Cloud project id"),
    Declared("zone", "string", "us-east5-b", "Zone of the VM and the reservation (tutorial: ZONE).", CLOUD,
             pattern=GCE_ZONE, what="a zone such as us-east5-b"),
    Declared("reservation", "string", None, "Capacity reservation the VM is bound to (required).", CLOUD,
             required_because="the VM is RESERVATION_BOUND", pattern=GCE_NAME, what="a reservation name"),
    Declared("network", "string", "default", "VPC network (tutorial: NETWORK=default).", CLOUD,
             pattern=GCE_NAME, what="a network name"),
    Declared("network_tag", "string", "maxtext-sft", "Network tag on every VM of this pipeline, for firewall rules.",
             CLOUD, pattern=GCE_NAME, what="a network tag"),
    Declared("service_account", "string", "default", "Service account of the VM ('default': the project's).", CLOUD,
             pattern=EMAIL, what="'default' or a service account email"),
    # TPU VM
    Declared("vm_name_prefix", "string", "maxtext-sft", "VM names are PREFIX-<run hash>-g<generation>.", VM,
             pattern=GCE_NAME, what="a GCE name prefix", max_length=40),  # the run suffix takes the rest
    Declared("machine_type", "string", "ct6e-standard-8t", "TPU machine type (v6e-8: ct6e-standard-8t).", VM,
             pattern=GCE_NAME, choices=sorted(TPU_TOPOLOGIES), what="a TPU machine type the pipeline knows"),
    Declared("image_project", "string", "ubuntu-os-accelerator-images", "Project of the boot image.", VM,
             pattern=PROJECT_ID, what="an image project"),
    Declared("image_family", "string", "ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e", "Image family of the boot disk.", VM,
             pattern=GCE_NAME, what="an image family"),
    Declared("boot_disk_size_gb", "integer", 200, "Boot disk size in GB.", VM, minimum=10, maximum=65536),
    Declared("vm_hourly_price_usd", "number", 20.0,
             "What the VM costs per hour in USD (default: a v6e-8 on a reservation, roughly); the run "
             "summary's estimated cost is the VM's hours times this. Informational only.", VM, minimum=0),
    Declared("use_internal_ip", "boolean", False,
             "SSH to the VM's internal IP (workers inside the VPC); the VM then gets no external IP "
             "(its egress to PyPI and the Hub needs Cloud NAT).", VM),
    Declared("os_login", "boolean", False,
             "Log in with OS Login as the Google connection's account (its key imported for an hour) "
             "instead of the ssh-keys metadata; needs roles/compute.osAdminLogin.", VM),
    Declared("ssh_via_iap", "boolean", False,
             "SSH through an Identity-Aware Proxy TCP tunnel (gcloud on the workers; firewall open to "
             "35.235.240.0/20 only); needs roles/iap.tunnelResourceAccessor. The VM gets no external IP "
             "(its egress needs Cloud NAT).", VM),
    # Model and data
    Declared("model_name", "string", "gemma3-4b", "MaxText model name (MODEL_NAME).", MODEL,
             pattern=SAFE_TOKEN, choices=sorted(BASE_MODELS),
             what="a model MaxText 0.2.2 converts from Hugging Face"),
    Declared("model_revision", "string", None,
             "Hugging Face revision of the base checkpoint; empty: default branch.", MODEL,
             nullable=True, pattern=SAFE_TOKEN, what="a branch, tag or commit id"),
    Declared("base_model_id", "string", None, "Hub id of the base model for the model card; empty: MaxText's.",
             MODEL, nullable=True, pattern=HUB_ID, what="a Hugging Face model id (owner/name)"),
    Declared("dataset_name", "string", "HuggingFaceH4/ultrachat_200k",
             "Hugging Face dataset id (DATASET_NAME), a folder on the VM, or gs://bucket/folder "
             "(may hold {{ ds }} or {{ ds_nodash }}: the run's logical date), each in the "
             "data/<split>-*.parquet layout.", MODEL, pattern=DATASET_PARAM,
             what="a Hugging Face dataset id (owner/name), an absolute folder on the VM, or gs://bucket/folder"),
    Declared("dataset_revision", "string", None, "Dataset branch, tag or commit; empty: latest.", MODEL,
             nullable=True, pattern=SAFE_TOKEN, what="a branch, tag or commit id"),
    Declared("train_split", "string", "train_sft", "Dataset split to train on (TRAIN_SPLIT).", MODEL,
             pattern=SAFE_TOKEN, what="a split name"),
    Declared("train_data_columns", "array", ["messages"], "Dataset columns (TRAIN_DATA_COLUMNS).", MODEL,
             pattern=SAFE_TOKEN, what="a column name", min_items=1),
    # Held-out evaluation: MaxText's own eval loop (eval_interval = steps) measures the base model
    # before the first step and the tuned model after the last, on the same batches.
    Declared("eval_split", "string", "test_sft",
             "Held-out split the base and the tuned model are evaluated on (UltraChat 200k: test_sft); "
             "empty: no evaluation, and publishing is not gated on it.", MODEL,
             nullable=True, pattern=SAFE_TOKEN, what="a split name"),
    Declared("eval_steps", "integer", 25,
             "Batches of the held-out split each evaluation reads (each one as large as a training batch).",
             MODEL, minimum=1, maximum=100_000),
    Declared("steps", "integer", 1000, "Training steps (STEPS).", MODEL, minimum=1, maximum=10_000_000),
    Declared("per_device_batch_size", "integer", 1, "Per-device batch size (PER_DEVICE_BATCH_SIZE).", MODEL,
             minimum=1, maximum=4096),
    # MaxText
    Declared("maxtext_version", "string", "0.2.2", "maxtext[tpu-post-train] version.", MAXTEXT,
             pattern=MAXTEXT_VERSION, what="a MaxText version such as 0.2.2"),
    Declared("work_dir", "string", "~", "Folder on the VM for the venv and training logs (~ is the home).", MAXTEXT,
             pattern=VM_PATH, what="an absolute path or one under ~ on the VM"),
    Declared("use_pathways", "boolean", False, "Pathways (USE_PATHWAYS=1) or McJAX (0).", MAXTEXT),
    Declared("lazy_load_tensors", "boolean", False, "Lazy tensor loading during conversion.", MAXTEXT),
    *(
        Declared(f"{step}_extra_args", "array", [], f"Extra {command} arguments: key=value or --flag=value.",
                 MAXTEXT, pattern=EXTRA_ARG, what="'key=value' or '--flag=value'", max_length=MAX_EXTRA_ARG_CHARS)
        for step, command in (("convert", "to_maxtext"), ("train", "train_sft"), ("export", "to_huggingface"))
    ),
    # Outputs and publishing
    Declared("output_location", "string", None,
             "gs://bucket/prefix for checkpoints, converted base checkpoints and the export; empty: the "
             "tutorial's /dev/shm, deleted with the VM (only the export is copied to the worker).", OUTPUTS,
             nullable=True, pattern=GCS_URI, what="a gs://bucket/prefix location"),
    Declared("hub_repo_id", "string", None, "Publish the tuned model to this Hub repo (owner/name); empty: do not.",
             OUTPUTS, nullable=True, pattern=HUB_ID, what="a Hugging Face repo id (owner/name)"),
    Declared("hub_private", "boolean", True, "Create the Hub repo as private.", OUTPUTS),
    Declared("hub_branch", "string", "main", "Hub branch to commit to.", OUTPUTS, pattern=GIT_BRANCH,
             what="a branch name"),
    Declared("hub_max_final_loss", "number", None, "Publish only if the final loss is at most this.", OUTPUTS,
             nullable=True),
    Declared("hub_min_eval_improvement", "number", 0.0,
             "Publish only if the tuned model's eval loss is at least this much below the eval loss of the "
             "model last published to the same repo and branch (on the same eval split); it must always beat "
             "the base model's.", OUTPUTS, minimum=0.0, maximum=100.0),
    # Timeouts, polling and recovery
    Declared("ssh_connect_timeout_seconds", "integer", 30, "SSH connect/banner/auth timeout.", TIMING,
             minimum=1, maximum=600),
    Declared("ssh_ready_timeout_seconds", "integer", 600,
             "How long a new VM may take to accept the SSH login; then the run fails naming why (a "
             "firewall, the guest agent).", TIMING, minimum=10, maximum=3600),
    _timeout("install_timeout_minutes", "Limit for the install step.", 60, 24 * 60),
    _timeout("convert_timeout_minutes", "Limit for the conversion step.", 60, 24 * 60),
    _timeout("export_timeout_minutes", "Limit for the export step.", 60, 24 * 60),
    _timeout("training_timeout_hours", "Limit for waiting on training.", 12, 24 * 14),
    Declared("poke_interval_seconds", "integer", 60, "How often the training is checked.", TIMING,
             minimum=1, maximum=3600),
    Declared("stall_timeout_seconds", "integer", 3600,
             "Fail the run when no training step completes for this long.", TIMING, minimum=10, maximum=7 * 24 * 3600),
    Declared("unreachable_timeout_seconds", "integer", 600,
             "A training VM that answers no SSH for this long is lost: recreated and resumed "
             "(with output_location), else the run fails and the VM is deleted.", TIMING,
             minimum=10, maximum=24 * 3600),
    Declared("autostop_idle_minutes", "number", 30,
             "The VM shuts itself down (stopped: no TPU billed) after this long with no training "
             "process, no step running and no check from the pipeline: a dead Airflow costs minutes "
             "after the training ends, not the VM's whole lifetime. Keep it well above the poke "
             "interval and the gaps between tasks.", TIMING, minimum=0.5, maximum=24 * 60),
    Declared("checkpoint_period", "integer", None,
             "Save a checkpoint every this many steps (and the last): what a recreated VM resumes from. "
             "Empty: with output_location every tenth of the steps, at least every 1000; without it "
             "MaxText's 10000 (checkpoints on the VM die with it: step 1 and the last only).", MAXTEXT,
             nullable=True, minimum=1, maximum=10_000_000),
    Declared("checkpoints_kept", "integer", 2,
             "With output_location: the newest committed training checkpoints kept in storage; older "
             "ones are deleted as newer ones commit (the final step is the newest). Empty: keep all.",
             MAXTEXT, nullable=True, minimum=1, maximum=1000),
    Declared("max_vm_recoveries", "integer", 2,
             "How often a VM lost mid-training is recreated to resume from the latest checkpoint in "
             "output_location (0: never; the run fails).", TIMING, minimum=0, maximum=10),
    Declared("max_capacity_wait_minutes", "integer", 720,
             "How long create_vm waits, deferred (no worker slot), for a free machine in the reservation, "
             "which every run and VM using it shares; then the run fails. 0: fail at once when it is full.",
             TIMING, minimum=0, maximum=7 * 24 * 60),
    Declared("max_run_duration_minutes", "integer", None,
             "The VM's lifetime (its expiry label; Compute Engine's maxRunDuration if enforced); "
             "empty: every step's time limit added up, plus 30 minutes.", TIMING,
             nullable=True, minimum=1, maximum=MAX_RUN_DURATION_LIMITS_SECONDS[1] // 60),
    Declared("cloud_enforced_lifetime", "boolean", True,
             "Let Compute Engine delete the VM at the end of its lifetime, even if Airflow is down.", TIMING),
)

# The rehearsal DAG's own Params (fine_tune_dag(rehearsal=True)): the VM it runs on instead of the
# TPU VM. machine_type, reservation and image_* stay the real run's: the rehearsal reads the
# reservation (exists, matches machine_type) but does not consume it.
REHEARSAL_PARAMS: tuple[Declared, ...] = (
    Declared("rehearsal_machine_type", "string", "e2-standard-8",
             "The cheap on-demand CPU machine the rehearsal runs on (no reservation), instead of machine_type.",
             REHEARSAL, pattern=GCE_NAME, what="a machine type"),
    Declared("rehearsal_image_project", "string", "ubuntu-os-cloud",
             "Project of the rehearsal's public boot image (a CPU image, instead of image_project).",
             REHEARSAL, pattern=PROJECT_ID, what="an image project"),
    Declared("rehearsal_image_family", "string", "ubuntu-2204-lts",
             "Image family of the rehearsal's boot disk (Ubuntu 22.04, as the TPU image).",
             REHEARSAL, pattern=GCE_NAME, what="an image family"),
)
# What the rehearsal DAG's form starts from, where it differs from the real run's: a few toy steps;
# the cheap machine's price for its cost line (e2-standard-8 on demand is roughly $0.27 an hour in
# US regions: Compute Engine's VM instance pricing, E2 standard machine types); and a branch of its
# own, so that publishing the toy proves write access without a commit on the repo's main.
REHEARSAL_DEFAULTS: dict[str, Any] = {"steps": 3, "vm_hourly_price_usd": 0.27, "hub_branch": "rehearsal"}


def all_params(rehearsal: bool = False) -> tuple[Declared, ...]:
    """The Params of the fine-tune DAG, or of its rehearsal."""
    return PARAMS + REHEARSAL_PARAMS if rehearsal else PARAMS


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
    if value is None:
        if param.required_because:
            raise SpecError(f"Param {name!r}: required ({param.required_because})", name)
        if param.nullable:
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

    empty_allowed = param.nullable or param.required_because  # a required one's form opens empty
    schema: dict[str, Any] = {"$schema": SCHEMA_DRAFT, "type": ["null", param.type] if empty_allowed else param.type}
    if param.type == "string":
        schema.update(string_schema())
    elif param.type == "array":
        schema["items"] = {"type": "string", **string_schema()}
        if param.min_items:
            schema["minItems"] = param.min_items
    elif param.type in ("integer", "number"):
        schema.update({k: v for k, v in (("minimum", param.minimum), ("maximum", param.maximum)) if v is not None})
    return schema
