"""Instances through the API: get, list, aggregatedList, insert, delete and stop; the checks of an
insert body and the stored resource with Compute Engine's own fields.

Each instance's VM is a real sshd (vm.py), carried by lifecycle.py: an insert, delete or stop
answers with a zonal operation at once and a worker thread does the VM's part. An insert takes
its boot image from images.py (`_resolve_boot_image`), its reservation from reservations.py
(`reservation_to_consume`), its address from leases.py and its faults from faults.py.

Owns: Instance, InstanceResources (the instances table, the faults, the address leases).
Imports operations, reservations, scheduling, faults, leases, error_catalog, resources, catalog,
errors and vm.
"""

from __future__ import annotations

import copy
import logging
import re
import threading
from pathlib import Path

from . import catalog, errors
from .error_catalog import INSTANCE_ERRORS, error_values, fill
from .errors import ApiError
from .faults import Faults, InsertFaults, unrelated_ed25519_key
from .leases import AddressLeases
from .operations import Operations
from .reservations import ReservationRefused
from .resources import (
    Link, Request, aggregated_list, check_labels, check_metadata, new_fingerprint, new_id, now_rfc3339, parse_rfc3339,
    query_arg, relative_url, stored_metadata, validated_body, zonal_list,
)
from .scheduling import (
    FLEX_START_MIN_PENDING_SECONDS, check_capacity_model, check_host_maintenance, check_reservation_bound,
    refuse_run_duration, request_valid_for, stored_scheduling,
)
from .vm import SandboxVM

log = logging.getLogger(__name__)


class Instance:
    def __init__(self, project: str, zone: str, name: str, resource: dict, image_dir: Path | None) -> None:
        self.project, self.zone, self.name = project, zone, name
        self.resource = resource
        self.image_dir = image_dir
        self.ip: str | None = None
        self.vm: SandboxVM | None = None
        self.deleting = False
        # The time limit (scheduling.maxRunDuration or terminationTime) and what happens then.
        self.run_duration: float | None = None  # seconds from each start (RUNNING)
        self.termination_time: float | None = None  # epoch seconds
        self.termination_action: str | None = None  # "DELETE" | "STOP"
        self.terminate_at: float | None = None  # epoch seconds; set while RUNNING with a limit
        self.published_host_key: tuple[str, str] | None = None  # host_key_mismatch: (type, base64)
        # first_boot_host_keys: the keys the guest attributes still show while the VM's are new.
        self.published_host_keys: list[tuple[str, str]] | None = None
        self.reservation: tuple[str, str, str] | None = None  # (project, zone, name) it consumes
        # Flex-start: the insert's params.requestValidForDuration (seconds; None if not given) and
        # the flex_start_wait fault it took (how long capacity takes to come, in seconds).
        self.request_valid_for: float | None = None
        self.capacity_wait: float | None = None
        self.expires_unserved = False  # flex_start_wait's "expires": the request ends at capacity_wait, unserved
        self.preempted = False  # preempted by the cloud (LocalCloud.preempt_vm)
        self.boot_disk_id = new_id()  # the boot disk's own id (an image's sourceDiskId)
        # Serialises the VM-side work of insert, setMetadata and delete on this instance.
        self.work_lock = threading.Lock()

    @property
    def path(self) -> str:
        return f"projects/{self.project}/zones/{self.zone}/instances/{self.name}"

    @property
    def fqdn(self) -> str:
        """The hostname the metadata server gives the guest: the instance's `hostname` if it was
        set, else NAME.ZONE.c.PROJECT.internal (zonal DNS, the vmDnsSetting projects.get reports;
        the discovery document's description of Instance.hostname)."""
        return self.resource.get("hostname") or f"{self.name}.{self.zone}.c.{self.project}.internal"

    @property
    def status(self) -> str:
        return self.resource["status"]


