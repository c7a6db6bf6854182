"""One run, one spec: everything a fine-tuning run needs, derived once from Params and run identity.

`RunSpec` is a frozen dataclass built by `build_run_spec` from the checked Params
(run/params.py), the DAG run's identity and the VM user's public key. Every later task reads it
(through XCom) instead of deriving names and paths on its own, so a task retry sees exactly the
same VM name, run_name and paths. Its parts live with their concern: names and paths
(run/names.py), the MaxText command lines (run/maxtext_args.py), the Compute body (run/compute_body.py).
No Airflow imports, so tests build specs without Airflow.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from maxtext_sft.run.catalog import BASE_MODELS
from maxtext_sft.run.compute_body import ComputeInstanceBody
from maxtext_sft.run.catalog import TPU_SLICES
from maxtext_sft.run.maxtext_args import MaxTextCommandLines, checkpoint_period_for, refuse_owned_keys
from maxtext_sft.run.names import RunPaths, run_name_for, vm_name_for
from maxtext_sft.run.slice_body import SliceBodies
from maxtext_sft.run.params import (
    DATASET,
    DATE_TOKEN,
    PROJECT_ID,
    SpecError,
    all_params,
    check_params,
    declared,
)

# What a VM's lifetime adds to the steps' time limits: boot, SSH, uploads, teardown.
LIFETIME_MARGIN_MINUTES = 30
# A flex-start VM runs for 10 minutes to seven days (Compute Engine's flex-start create page).
FLEX_START_MAX_RUN_MINUTES = 7 * 24 * 60
SSH_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
SSH_PUBLIC_KEY = re.compile(r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp\d+) [A-Za-z0-9+/=]+$")


@dataclasses.dataclass(frozen=True)
class RunSpec(RunPaths, MaxTextCommandLines, ComputeInstanceBody, SliceBodies):
    """One DAG run's fine-tune: its identity, the names derived from it, and every declared Param,
    checked and resolved (the project filled in, the dataset pinned, the lifetime worked out).

    A spec answers each declared Param by name (`spec.steps`), with the type its row declares."""

    dag_id: str
    run_id: str
    generation: int  # the DAG run's clear_number: a cleared run trains again under a new run_name
    vm_name: str
    run_name: str
    ssh_user: str
    ssh_public_key: str
    base_model_license: str | None  # the model card's licence, when the base model is MaxText's own
    dataset_files: tuple[str, ...]  # the snapshot's files the run reads (train_files_pattern), for the record
    params: Mapping[str, Any]  # every declared Param by name, checked and resolved
    # On a multi-host slice, the host a step runs on: its worker id (JAX process id) and every
    # host's internal address in worker order. A single VM is worker 0 of ("localhost",).
    host_index: int = 0
    worker_hostnames: tuple[str, ...] = ()
    host_id: str = ""  # the host's instance id when the slice formed: a re-created host has another

    def __getattr__(self, name: str) -> Any:
        # Only reached when no field or property has the name: the declared Params.
        params = self.__dict__.get("params")
        if params is not None and name in params:
            return params[name]
        raise AttributeError(f"{type(self).__name__} has no field or Param {name!r}")

    @property
    def rehearsal(self) -> bool:
        """A rehearsal's spec (fine_tune_dag(rehearsal=True)): its VM is the cheap CPU machine."""
        return "rehearsal_machine_type" in self.params

    @property
    def consumed_reservation(self) -> str | None:
        """The reservation the VM is bound to (what the capacity gate reads); None for a rehearsal,
        which only reads it, and for the capacity types that use none."""
        return None if self.rehearsal or self.capacity != "reservation" else self.reservation

    @property
    def machine_source(self) -> str:
        """Where the VM's machine comes from, for a message: "reservation NAME", or the zone's capacity."""
        if self.consumed_reservation:
            return f"reservation {self.reservation}"
        return f"{'on-demand' if self.rehearsal else self.capacity} capacity in zone {self.zone}"

    @property
    def waits_out_stockouts(self) -> bool:
        """Whether a zone's stockout is waited out (the insert asked again at intervals, up to
        max_capacity_wait_minutes): a real run without a reservation, which has no other way to
        get its machine. A run on a reservation waits for the reservation instead, and a rehearsal's
        cheap VM leaves a stockout to the task's retries."""
        return not self.rehearsal and self.capacity in ("spot", "on-demand", "flex-start")

    @property
    def queued_insert(self) -> bool:
        """Whether the VM's insert waits in Compute Engine's flex-start queue (the instance
        PENDING, up to flex_start_valid_minutes) before it has a machine."""
        return not self.rehearsal and self.capacity == "flex-start"

    def with_values(self, **changes: Any) -> RunSpec:
        """This spec with some fields or Params changed (a pinned dataset, a bake's own VM)."""
        params = {name: changes.pop(name) for name in list(changes) if name in self.params}
        return dataclasses.replace(self, params={**self.params, **params}, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON values, one flat mapping (what crosses XCom)."""
        flat = {**self.params, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "params"}}
        return {key: list(value) if isinstance(value, tuple) else value for key, value in flat.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSpec:
        """The spec `to_dict` made; a Param missing from it (declared since) takes its default."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"params"}
        as_read = {key: tuple(value) if isinstance(value, list) else value for key, value in data.items()}
        table = declared(all_params(rehearsal="rehearsal_machine_type" in as_read, tpu_slice="tpu_slice" in as_read))
        params = {name: as_read.get(name, param.default) for name, param in table.items()}
        return cls(**{key: value for key, value in as_read.items() if key in fields}, params=params)


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
    rehearsal: bool = False,
    tpu_slice: bool = False,
) -> RunSpec:
    """Check every Param (the rehearsal's or the slice's too, with `rehearsal` or `tpu_slice`) and
    derive the run's spec; raises SpecError naming the first bad field."""
    p = check_params(params, all_params(rehearsal, tpu_slice))
    _check_capacity(p)
    if tpu_slice:
        _check_slice(p)
    p["project_id"] = p["project_id"] or default_project_id
    if not isinstance(p["project_id"], str) or not PROJECT_ID.fullmatch(p["project_id"]):
        raise SpecError(
            f"Param 'project_id': {p['project_id']!r} is not a Google Cloud project id "
            "(set the Param or the Google connection's project)",
            "project_id",
        )
    p["dataset_name"] = _dataset_of_the_day(p, started)
    if p["dataset_revision"] is not None and p["dataset_name"].startswith(("/", "gs://")):
        raise SpecError("Param 'dataset_revision': only a Hub dataset has revisions, not a folder", "dataset_revision")
    if p["autostop_idle_minutes"] * 60 < 2 * p["poke_interval_seconds"]:
        # The pokes are the VM's sign that the pipeline is alive: between two of them it must not stop.
        raise SpecError(
            f"Param 'autostop_idle_minutes': {p['autostop_idle_minutes']:g} minutes is less than two poke "
            f"intervals (poke_interval_seconds={p['poke_interval_seconds']}): the VM would stop itself between checks",
            "autostop_idle_minutes",
        )
    for step in ("convert", "train", "export"):
        refuse_owned_keys(step, p[f"{step}_extra_args"])
    if p["output_location"]:
        p["output_location"] = p["output_location"].rstrip("/")
    p["checkpoint_period"] = p["checkpoint_period"] or checkpoint_period_for(
        p["steps"], bool(p["output_location"]), p["capacity"]
    )
    known_id, known_license = BASE_MODELS[p["model_name"]]
    p["base_model_id"] = p["base_model_id"] or known_id
    p["max_run_duration_minutes"] = p["max_run_duration_minutes"] or lifetime_minutes(p)
    if p["capacity"] == "flex-start" and not 10 <= p["max_run_duration_minutes"] <= FLEX_START_MAX_RUN_MINUTES:
        raise SpecError(
            f"Param 'max_run_duration_minutes': a flex-start VM runs 10 minutes to 7 days ({FLEX_START_MAX_RUN_MINUTES} "
            f"minutes) and this run's VM lifetime is {p['max_run_duration_minutes']} (set it, or change the step "
            "time limits it is added up from)",
            "max_run_duration_minutes",
        )
    if not SSH_USER.fullmatch(ssh_user) or ssh_user == "root":
        raise SpecError(f"SSH connection login {ssh_user!r}: need a non-root user name (Compute Engine refuses root)")
    if not SSH_PUBLIC_KEY.fullmatch(ssh_public_key):
        raise SpecError("SSH connection: the private key does not give a usable public key")
    spec = RunSpec(
        dag_id=dag_id,
        run_id=run_id,
        generation=generation,
        vm_name=vm_name_for(p["vm_name_prefix"], dag_id, run_id, generation),
        run_name=run_name_for(dag_id, run_id, generation, started),
        ssh_user=ssh_user,
        ssh_public_key=ssh_public_key,
        base_model_license=known_license if p["base_model_id"] == known_id else None,
        dataset_files=(),
        params=p,
    )
    if tpu_slice and (refusal := spec.check_slice_names()):
        raise SpecError(f"Param 'vm_name_prefix': {refusal}", "vm_name_prefix")
    return spec


