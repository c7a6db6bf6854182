"""Checks before the VM is paid for: everything that would otherwise fail on the VM, found first.

Each check names what is wrong and how to fix it; `run_preflight` runs them all and fails the
task (no retries) listing every failure, so one trigger shows every problem of a conf.
"""

from __future__ import annotations

import fnmatch
import functools
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowFailException
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook, reservation_counts, reservation_owner
from maxtext_sft.cloud.hub import HuggingFaceHubHook
from maxtext_sft.cloud.storage import StorageEndpointHook, split_gcs_uri
from maxtext_sft.run.paths import local_output_dir
from maxtext_sft.run.sizing import (
    GB,
    HOST_MEMORY_BYTES,
    MAXTEXT_VENV_BYTES,
    OS_ALLOWANCE_BYTES,
    gb,
    run_sizes,
    saved_steps,
)
from maxtext_sft.run.snapshots import files_at
from maxtext_sft.run.spec import RunSpec

if TYPE_CHECKING:
    from huggingface_hub import HfApi


class PreflightFailed(Exception):
    """One check's finding: what is wrong and what to do about it."""


class InvalidToken(PreflightFailed):
    """The Hub refuses the token itself: checks that need it cannot say anything."""


def check_hub_access(api: HfApi, spec: RunSpec, whoami: Callable[[], dict]) -> str:
    """The token is valid and may read the base checkpoint. `whoami`: the Hub's whoami-v2 answer
    for the token (asked once a preflight: the Hub limits that endpoint strictly)."""
    from huggingface_hub.errors import HfHubHTTPError  # imported when used: DAG files stay cheap to parse (docs/architecture.md)

    try:
        user = whoami()["name"]
    except HfHubHTTPError as error:
        if error.response is not None and error.response.status_code == 401:
            raise InvalidToken("the Hugging Face token is invalid or expired (connection password)") from None
        raise
    repo = spec.checkpoint_repo()
    if repo is None:
        return f"token of {user}; the base checkpoint is a folder on the VM"
    readable_commit(api, "model", repo, spec.model_revision, f"the Hugging Face token ({user})")
    return f"token of {user} may read {repo}"


# Fine-grained permissions that let a token write a repo's files when given on the repo or on its
# owner, and the one that lets it create a repo under its owner: the Hub's names (its token
# settings, whoami-v2's answers); that only repo.write creates is this package's reading, as the
# Hub publishes no table of them (docs/toy-vs-real.md).
HUB_CONTENT_WRITE = frozenset({"repo.write", "repo.content.write"})
HUB_CREATE = frozenset({"repo.write"})


def check_hub_write(api: HfApi, spec: RunSpec, whoami: Callable[[], dict]) -> str:
    """The token may write to `hub_repo_id`, or create it when it does not exist yet, judged from
    the Hub's answers alone (whoami-v2: the token's role, a fine-grained token's permissions, the
    user's orgs and role in them; whether the repo exists): nothing is written. A run that fails
    here would otherwise fail at publish_to_hub, after the TPU hours."""
    repo = spec.hub_repo_id
    owner = repo.split("/", 1)[0]
    me = whoami()
    user = me["name"]
    token = (me.get("auth") or {}).get("accessToken") or {}
    role = token.get("role")
    exists = api.repo_exists(repo, repo_type="model")
    action = "write to it" if exists else f"create it under {owner}"
    where = f"Param hub_repo_id {repo}: the Hugging Face token (of {user})"
    fix = (
        f"publish_to_hub would fail after the training. Put a token with write access to {owner} in the "
        "Hugging Face connection (password), or empty hub_repo_id to publish nothing"
    )
    org_roles = {org["name"]: org.get("roleInOrg") for org in me.get("orgs") or []}
    if owner != user and owner not in org_roles:
        raise PreflightFailed(f"{where} cannot {action}: {user} is not {owner} nor a member of it, so {fix}")
    if org_roles.get(owner) == "read":
        raise PreflightFailed(f"{where} cannot {action}: {user} has the read role in {owner}, so {fix}")
    if role == "read":
        raise PreflightFailed(f"{where} is read-only, so {fix}")
    if role == "fineGrained":
        granted = set()
        for scope in (token.get("fineGrained") or {}).get("scoped") or []:
            entity = scope.get("entity") or {}
            if (entity.get("type") in ("user", "org") and entity.get("name") == owner) or entity.get("name") == repo:
                granted.update(scope.get("permissions") or [])
        needed = HUB_CONTENT_WRITE if exists else HUB_CREATE
        if not granted & needed:
            has = ", ".join(sorted(granted)) or "none"
            raise PreflightFailed(
                f"{where} is fine-grained without {' or '.join(sorted(needed))} on {owner if not exists else repo} "
                f"(its permissions there: {has}), so it cannot {action}: {fix}"
            )
    elif role != "write":
        return f"{repo}: not checked (token role {role!r}: neither read, write nor fine-grained)"
    return f"token of {user} may {action}" if exists else f"{repo} does not exist yet; token of {user} may {action}"