class InstanceResources(Operations):
    def __init__(self) -> None:
        super().__init__()
        self.instances: dict[tuple[str, str, str], Instance] = {}
        self.faults = Faults()
        self.leases = AddressLeases()

    def _instance(self, project: str, zone: str, name: str) -> Instance:
        inst = self.instances.get((project, zone, name))
        if inst is None:
            raise errors.not_found(f"projects/{project}/zones/{zone}/instances/{name}")
        return inst

    def _changeable_instance(self, project: str, zone: str, name: str) -> Instance:
        """The instance a mutating call acts on (under the lock): not one being deleted."""
        inst = self._instance(project, zone, name)
        if inst.deleting:
            raise errors.not_ready(inst.path)
        return inst

    def get_instance(self, project: str, zone: str, instance: str, req: Request) -> dict:
        with self.lock:
            return copy.deepcopy(self._instance(project, zone, instance).resource)

    def list_instances(self, project: str, zone: str, req: Request) -> dict:
        with self.lock:
            resources = [copy.deepcopy(i.resource) for i in self.instances.values() if (i.project, i.zone) == (project, zone)]
        return zonal_list("compute#instanceList", f"projects/{project}/zones/{zone}/instances", resources, req)

    def aggregated_list_instances(self, project: str, req: Request) -> dict:
        with self.lock:
            resources = [copy.deepcopy(i.resource) for i in self.instances.values() if i.project == project]
        return aggregated_list("compute#instanceAggregatedList", project, "instances", resources, req)

    def insert_instance(self, project: str, zone: str, req: Request) -> dict:
        body = validated_body(req, "compute.instances.insert", "Instance", "instance_resource")
        request_id = query_arg(req.query, "requestId")
        with self.lock:
            if replayed := self._replayed(project, request_id):
                return replayed
            name = body["name"]
            path = f"projects/{project}/zones/{zone}/instances/{name}"
            if (project, zone, name) in self.instances:
                raise errors.already_exists(path)
            resource, image_dir = self._new_instance_resource(project, zone, body)
            scheduling = resource["scheduling"]
            requested = body.get("scheduling") or {}
            refusal = self.faults.take(
                "max_run_duration_refused",
                lambda rule: requested.get("maxRunDuration") is not None
                and requested.get("provisioningModel", "STANDARD") in rule.get("provisioning_models", ["RESERVATION_BOUND"]),
                name=name,
            )
            if refusal is not None:  # a rule of no settings is {}
                refuse_run_duration(requested, refusal.get("provisioning_models", ["RESERVATION_BOUND"]))
            if rejection := self.faults.take("insert_rejected", name=name):
                raise self._insert_rejection(rejection, project, zone, body)
            try:
                reservation, refused = self.reservation_to_consume(project, zone, body, resource), None
            except ReservationRefused as refusal:  # the insert is accepted; its operation fails
                reservation, refused = None, {"preset": refusal.preset}
            inst = Instance(project, zone, name, resource, image_dir)
            inst.reservation = reservation
            if scheduling["provisioningModel"] == "FLEX_START":
                inst.request_valid_for = request_valid_for(body)
            inst.termination_action = scheduling.get("instanceTerminationAction")
            if "maxRunDuration" in scheduling:
                duration = scheduling["maxRunDuration"]
                inst.run_duration = int(duration["seconds"]) + duration.get("nanos", 0) / 1e9
            if "terminationTime" in scheduling:
                inst.termination_time = parse_rfc3339(scheduling["terminationTime"])
            inst.ip = self.leases.allocate()
            nic = resource["networkInterfaces"][0]
            nic["networkIP"] = inst.ip
            if nic.get("accessConfigs"):
                nic["accessConfigs"][0]["natIP"] = inst.ip
            self.instances[(project, zone, name)] = inst
            op = self._new_operation(inst, "insert", request_id)
            faults = InsertFaults(
                hang=self.faults.take("operation_hangs", name=name, operation="insert"),
                hang_epoch=self.faults.cleared("operation_hangs"),
                fail=refused
                or self.faults.take("insert_fails_after_accept")
                or self.faults.take("operation_errors", name=name, operation="insert"),
            )
            if faults.fail is None and scheduling["provisioningModel"] == "FLEX_START":
                if wait := self.faults.take("flex_start_wait", name=name):
                    inst.capacity_wait = wait["seconds"]
                    inst.expires_unserved = wait.get("expires", False)
                    if (inst.request_valid_for or 0) >= FLEX_START_MIN_PENDING_SECONDS:
                        # Waiting for capacity (instance life-cycle page, see scheduling.py).
                        resource["status"] = "PENDING"
            if faults.fail is None:
                faults.ssh_refused = self.faults.take("ssh_refused", name=name)
                faults.ssh_banner_timeout = self.faults.take("ssh_banner_timeout", name=name)
                faults.first_boot_host_keys = self.faults.take("first_boot_host_keys", name=name)
                if self.faults.take("host_key_mismatch", name=name) is not None:
                    inst.published_host_key = ("ssh-ed25519", unrelated_ed25519_key())
        self._spawn(self._run_insert, inst, op, faults)
        return copy.deepcopy(op)

    def _insert_rejection(self, rule: dict, project: str, zone: str, body: dict) -> ApiError:
        """insert_rejected's synchronous error: the preset's shape, with the rule's overrides."""
        preset = INSTANCE_ERRORS.get(rule.get("preset", ""))
        status = rule.get("status", preset.status if preset else 400)
        reason = rule.get("reason", preset.reason if preset else "invalid")
        message = rule.get("message") or (preset.message if preset else f"localcloud: injected insert rejection ({reason}).")
        return ApiError(
            status,
            reason,
            fill(message, **error_values(project, zone, body)),
            domain=preset.domain if preset and "reason" not in rule else None,
        )

    def _new_instance_resource(self, project: str, zone: str, body: dict) -> tuple[dict, Path | None]:
        """Semantic checks of an insert body, and the stored resource with GCE's own fields."""
        name = body["name"]
        machine_type = body.get("machineType")
        if not machine_type:
            raise errors.required_field("resource.machineType")
        m = re.fullmatch(r"(?:projects/[^/]+/)?zones/([^/]+)/machineTypes/([^/]+)", relative_url(machine_type))
        if not m:
            raise errors.invalid_field_value("resource.machineType", machine_type, "Must be a URL to a machine type resource.")
        if m.group(1) != zone:
            raise errors.invalid_field_value(
                "resource.machineType", machine_type, f"Machine type must be in zone '{zone}' like the instance."
            )
        machine_name = m.group(2)
        if not catalog.offers(zone, machine_name):
            raise errors.unknown_machine_type(machine_type, machine_name, zone)
        disks = body.get("disks")
        if not disks:
            raise errors.required_field("resource.disks")
        nics = body.get("networkInterfaces")
        if not nics:
            raise errors.required_field("resource.networkInterfaces")
        check_labels(body.get("labels") or {}, "resource.labels")
        check_metadata(body.get("metadata") or {}, "resource.metadata")

        boot_index = next((i for i, d in enumerate(disks) if d.get("boot")), 0)
        image_dir = self._resolve_boot_image(project, disks[boot_index], f"resource.disks[{boot_index}]")

        resource = copy.deepcopy(body)
        resource.pop("params", None)
        base = f"projects/{project}/zones/{zone}"
        metadata = body.get("metadata") or {}
        resource.update(
            kind="compute#instance",
            id=new_id(),
            creationTimestamp=now_rfc3339(),
            name=name,
            zone=Link(base),
            machineType=Link(f"{base}/machineTypes/{m.group(2)}"),
            status="PROVISIONING",
            selfLink=Link(f"{base}/instances/{name}"),
            cpuPlatform="Unknown CPU Platform",
            canIpForward=body.get("canIpForward", False),
            deletionProtection=body.get("deletionProtection", False),
            startRestricted=False,
            fingerprint=new_fingerprint(),
            labelFingerprint=new_fingerprint(),
            metadata=stored_metadata(metadata),
            tags={**(body.get("tags") or {}), "fingerprint": new_fingerprint()},
            scheduling=stored_scheduling(body.get("scheduling") or {}),
            reservationAffinity=body.get("reservationAffinity") or {"consumeReservationType": "ANY_RESERVATION"},
        )
        check_host_maintenance(machine_name, body.get("scheduling") or {}, resource["scheduling"])
        check_reservation_bound(resource["scheduling"], body.get("reservationAffinity") or {})
        check_capacity_model(
            body.get("scheduling") or {}, resource["scheduling"], body.get("reservationAffinity") or {}, body
        )
        for i, nic in enumerate(resource["networkInterfaces"]):
            network, subnet_path = self.nic_network(project, zone, i, nic)  # refused as the API does (networks.py)
            nic.update(
                kind="compute#networkInterface",
                name=f"nic{i}",
                network=Link(network),
                subnetwork=Link(subnet_path),
                fingerprint=new_fingerprint(),
                stackType=nic.get("stackType", "IPV4_ONLY"),
            )
            for access in nic.get("accessConfigs") or []:
                access.setdefault("type", "ONE_TO_ONE_NAT")
                access.setdefault("name", "External NAT")
                access.setdefault("networkTier", "PREMIUM")
                access["kind"] = "compute#accessConfig"
        for i, disk in enumerate(resource["disks"]):
            params = disk.get("initializeParams") or {}
            disk_name = params.get("diskName") or (name if i == boot_index else f"{name}-{i}")
            disk.update(
                kind="compute#attachedDisk",
                index=i,
                boot=i == boot_index,
                deviceName=disk.get("deviceName") or f"persistent-disk-{i}",
                source=Link(f"{base}/disks/{disk_name}") if not disk.get("source") else disk["source"],
                interface=disk.get("interface", "SCSI"),
                mode=disk.get("mode", "READ_WRITE"),
                type=disk.get("type", "PERSISTENT"),
                autoDelete=disk.get("autoDelete", False),
                diskSizeGb=str(params.get("diskSizeGb", "10")),
            )
            # Input-only fields are not returned (the discovery document marks AttachedDisk's
            # initializeParams and forceAttach "[Input Only]"; Instance.params likewise).
            disk.pop("initializeParams", None)
            disk.pop("forceAttach", None)
        return resource, image_dir

    def delete_instance(self, project: str, zone: str, instance: str, req: Request) -> dict:
        request_id = query_arg(req.query, "requestId")
        with self.lock:
            if replayed := self._replayed(project, request_id):
                return replayed
            inst = self._changeable_instance(project, zone, instance)
            if inst.resource.get("deletionProtection"):
                # "googleapi: Error 400: Invalid resource usage: 'Resource cannot be deleted if
                # it's protected against deletion.'., invalidResourceUsage"
                # (hashicorp/terraform-provider-google#1211).
                raise ApiError(
                    400,
                    "invalidResourceUsage",
                    "Invalid resource usage: 'Resource cannot be deleted if it's protected against deletion.'.",
                )
            previous_status = inst.status
            inst.deleting = True
            inst.resource["status"] = "STOPPING"
            self.changed.notify_all()  # a flex-start wait for capacity ends (lifecycle._wait_for_capacity)
            op = self._new_operation(inst, "delete", request_id)
            hang = self.faults.take("operation_hangs", name=inst.name, operation="delete")
            hang_epoch = self.faults.cleared("operation_hangs")
            fail = self.faults.take("operation_errors", name=inst.name, operation="delete")
        self._spawn(self._run_delete, inst, op, hang, hang_epoch, fail, previous_status)
        return copy.deepcopy(op)

    def stop_instance(self, project: str, zone: str, instance: str, req: Request) -> dict:
        """instances.stop (discovery document: "Stops a running instance, shutting it down cleanly,
        and allows you to restart the instance at a later time"): a zonal operation; the instance
        goes STOPPING, then TERMINATED once its processes are gone. Its disk and files stay (an
        image can be made of them), its internal IP too; the ephemeral external IP is released and
        a reservation unit is given back. Stopping a stopped instance is a no-op operation."""
        request_id = query_arg(req.query, "requestId")
        with self.changed:
            if replayed := self._replayed(project, request_id):
                return replayed
            inst = self._changeable_instance(project, zone, instance)
            op = self._new_operation(inst, "stop", request_id)
            stopping = inst.status != "TERMINATED"
            if stopping:
                self._begin_termination(inst, "STOP")
        self._spawn(self._run_stop, inst, op, stopping)
        return copy.deepcopy(op)

    def _new_operation(self, inst: Instance, operation_type: str, request_id: str | None) -> dict:
        """A zonal operation on instance `inst` (under the lock)."""
        return self._register_operation(
            inst.project, inst.zone, operation_type, inst.path, inst.resource["id"], request_id
        )

    def _spawn(self, target, inst: Instance, op: dict, *args) -> None:
        threading.Thread(target=self._run_worker, args=(target, inst, op, args), daemon=True).start()

    def _run_worker(self, target, inst: Instance, op: dict, args: tuple) -> None:
        try:
            target(inst, op, *args)
        except Exception as exc:
            # Never leave an operation hanging: clients poll it until DONE.
            log.exception("%s of %s failed", op["operationType"], inst.path)
            if op["status"] != "DONE":
                self._op_done(op, ("INTERNAL_ERROR", f"localcloud: {exc}"), 500)
