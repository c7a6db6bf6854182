"""A baked image: MaxText installed once into an image family, so that runs booting it skip the
install (install_maxtext.sh exits at once when the venv has the pinned version).

`build_bake_spec` validates the bake DAG's Params and derives every name (the VM, the image) from
the run's identity, like `spec.build_run_spec` for a fine-tune (which it reuses for the values
both share: project, zone, network, source image, disk size, MaxText version, work_dir, SSH user
and key). No Airflow imports.

Where the venv lives, and who finds it: the install runs as the SSH connection's user and puts
the venv in WORK_DIR/maxtext_venv, WORK_DIR under that user's home ("~" by default). The image
keeps every home of the disk, and a VM booted from it gives an existing user its keys without
touching its home (a new user's home comes from /etc/skel). So a run finds the baked venv only
when it logs in as the *same user name* with the *same work_dir*: the image's labels record both
(`maxtext-vm-user`, `maxtext-work-dir`), and an absolute work_dir is refused here (the VM user
cannot create folders outside its home without sudo, and a run's `~` is its own user's home).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from maxtext_sft.run.names import PACKAGE_LABEL, label_value, vm_name_for
from maxtext_sft.run.params import GCE_NAME, MAXTEXT, VM, Declared, SpecError, check_params, declared
from maxtext_sft.run.spec import RunSpec, build_run_spec

HOME_PATH = re.compile(r"^(~|~/[A-Za-z0-9._/-]*)$")
_RUN = declared()  # the fine-tune's Params: the bake shares most of its kinds of value
# The bake DAG's Params. The image it bakes from is the one runs boot today (the tutorial's).
BAKE_PARAMS: tuple[Declared, ...] = (
    _RUN["project_id"].but(
        description="The Google Cloud project of the bake's VM and of the image. Empty: the project of "
        "Airflow's Google Cloud connection."
    ),
    _RUN["zone"].but(description="The zone the bake's VM is created in, e.g. us-east5-b."),
    _RUN["network"].but(description="The VPC network the bake's VM joins; 'default' is the project's default network."),
    _RUN["subnetwork"].but(
        description="The subnetwork the bake's VM joins, in the zone's region: required on a custom-mode network."
    ),
    _RUN["network_project"],
    _RUN["network_tag"].but(description="The tag the firewall rule that lets SSH in names (the pipeline's VMs' tag)."),
    _RUN["use_internal_ip"].but(
        description="Connect to the VM's internal IP (Airflow's workers run inside the VPC network); the VM "
        "then gets no external IP."
    ),
    _RUN["image_project"].but(
        name="source_image_project", title="Source image project",
        description="The project that publishes the image the bake starts from.",
    ),
    _RUN["image_family"].but(
        name="source_image_family", title="Source image family",
        description="The bake starts from the newest image of this family.",
    ),
    # The install is CPU work (apt, uv, pip): a cheap on-demand CPU machine, no reservation.
    Declared("machine_type", "string", "e2-standard-4",
             "The on-demand CPU machine the install runs on (it needs no TPU and no reservation).", VM,
             title="Machine type", pattern=GCE_NAME, what="a machine type"),
    _RUN["boot_disk_size_gb"].but(
        description="Size of the boot disk, and so of the image, in GB: runs booting it need at least this."
    ),
    _RUN["maxtext_version"].but(description="The MaxText version to install, e.g. 0.2.2."),
    _RUN["work_dir"].but(
        description="Where MaxText's Python environment goes, under the VM user's home; runs use it only "
        "with the same Working folder and the same SSH login.",
        pattern=HOME_PATH,
        what="'~' or '~/...': the install runs as the VM user, who writes only in its home, and a run "
        "finds the venv in its own user's home",
    ),
    _RUN["image_family"].but(
        default="maxtext-sft", section=MAXTEXT, title="Baked image family",
        description="The family the baked image joins: runs give it as their Boot image family.",
    ),
    Declared("image_name", "string", None,
             "The name of the baked image. Empty: maxtext-<version>-<a short hash of the run>.", MAXTEXT,
             title="Baked image name", nullable=True, pattern=GCE_NAME,
             what="an image name (lowercase, digits, '-'; 1-63)"),
    _RUN["install_timeout_minutes"].but(
        description="Minutes the MaxText install may take; the VM lives 30 minutes longer at most."
    ),
)

VM_NAME_PREFIX = "maxtext-bake"
# What the VM's lifetime adds to the install's time limit: boot, SSH, stop, the image.
BAKE_MARGIN_MINUTES = 30
# Accelerator machine types (TPU ct*, GPU a*/g2): the install needs none of them.
ACCELERATOR_MACHINE = re.compile(r"^(ct[0-9]|a[0-9]-|g2-)")

def image_labels(version: str, ssh_user: str, work_dir: str) -> dict[str, str]:
    """What a baked image's labels say about its venv: a run finds it only with this user and
    work_dir (see the module's docstring)."""
    return {
        "managed-by": PACKAGE_LABEL,
        "maxtext-version": label_value(version),
        "maxtext-vm-user": label_value(ssh_user),
        "maxtext-work-dir": hashlib.sha256(work_dir.encode()).hexdigest()[:12],
    }


@dataclasses.dataclass(frozen=True)
class BakeSpec:
    """Names and values of one bake run."""

    dag_id: str
    run_id: str
    project_id: str
    zone: str
    vm_name: str
    machine_type: str
    source_image_project: str
    source_image_family: str
    boot_disk_size_gb: int
    maxtext_version: str
    work_dir: str
    ssh_user: str
    image_family: str
    image_name: str
    max_run_duration_minutes: int
    vm_step_spec: dict  # the RunSpec the SSH steps (wait_for_ssh, install_maxtext) take

    @property
    def vm_run_spec(self) -> RunSpec:
        """vm_step_spec as a RunSpec."""
        return RunSpec.from_dict(self.vm_step_spec)

    @property
    def boot_disk(self) -> str:
        """The VM's boot disk (named after the VM, as an instance's boot disk is by default)."""
        return f"projects/{self.project_id}/zones/{self.zone}/disks/{self.vm_name}"

    @property
    def labels(self) -> dict[str, str]:
        return image_labels(self.maxtext_version, self.ssh_user, self.work_dir)

    def instance_body(self) -> dict[str, Any]:
        """The insert body (google-cloud-compute's field names): an on-demand CPU VM booting the
        source image, which deletes itself when its lifetime ends, whatever Airflow does."""
        body = self.vm_run_spec.instance_body()
        body.pop("reservation_affinity")
        body.pop("service_accounts")  # the install reads nothing from Google Cloud
        body["machine_type"] = f"projects/{self.project_id}/zones/{self.zone}/machineTypes/{self.machine_type}"
        body["scheduling"] = {
            "provisioning_model": "STANDARD",
            "instance_termination_action": "DELETE",
            "max_run_duration": {"seconds": self.max_run_duration_minutes * 60},
        }
        return body

    def image_body(self) -> dict[str, Any]:
        """The images.insert body (REST JSON): the stopped VM's boot disk, in the family."""
        return {
            "name": self.image_name,
            "family": self.image_family,
            "sourceDisk": self.boot_disk,
            "labels": self.labels,
            "description": (
                f"MaxText {self.maxtext_version} in {self.work_dir}/maxtext_venv of user {self.ssh_user}; "
                f"baked by Airflow DAG {self.dag_id}, run {self.run_id}"
            ),
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BakeSpec:
        return cls(**data)


def build_bake_spec(
    params: Mapping[str, Any],
    *,
    dag_id: str,
    run_id: str,
    started: datetime,
    default_project_id: str | None,
    ssh_user: str,
    ssh_public_key: str,
) -> BakeSpec:
    """Check the bake's Params; raises SpecError naming the first bad field."""
    p = check_params(params, BAKE_PARAMS)
    machine_type = p["machine_type"]
    if ACCELERATOR_MACHINE.match(machine_type):
        raise SpecError(
            f"Param 'machine_type': {machine_type!r} is an accelerator machine; the install is CPU work "
            "(use an on-demand CPU machine such as e2-standard-4)",
            "machine_type",
        )
    # What the fine-tune's spec also checks (project, zone, network, image, disk, version, SSH
    # user and key, the install's time limit): its validation, on the bake's values.
    shared = {
        "project_id": p["project_id"],
        "zone": p["zone"],
        "network": p["network"],
        "subnetwork": p["subnetwork"],
        "network_project": p["network_project"],
        "network_tag": p["network_tag"],
        "use_internal_ip": p["use_internal_ip"],
        "image_project": p["source_image_project"],
        "image_family": p["source_image_family"],
        "boot_disk_size_gb": p["boot_disk_size_gb"],
        "maxtext_version": p["maxtext_version"],
        "work_dir": p["work_dir"],
        "install_timeout_minutes": p["install_timeout_minutes"],
        "capacity": "on-demand",  # the bake's VM: no TPU, no reservation
    }
    base = build_run_spec(
        shared,
        dag_id=dag_id,
        run_id=run_id,
        generation=0,
        started=started,
        default_project_id=default_project_id,
        ssh_user=ssh_user,
        ssh_public_key=ssh_public_key,
    )
    version = base.maxtext_version
    run_hash = hashlib.sha256(f"{dag_id}/{run_id}".encode()).hexdigest()[:8]
    image_name = p["image_name"] or f"maxtext-{label_value(version).replace('_', '-')}-{run_hash}"
    vm_name = vm_name_for(VM_NAME_PREFIX, dag_id, run_id, 0)
    lifetime = base.install_timeout_minutes + BAKE_MARGIN_MINUTES
    vm_step_spec = base.with_values(vm_name=vm_name, max_run_duration_minutes=lifetime)
    return BakeSpec(
        dag_id=dag_id,
        run_id=run_id,
        project_id=base.project_id,
        zone=base.zone,
        vm_name=vm_name,
        machine_type=machine_type,
        source_image_project=base.image_project,
        source_image_family=base.image_family,
        boot_disk_size_gb=base.boot_disk_size_gb,
        maxtext_version=version,
        work_dir=p["work_dir"],
        ssh_user=ssh_user,
        image_family=p["image_family"],
        image_name=image_name,
        max_run_duration_minutes=lifetime,
        vm_step_spec=vm_step_spec.to_dict(),
    )


def baked_image(images: list[dict], spec: BakeSpec) -> dict | None:
    """The READY image of the spec's family that already holds its MaxText version for its user
    and work_dir (the newest, if several), or None: then there is something to bake."""
    wanted = spec.labels
    found = [
        image
        for image in images
        if image.get("family") == spec.image_family
        and image.get("status") == "READY"
        and "deprecated" not in image
        and all((image.get("labels") or {}).get(key) == value for key, value in wanted.items())
    ]
    return max(found, key=lambda image: image.get("creationTimestamp", ""), default=None)