def check_dataset(api: HfApi, spec: RunSpec) -> str:
    if spec.bucket_dataset:
        if not spec.dataset_files:
            raise PreflightFailed(
                f"dataset folder {spec.dataset_name} has no files {spec.train_files_pattern}, or cannot be "
                "listed (Params dataset_name, train_split; the Google connection's access to the bucket)"
            )
        return f"dataset {spec.dataset_name}: {len(spec.dataset_files)} file(s) {spec.train_files_pattern}"
    if not spec.hub_dataset:
        return f"dataset {spec.dataset_name} is a folder on the VM: not checked"
    commit = readable_commit(api, "dataset", spec.dataset_name, spec.dataset_revision, "the Hugging Face token")
    if spec.dataset_revision is None:  # plan_run could not pin it, and it is readable now: a passing fault
        raise PreflightFailed(f"dataset {spec.dataset_name}: no snapshot was pinned; clear the run to try again")
    if not spec.dataset_files:
        raise PreflightFailed(
            f"dataset {spec.dataset_name} at commit {commit} has no files {spec.train_files_pattern} (Param train_split)"
        )
    return f"dataset {spec.dataset_name} at commit {commit}: {len(spec.dataset_files)} file(s) {spec.train_files_pattern}"


def check_eval_split(api: HfApi, storage: StorageEndpointHook, spec: RunSpec) -> str:
    """The held-out split has files where the training's are (the same snapshot, or folder): MaxText
    would otherwise fail on the VM, after the install and the conversion were paid for."""
    if not spec.eval_split:
        return "no evaluation (Param eval_split empty)"
    pattern = spec.eval_files_pattern
    if (spec.bucket_dataset or spec.hub_dataset) and not spec.dataset_files:
        return "not checked (no snapshot of the dataset: its own check says why)"
    if spec.bucket_dataset:
        names = [name for name in storage.names_under(spec.dataset_name) if fnmatch.fnmatchcase(name, pattern)]
        where = f"dataset folder {spec.dataset_name}"
    elif spec.hub_dataset and spec.dataset_revision:
        names = files_at(api, spec.dataset_name, spec.dataset_revision, pattern)
        where = f"dataset {spec.dataset_name} at commit {spec.dataset_revision}"
    else:
        return f"split {spec.eval_split} of {spec.dataset_name}: not checked (read by split name on the VM)"
    if not names:
        raise PreflightFailed(
            f"{where} has no files {pattern} to evaluate on (Param eval_split; empty it to train without evaluation)"
        )
    return f"{where}: {len(names)} file(s) {pattern} to evaluate on, {spec.eval_steps} batches"


