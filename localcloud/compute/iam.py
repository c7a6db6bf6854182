"""IAM as Compute Engine checks a call: the permissions each REST method needs, checked against
the permissions bound to the caller, when a binding names the caller (a service account whose
token the token endpoint issued, localcloud/iap/tokens.py). A caller no binding names is not
checked (the tests' own inspecting clients, anonymous).

Sources: each method's "IAM Permissions" section of the Compute Engine v1 REST reference
(cloud.google.com/compute/docs/reference/rest/v1/RESOURCE/METHOD: e.g. instances.get requires
compute.instances.get, zoneOperations.wait compute.zoneOperations.get, images.getFromFamily
compute.images.getFromFamily, instanceGroupManagers.listManagedInstances
compute.instanceGroupManagers.get); for instances.insert, what the body's fields add, from "Create
and start a Compute Engine instance", Required permissions (a new boot disk
compute.disks.create, its image compute.images.useReadOnly, a VPC network's subnetwork
compute.subnetworks.use and with an external IP compute.subnetworks.useExternalIp, metadata
compute.instances.setMetadata, tags compute.instances.setTags, labels compute.instances.setLabels,
a service account compute.instances.setServiceAccount and iam.serviceAccounts.actAs on it); for
images.insert from a disk, compute.disks.useReadOnly (images.insert's reference); for an instance
group manager, compute.instanceTemplates.useReadOnly on its template (instanceGroupManagers.insert's).

The refusal is the API's 403 in the words public captures show: "Required
'compute.instances.create' permission for 'projects/P/zones/Z/instances/NAME'", reason
forbidden (gcloud's "Could not fetch resource" output and Terraform's "googleapi: Error 403:
Required '...' permission for '...', forbidden", quoted in many public issues and tests).
"""

from __future__ import annotations

import threading

from .errors import ApiError

# Handler (server.ROUTES) -> the permission the method needs.
METHOD_PERMISSIONS: dict[str, str] = {
    "get_project": "compute.projects.get",
    "set_common_instance_metadata": "compute.projects.setCommonInstanceMetadata",
    "get_zone": "compute.zones.get",
    "list_instances": "compute.instances.list",
    "aggregated_list_instances": "compute.instances.list",
    "insert_instance": "compute.instances.create",
    "get_instance": "compute.instances.get",
    "delete_instance": "compute.instances.delete",
    "set_metadata": "compute.instances.setMetadata",
    "stop_instance": "compute.instances.stop",
    "get_guest_attributes": "compute.instances.getGuestAttributes",
    "list_images": "compute.images.list",
    "insert_image": "compute.images.create",
    "get_image_from_family": "compute.images.getFromFamily",
    "get_image": "compute.images.get",
    "delete_image": "compute.images.delete",
    "list_reservations": "compute.reservations.list",
    "aggregated_list_reservations": "compute.reservations.list",
    "get_reservation": "compute.reservations.get",
    "get_network": "compute.networks.get",
    "get_subnetwork": "compute.subnetworks.get",
    "list_operations": "compute.zoneOperations.list",
    "aggregated_list_operations": "compute.globalOperations.list",
    "list_global_operations": "compute.globalOperations.list",
    "get_global_operation": "compute.globalOperations.get",
    "wait_global_operation": "compute.globalOperations.get",
    "get_operation": "compute.zoneOperations.get",
    "wait_operation": "compute.zoneOperations.get",
    "get_region_operation": "compute.regionOperations.get",
    "wait_region_operation": "compute.regionOperations.get",
    "insert_resource_policy": "compute.resourcePolicies.create",
    "get_resource_policy": "compute.resourcePolicies.get",
    "delete_resource_policy": "compute.resourcePolicies.delete",
    "insert_global_template": "compute.instanceTemplates.create",
    "get_global_template": "compute.instanceTemplates.get",
    "delete_global_template": "compute.instanceTemplates.delete",
    "insert_region_template": "compute.instanceTemplates.create",
    "get_region_template": "compute.instanceTemplates.get",
    "delete_region_template": "compute.instanceTemplates.delete",
    "insert_group": "compute.instanceGroupManagers.create",
    "get_group": "compute.instanceGroupManagers.get",
    "delete_group": "compute.instanceGroupManagers.delete",
    "list_managed_instances": "compute.instanceGroupManagers.get",
    "list_autoscalers": "compute.autoscalers.list",
}


def insert_permissions(body: object) -> list[str]:
    """What an instances.insert body's fields add to compute.instances.create."""
    body = body if isinstance(body, dict) else {}
    needed = []
    for disk in body.get("disks") or []:
        params = disk.get("initializeParams") if isinstance(disk, dict) else None
        if isinstance(params, dict):
            needed.append("compute.disks.create")
            if params.get("sourceImage"):
                needed.append("compute.images.useReadOnly")
    for nic in body.get("networkInterfaces") or []:
        if isinstance(nic, dict):
            needed.append("compute.subnetworks.use")
            if nic.get("accessConfigs"):
                needed.append("compute.subnetworks.useExternalIp")
    if (body.get("metadata") or {}).get("items"):
        needed.append("compute.instances.setMetadata")
    if (body.get("tags") or {}).get("items"):
        needed.append("compute.instances.setTags")
    if body.get("labels"):
        needed.append("compute.instances.setLabels")
    if body.get("serviceAccounts"):
        needed += ["compute.instances.setServiceAccount", "iam.serviceAccounts.actAs"]
    return needed


def required_permissions(handler: str, body: object) -> list[str]:
    """Every permission a call of `handler` with `body` needs, the method's own first."""
    needed = [METHOD_PERMISSIONS[handler]] if handler in METHOD_PERMISSIONS else []
    body = body if isinstance(body, dict) else {}
    if handler == "insert_instance":
        needed += insert_permissions(body)
    elif handler == "insert_image" and body.get("sourceDisk"):
        needed.append("compute.disks.useReadOnly")
    elif handler == "insert_group" and body.get("instanceTemplate"):
        needed.append("compute.instanceTemplates.useReadOnly")
    return list(dict.fromkeys(needed))


class Bindings:
    """Which permissions each bound member (`serviceAccount:EMAIL`) holds on this cloud's projects."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._members: dict[str, frozenset[str]] = {}

    def bind(self, member: str, permissions: list[str] | None) -> dict:
        """Bind `member` to exactly `permissions` (None: unbind, no longer checked)."""
        with self._lock:
            if permissions is None:
                self._members.pop(member, None)
            else:
                self._members[member] = frozenset(permissions)
            return {"member": member, "permissions": sorted(self._members.get(member, ()))}

    def check(self, email: str | None, handler: str, body: object, resource: str) -> None:
        """Raise the API's 403 for the first permission `email` lacks, when a binding names it."""
        if email is None:
            return
        with self._lock:
            held = self._members.get(f"serviceAccount:{email}")
        if held is None:
            return
        for permission in required_permissions(handler, body):
            if permission not in held:
                raise ApiError(403, "forbidden", f"Required '{permission}' permission for '{resource}'")
