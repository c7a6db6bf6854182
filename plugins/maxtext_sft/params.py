"""The pipeline DAG's Params: the tutorial's values as defaults, grouped for the trigger form.

The JSON schema here gives the trigger form its types and help; `spec.build_run_spec` is the
check that counts (it also runs on scheduled runs and on conf sent through the API).
"""

from __future__ import annotations

from airflow.sdk import Param
from maxtext_sft import spec
from maxtext_sft.spec import INT_BOUNDS, TPU_TOPOLOGIES, TUTORIAL_DEFAULTS as D

CLOUD = "Google Cloud"
VM = "TPU VM"
MODEL = "Model and data"
MAXTEXT = "MaxText"
OUTPUTS = "Outputs and publishing"
TIMING = "Timeouts, polling and recovery"


# String Params and the spec's pattern each must match (the form shows the mismatch at once).
PATTERNS = {
    "project_id": spec.PROJECT_ID,
    "zone": spec.GCE_ZONE,
    "reservation": spec.GCE_NAME,
    "network": spec.GCE_NAME,
    "network_tag": spec.GCE_NAME,
    "service_account": spec.EMAIL,
    "vm_name_prefix": spec.GCE_NAME,
    "image_project": spec.PROJECT_ID,
    "image_family": spec.GCE_NAME,
    "model_name": spec.SAFE_TOKEN,
    "model_revision": spec.SAFE_TOKEN,
    "base_model_id": spec.HUB_ID,
    "dataset_name": spec.DATASET_PARAM,
    "dataset_revision": spec.SAFE_TOKEN,
    "train_split": spec.SAFE_TOKEN,
    "maxtext_version": spec.MAXTEXT_VERSION,
    "work_dir": spec.VM_PATH,
    "output_location": spec.GCS_URI,
    "hub_repo_id": spec.HUB_ID,
    "hub_branch": spec.GIT_BRANCH,
}


# Airflow validates every Param with jsonschema each time it serializes an operator (the DAG's
# Params are every task's), in the DAG processor, the scheduler and each task: about 3,000
# validations a parse here. jsonschema first checks the schema itself against its draft's
# meta-schema; 2020-12 (the default) is four times as slow to check as draft 7, which has every
# keyword these schemas use (apache/airflow#28059, #32434: Params slowing the DAG processor).
SCHEMA_DRAFT = "http://json-schema.org/draft-07/schema#"


def whole_value(pattern: str) -> str:
    """`pattern` (anchored with ^ and $) that matches only a whole string. Airflow validates with
    Python's re.search, whose `$` also matches before a final newline, so "team/model\\n" would
    pass `^...$`; `(?![\\s\\S])` is the end of the string in Python and in the browser's
    ECMAScript alike."""
    return f"(?:{pattern})(?![\\s\\S])"


# An item of the *_extra_args Params (plan_run checks the rest: key=value, keys the pipeline owns).
EXTRA_ARG_ITEM = {"type": "string", "maxLength": spec.MAX_EXTRA_ARG_CHARS}


def checked_schema(type_, schema: dict) -> dict:
    """A Param's JSON schema as every DAG here declares one: draft 7, a pattern that must match
    the whole value, and a length limit on a string."""
    schema = {"$schema": SCHEMA_DRAFT, **schema}
    if "pattern" in schema:
        schema["pattern"] = whole_value(schema["pattern"])
    if "string" in (type_ if isinstance(type_, list) else [type_]):
        schema.setdefault("maxLength", spec.MAX_STRING_CHARS)
    return schema


def _param(name: str, type_, description: str, section: str, **schema) -> Param:
    if name in PATTERNS:
        schema.setdefault("pattern", PATTERNS[name].pattern)
    if name in INT_BOUNDS:
        schema.setdefault("minimum", INT_BOUNDS[name][0])
        schema.setdefault("maximum", INT_BOUNDS[name][1])
    return Param(D[name], type=type_, description=description, section=section, **checked_schema(type_, schema))