def readable_commit(api: HfApi, kind: str, repo: str, revision: str | None, token: str) -> str:
    """The commit `revision` of Hub repo `repo` (a "model" or "dataset") resolves to, checking that
    `token` (its description, for the messages) may read its files."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError  # imported when used: DAG files stay cheap to parse (docs/architecture.md)

    try:
        api.auth_check(repo, repo_type=kind)
        return api.repo_info(repo, repo_type=kind, revision=revision).sha
    except GatedRepoError:
        raise PreflightFailed(
            f"{token} has no access to the gated {kind} {repo}: accept its licence on the Hub with that account"
        ) from None
    except RevisionNotFoundError:
        raise PreflightFailed(f"{kind} {repo} has no revision {revision!r} (Param {kind}_revision)") from None
    except RepositoryNotFoundError:
        raise PreflightFailed(f"{kind} {repo} does not exist on the Hub, or {token} cannot see it") from None


def check_reservation(compute: ComputeEngineEndpointHook, spec: RunSpec, *, capacity_gate: bool = False) -> str:
    """The reservation exists and holds the run's machine type; with no machine free it fails,
    unless `capacity_gate` (create_vm waits for one, up to max_capacity_wait_minutes). A shared
    reservation (projects/OWNER/reservations/NAME) is read in its owner project and must be shared
    with the run's project: the capacity gate reads it there too, so reading it is required."""
    from googleapiclient.errors import HttpError  # imported when used: DAG files stay cheap to parse

    owner, name = reservation_owner(spec.reservation, spec.project_id)
    where = f"reservation {name} in {owner}/{spec.zone}"
    try:
        reservation = compute.get_reservation(name=spec.reservation, zone=spec.zone, project_id=spec.project_id)
    except HttpError as error:
        if error.resp.status != 403:
            raise
        raise PreflightFailed(
            f"{where} cannot be read by the Google connection: grant it compute.reservations.get in {owner} "
            "(the capacity gate reads the reservation before each VM)"
        ) from None
    if reservation is None:
        raise PreflightFailed(f"{where} does not exist (Params reservation, zone, project_id)")
    if owner != spec.project_id and not _shared_with(reservation, spec.project_id):
        raise PreflightFailed(
            f"{where} is not shared with project {spec.project_id}, where the VM runs (its owner adds the project "
            "to the reservation's share settings)"
        )
    specific = reservation.get("specificReservation") or {}
    machine_type = (specific.get("instanceProperties") or {}).get("machineType", "").rsplit("/", 1)[-1]
    if machine_type != spec.machine_type:
        raise PreflightFailed(f"{where} holds {machine_type or 'no'} machines, not {spec.machine_type}")
    count, in_use = reservation_counts(reservation)
    if spec.rehearsal:  # read only: the rehearsal's VM takes none of it
        return f"{where} exists and holds {machine_type} machines ({count - in_use} of {count} free; not used by the rehearsal)"
    needed = spec.hosts  # a slice's every host at once
    if count < needed:
        raise PreflightFailed(
            f"{where} holds {count} {machine_type} machines; the {spec.tpu_slice} slice needs {needed}"
        )
    if count - in_use < needed and capacity_gate and spec.max_capacity_wait_minutes > 0:
        if needed > 1:
            return (
                f"{where}: {in_use} of {count} {machine_type} machines in use; create_slice waits up to "
                f"{spec.max_capacity_wait_minutes} minutes for {needed} to be free"
            )
        return (
            f"{where}: all {count} {machine_type} machines in use; create_vm waits up to "
            f"{spec.max_capacity_wait_minutes} minutes for one"
        )
    if count - in_use < needed:
        also = f", the slice needs {needed}" if needed > 1 else ""
        raise PreflightFailed(f"{where} has no free capacity: {in_use} of {count} machines in use{also}")
    return f"{where}: {count - in_use} of {count} {machine_type} free"


def check_network(compute: ComputeEngineEndpointHook, spec: RunSpec) -> str:
    """The VM's network exists in its host project and the insert names what it needs: a
    subnetwork of that network in the zone's region on a custom-mode network (the API refuses
    the insert without one). A network the connection may not read (a Shared VPC's host project
    often grants only compute.subnetworks.use) is not checked: the insert itself will tell."""
    from googleapiclient.errors import HttpError  # imported when used: DAG files stay cheap to parse

    host, region = spec.network_host, spec.region
    where = f"network {spec.network} in project {host}"
    try:
        network = compute.get_network(name=spec.network, project_id=host)
        subnetwork = (
            compute.get_subnetwork(name=spec.subnetwork, region=region, project_id=host) if spec.subnetwork else None
        )
    except HttpError as error:
        if error.resp.status == 403:
            return f"{where}: not checked (the Google connection may not read it: compute.networks.get)"
        raise
    if network is None:
        raise PreflightFailed(f"{where} does not exist (Params network, network_project)")
    custom = network.get("autoCreateSubnetworks") is False
    if not spec.subnetwork:
        if custom:
            raise PreflightFailed(
                f"{where} is a custom-mode network: name one of its subnetworks in {region} (Param subnetwork; "
                f"gcloud compute networks subnets list --network={spec.network} --project={host})"
            )
        return f"{where} (auto mode): the VM joins its subnetwork in {region}"
    if subnetwork is None:
        raise PreflightFailed(
            f"subnetwork {spec.subnetwork} does not exist in {region} of project {host} (Params subnetwork, "
            "network_project, zone)"
        )
    belongs_to = str(subnetwork.get("network", "")).rsplit("/networks/", 1)[-1]
    if belongs_to != spec.network:
        raise PreflightFailed(
            f"subnetwork {spec.subnetwork} in {region} belongs to network {belongs_to}, not {spec.network} "
            "(Params network, subnetwork)"
        )
    return f"{where}, subnetwork {spec.subnetwork} ({subnetwork.get('ipCidrRange', '?')}) in {region}"