def _check_capacity(p: Mapping[str, Any]) -> None:
    """The reservation is named exactly when the capacity is one, and a Spot run's checkpoints
    outlive its VM."""
    capacity = p["capacity"]
    if capacity == "reservation" and not p["reservation"]:
        raise SpecError(
            "Param 'reservation': required with TPU capacity 'reservation' (the VM runs only on it); "
            "or choose the capacity flex-start, spot or on-demand",
            "reservation",
        )
    if capacity != "reservation" and p["reservation"]:
        raise SpecError(
            f"Param 'reservation': only TPU capacity 'reservation' runs on one; leave it empty for {capacity!r}",
            "reservation",
        )
    if capacity == "spot" and not p["output_location"]:
        raise SpecError(
            "Param 'output_location': a Spot VM can be preempted at any time, so its checkpoints must outlive it "
            "in a gs://bucket/prefix for the training to resume on a new VM",
            "output_location",
        )


def _check_slice(p: Mapping[str, Any]) -> None:
    """A slice's hosts are its shape's machine type, and its checkpoints live in storage: every
    host writes its part of each one, and the export (on one host) reads them all."""
    shape = TPU_SLICES[p["tpu_slice"]]
    if p["capacity"] != "reservation":
        # A slice's hosts come from one managed instance group; flex-start and Spot slices are made
        # by the group's resize requests (with requestedRunDuration) or a Spot template, which this
        # pipeline does not send yet (docs/multi-host.md).
        raise SpecError(
            f"Param 'capacity': a {p['tpu_slice']} slice runs only on a reservation here, not {p['capacity']!r}",
            "capacity",
        )
    if p["machine_type"] != shape["machine_type"]:
        raise SpecError(
            f"Param 'machine_type': a {p['tpu_slice']} slice is made of {shape['machine_type']} hosts, "
            f"not {p['machine_type']}",
            "machine_type",
        )
    if not p["output_location"]:
        raise SpecError(
            f"Param 'output_location': a {p['tpu_slice']} slice needs one (gs://bucket/prefix): its "
            f"{shape['hosts']} hosts write their parts of each checkpoint there, and none can hold them all",
            "output_location",
        )


def _dataset_of_the_day(p: Mapping[str, Any], started: datetime) -> str:
    """dataset_name with the run's date filled in, for a bucket folder that names it."""
    name = p["dataset_name"]
    if not name.startswith("gs://"):
        return name
    name = DATE_TOKEN.sub(
        lambda token: f"{started:%Y-%m-%d}" if token.group(1) == "ds" else f"{started:%Y%m%d}", name
    ).rstrip("/")
    if not DATASET.fullmatch(name):
        raise SpecError(f"Param 'dataset_name': {name!r} is not a gs://bucket/folder", "dataset_name")
    return name


def lifetime_minutes(p: Mapping[str, Any]) -> int:
    """The VM's lifetime when the Param leaves it empty: every step's time limit added up, plus a margin."""
    limits = [p[f"{step}_timeout_minutes"] for step in ("install", "convert", "export")]
    highest = declared()["max_run_duration_minutes"].maximum
    return int(min(sum(limits) + p["training_timeout_hours"] * 60 + LIFETIME_MARGIN_MINUTES, highest))