def pipeline_params() -> dict[str, Param]:
    return {
        "project_id": _param(
            "project_id", ["null", "string"], "Project of the VM; empty: the Google connection's project.", CLOUD
        ),
        "zone": _param("zone", "string", "Zone of the VM and the reservation (tutorial: ZONE).", CLOUD),
        "reservation": _param(
            "reservation", ["null", "string"], "Capacity reservation the VM is bound to (required).", CLOUD
        ),
        "network": _param("network", "string", "VPC network (tutorial: NETWORK=default).", CLOUD),
        "network_tag": _param(
            "network_tag", "string", "Network tag on every VM of this pipeline, for firewall rules.", CLOUD
        ),
        "service_account": _param(
            "service_account", "string", "Service account of the VM ('default': the project's).", CLOUD
        ),
        "vm_name_prefix": _param(
            "vm_name_prefix", "string", "VM names are PREFIX-<run hash>-g<generation>.", VM, maxLength=40
        ),
        "machine_type": _param(
            "machine_type", "string", "TPU machine type (v6e-8: ct6e-standard-8t).", VM, enum=sorted(TPU_TOPOLOGIES)
        ),
        "image_project": _param("image_project", "string", "Project of the boot image.", VM),
        "image_family": _param("image_family", "string", "Image family of the boot disk.", VM),
        "boot_disk_size_gb": _param("boot_disk_size_gb", "integer", "Boot disk size in GB.", VM),
        "vm_hourly_price_usd": _param(
            "vm_hourly_price_usd", "number",
            "What the VM costs per hour in USD (default: a v6e-8 on a reservation, roughly); the run "
            "summary's estimated cost is the VM's hours times this. Informational only.", VM, minimum=0,
        ),
        "use_internal_ip": _param(
            "use_internal_ip", "boolean",
            "SSH to the VM's internal IP (workers inside the VPC); the VM then gets no external IP "
            "(its egress to PyPI and the Hub needs Cloud NAT).", VM,
        ),
        "os_login": _param(
            "os_login", "boolean",
            "Log in with OS Login as the Google connection's account (its key imported for an hour) "
            "instead of the ssh-keys metadata; needs roles/compute.osAdminLogin.", VM,
        ),
        "ssh_via_iap": _param(
            "ssh_via_iap", "boolean",
            "SSH through an Identity-Aware Proxy TCP tunnel (gcloud on the workers; firewall open to "
            "35.235.240.0/20 only); needs roles/iap.tunnelResourceAccessor. The VM gets no external IP "
            "(its egress needs Cloud NAT).", VM,
        ),
        "model_name": _param("model_name", "string", "MaxText model name (MODEL_NAME).", MODEL),
        "model_revision": _param(
            "model_revision", ["null", "string"], "Hugging Face revision of the base checkpoint; empty: default branch.", MODEL
        ),
        "base_model_id": _param(
            "base_model_id", ["null", "string"], "Hub id of the base model for the model card; empty: MaxText's.", MODEL
        ),
        "dataset_name": _param(
            "dataset_name", "string", "Hugging Face dataset id (DATASET_NAME), a folder on the VM, or gs://bucket/folder "
            "(may hold {{ ds }} or {{ ds_nodash }}: the run's logical date), each in the data/<split>-*.parquet layout.", MODEL
        ),
        "dataset_revision": _param(
            "dataset_revision", ["null", "string"], "Dataset branch, tag or commit; empty: latest.", MODEL
        ),
        "train_split": _param("train_split", "string", "Dataset split to train on (TRAIN_SPLIT).", MODEL),
        "train_data_columns": _param(
            "train_data_columns",
            "array",
            "Dataset columns (TRAIN_DATA_COLUMNS).",
            MODEL,
            items={"type": "string", "pattern": whole_value(spec.SAFE_TOKEN.pattern)},
            minItems=1,
        ),
        "steps": _param("steps", "integer", "Training steps (STEPS).", MODEL),
        "per_device_batch_size": _param(
            "per_device_batch_size", "integer", "Per-device batch size (PER_DEVICE_BATCH_SIZE).", MODEL,
        ),
        "maxtext_version": _param("maxtext_version", "string", "maxtext[tpu-post-train] version.", MAXTEXT),
        "work_dir": _param(
            "work_dir", "string", "Folder on the VM for the venv and training logs (~ is the home).", MAXTEXT
        ),
        "use_pathways": _param("use_pathways", "boolean", "Pathways (USE_PATHWAYS=1) or McJAX (0).", MAXTEXT),
        "lazy_load_tensors": _param(
            "lazy_load_tensors", "boolean", "Lazy tensor loading during conversion.", MAXTEXT
        ),
        "convert_extra_args": _param(
            "convert_extra_args",
            "array",
            "Extra to_maxtext arguments: key=value or --flag=value.",
            MAXTEXT,
            items=EXTRA_ARG_ITEM,
        ),
        "train_extra_args": _param(
            "train_extra_args", "array", "Extra train_sft arguments: key=value.", MAXTEXT, items=EXTRA_ARG_ITEM
        ),
        "export_extra_args": _param(
            "export_extra_args", "array", "Extra to_huggingface arguments: key=value.", MAXTEXT, items=EXTRA_ARG_ITEM
        ),
        "output_location": _param(
            "output_location",
            ["null", "string"],
            "gs://bucket/prefix for checkpoints, converted base checkpoints and the export; "
            "empty: the tutorial's /dev/shm, deleted with the VM (only the export is copied to the worker).",
            OUTPUTS,
        ),
        "hub_repo_id": _param(
            "hub_repo_id", ["null", "string"], "Publish the tuned model to this Hub repo (owner/name); empty: do not.", OUTPUTS
        ),
        "hub_private": _param("hub_private", "boolean", "Create the Hub repo as private.", OUTPUTS),
        "hub_branch": _param("hub_branch", "string", "Hub branch to commit to.", OUTPUTS),
        "hub_max_final_loss": _param(
            "hub_max_final_loss", ["null", "number"], "Publish only if the final loss is at most this.", OUTPUTS
        ),
        "ssh_connect_timeout_seconds": _param(
            "ssh_connect_timeout_seconds", "integer", "SSH connect/banner/auth timeout.", TIMING,
        ),
        "install_timeout_minutes": _param(
            "install_timeout_minutes", "integer", "Limit for the install step.", TIMING,
        ),
        "convert_timeout_minutes": _param(
            "convert_timeout_minutes", "integer", "Limit for the conversion step.", TIMING,
        ),
        "export_timeout_minutes": _param(
            "export_timeout_minutes", "integer", "Limit for the export step.", TIMING,
        ),
        "training_timeout_hours": _param(
            "training_timeout_hours", "integer", "Limit for waiting on training.", TIMING,
        ),
        "poke_interval_seconds": _param(
            "poke_interval_seconds", "integer", "How often the training is checked.", TIMING,
        ),
        "stall_timeout_seconds": _param(
            "stall_timeout_seconds", "integer", "Fail the run when no training step completes for this long.",
            TIMING,
        ),
        "checkpoint_period": _param(
            "checkpoint_period", "integer",
            "Save a checkpoint every this many steps (and the last); with output_location, what a "
            "recreated VM resumes from. 10000 (MaxText's default): step 1 and the last step only.",
            TIMING,
        ),
        "max_vm_recoveries": _param(
            "max_vm_recoveries", "integer",
            "How often a VM lost mid-training is recreated to resume from the latest checkpoint in "
            "output_location (0: never; the run fails).", TIMING,
        ),
        "max_capacity_wait_minutes": _param(
            "max_capacity_wait_minutes", "integer",
            "How long create_vm waits, deferred (no worker slot), for a free machine in the reservation, "
            "which every run and VM using it shares; then the run fails. 0: fail at once when it is full.",
            TIMING,
        ),
        "max_run_duration_minutes": _param(
            "max_run_duration_minutes",
            ["null", "integer"],
            "The VM's lifetime (its expiry label; Compute Engine's maxRunDuration if enforced); "
            "empty: every step's time limit added up, plus 30 minutes.",
            TIMING,
        ),
        "cloud_enforced_lifetime": _param(
            "cloud_enforced_lifetime", "boolean",
            "Let Compute Engine delete the VM at the end of its lifetime, even if Airflow is down.", TIMING,
        ),
    }


def with_defaults(params: dict[str, Param], values: dict) -> dict[str, Param]:
    """The same Params with other defaults (a declared job's values); their schemas unchanged."""
    unknown = sorted(set(values) - set(params))
    if unknown:
        raise KeyError(f"no such Param: {', '.join(unknown)}")
    return {
        name: Param(values[name], param.description, schema=param.schema) if name in values else param
        for name, param in params.items()
    }