def _shared_with(reservation: dict, project_id: str) -> bool:
    """Whether a reservation of another project may be consumed from `project_id`: shared with
    specific projects, that one among them (ShareSettings, v1 discovery document). A share type this
    cannot read (by folder, say) counts as shared: the insert itself will tell."""
    settings = reservation.get("shareSettings") or {}
    share_type = settings.get("shareType", "LOCAL")
    if share_type == "LOCAL":
        return False
    if share_type == "SPECIFIC_PROJECTS":
        return project_id in (settings.get("projectMap") or {})
    return True


def check_iap(gcp_conn_id: str, spec: RunSpec) -> str:
    """With ssh_via_iap: the Google connection has an identity that gets an access token, and it
    holds the IAP tunnel permission on the project (cloud/iap_tunnel.py), before any VM."""
    from maxtext_sft.cloud.iap_tunnel import TUNNEL_ROLE, IapTunnelHook, IapTunnelRefused

    hook = IapTunnelHook(gcp_conn_id=gcp_conn_id)
    try:
        allowed = hook.may_tunnel(spec.project_id)
    except (IapTunnelRefused, ValueError) as error:
        raise PreflightFailed(str(error)) from None
    if not allowed:
        raise PreflightFailed(
            f"{hook.identity()} (Google connection {gcp_conn_id!r}) may not tunnel to VMs of project "
            f"{spec.project_id}: it needs the {TUNNEL_ROLE} role there (Param ssh_via_iap)"
        )
    return f"{hook.identity()} may tunnel to project {spec.project_id}'s VMs through {hook.endpoint}"


def check_output_location(storage: StorageEndpointHook, spec: RunSpec) -> str:
    if not spec.durable:
        return "no output_location: outputs stay on the VM until collect_outputs copies the export"
    probe = f"{spec.run_output_dir}/.preflight-write-probe"
    try:
        storage.create_once(probe, "{}")
        bucket, name = split_gcs_uri(probe)
        storage.delete(bucket, name)
    except Exception as error:  # noqa: BLE001 - any refusal means the same thing to the user
        raise PreflightFailed(f"output_location {spec.output_location} is not writable: {error}") from None
    return f"output_location {spec.output_location} is writable"


def check_room(spec: RunSpec, *, worker_free_bytes: int | None, publish_free_bytes: int | None = None) -> str:
    """What the run writes fits where it writes it, at the real model's size (see run/sizing.py):
    the VM's boot disk (the Hub download, the MaxText venv, the OS), its /dev/shm (the tutorial's
    scratch: the export always, the conversion and every training checkpoint when they stay on the
    VM), without an output location the worker's local_output_dir (the export, copied there), and
    with hub_repo_id the worker's temporary folder (publish_to_hub fetches one file of the export at
    a time there: the largest must fit). `worker_free_bytes`, `publish_free_bytes`: free space of
    those folders' file systems (None: not checked). Workers of one deployment are alike: this
    worker's room stands for the one that copies or publishes."""
    sizes = run_sizes(spec.model_name)
    if sizes is None:
        return f"sizes not checked: no shape known for model {spec.model_name} (sizing.MODEL_SHAPES)"
    problems = []
    download = sizes.hf_download if spec.checkpoint_repo() else 0
    boot_need = OS_ALLOWANCE_BYTES + MAXTEXT_VENV_BYTES + download
    boot = spec.boot_disk_size_gb * GB
    if boot_need > boot:
        problems.append(
            f"the boot disk of {spec.boot_disk_size_gb} GB cannot hold {gb(boot_need)} (the {spec.model_name} "
            f"download {gb(download)}, the MaxText venv {gb(MAXTEXT_VENV_BYTES)}, the OS {gb(OS_ALLOWANCE_BYTES)}): "
            "raise the Param boot_disk_size_gb"
        )
    scratch_need = sizes.export
    what = f"the export {gb(sizes.export)}"
    if not spec.durable:
        kept = saved_steps(spec.steps, spec.checkpoint_period)
        scratch_need += sizes.converted_checkpoint + kept * sizes.training_checkpoint
        what += (
            f", the converted checkpoint {gb(sizes.converted_checkpoint)} and {kept} training checkpoints of "
            f"{gb(sizes.training_checkpoint)} (steps {spec.steps}, checkpoint_period {spec.checkpoint_period})"
        )
    memory = HOST_MEMORY_BYTES.get(spec.machine_type)
    if memory is not None and scratch_need > memory // 2:
        problems.append(
            f"/dev/shm on {spec.machine_type} (a RAM disk of half its {gb(memory)} memory, {gb(memory // 2)}) "
            f"cannot hold {gb(scratch_need)}: {what}. Set output_location so checkpoints go to storage, or a "
            "larger checkpoint_period"
        )
    if not spec.durable and worker_free_bytes is not None and sizes.export > worker_free_bytes:
        problems.append(
            f"the worker's local_output_dir has {gb(worker_free_bytes)} free, not the {gb(sizes.export)} of the "
            "export collect_outputs copies there: set output_location, or [maxtext_sft] local_output_dir to a "
            "larger file system"
        )
    if spec.hub_repo_id and publish_free_bytes is not None and sizes.largest_export_file > publish_free_bytes:
        problems.append(
            f"the worker's temporary folder ({tempfile.gettempdir()}) has {gb(publish_free_bytes)} free, not the "
            f"{gb(sizes.largest_export_file)} of the export's largest file, which publish_to_hub fetches there before "
            "uploading it: give the workers a larger TMPDIR"
        )
    if problems:
        raise PreflightFailed("; ".join(problems))
    return (
        f"{spec.model_name} ({sizes.text_parameters / 1e9:.2f}B parameters trained) fits: boot disk needs "
        f"{gb(boot_need)} of {spec.boot_disk_size_gb} GB, /dev/shm {gb(scratch_need)}"
    )


def free_bytes(folder: Path) -> int:
    """Free space of the file system `folder` is (or will be) on."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def run_preflight(
    spec: RunSpec, *, gcp_conn_id: str, hf_conn_id: str, log: Any, capacity_gate: bool = False
) -> list[str]:
    """Run every check; fail (without retries) naming every failure, or return what was found.

    `capacity_gate`: create_vm waits for a free machine, so a full reservation is not a failure.
    """
    api = HuggingFaceHubHook(hf_conn_id=hf_conn_id).get_conn()
    whoami = functools.cache(api.whoami)  # one whoami-v2 call, however many checks read it
    # One hook each: a hook builds its client on first use, so the checks that share one share it.
    compute = ComputeEngineEndpointHook(gcp_conn_id=gcp_conn_id)
    storage = StorageEndpointHook(gcp_conn_id=gcp_conn_id)
    checks = [
        ("Hugging Face token", lambda: check_hub_access(api, spec, whoami)),
        # Only a run that publishes (publish_to_hub publishes nothing without hub_repo_id).
        *([("Hub publishing", lambda: check_hub_write(api, spec, whoami))] if spec.hub_repo_id else []),
        ("dataset", lambda: check_dataset(api, spec)),
        ("eval split", lambda: check_eval_split(api, storage, spec)),
        # Only a run on a reservation has one to read (capacity; a rehearsal reads the real run's).
        *(
            [("reservation", lambda: check_reservation(compute, spec, capacity_gate=capacity_gate))]
            if spec.capacity == "reservation"
            else []
        ),
        ("network", lambda: check_network(compute, spec)),
        *([("SSH through IAP", lambda: check_iap(gcp_conn_id, spec))] if spec.ssh_via_iap else []),
        ("output location", lambda: check_output_location(storage, spec)),
        ("room", lambda: check_room(
            spec, worker_free_bytes=None if spec.durable else free_bytes(local_output_dir()),
            publish_free_bytes=free_bytes(Path(tempfile.gettempdir())) if spec.hub_repo_id else None,
        )),
    ]
    found, failures = [], []
    token_invalid = False
    for name, check in checks:
        if token_invalid and name in ("Hub publishing", "dataset", "eval split"):
            failures.append(f"{name}: not checked (the Hugging Face token is invalid)")
            continue
        try:
            found.append(f"{name}: {check()}")
            log.info("Preflight %s", found[-1])
        except PreflightFailed as failure:
            token_invalid = token_invalid or isinstance(failure, InvalidToken)
            failures.append(f"{name}: {failure}")
    if failures:
        raise AirflowFailException("Preflight failed, no VM was created:\n" + "\n".join(failures))
    return found
