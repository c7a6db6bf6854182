"""What the guest agent of each VM does with metadata and publishes: instances.setMetadata (its
ssh-keys made users, guest.py), the account pass over instance and project metadata, and guest
attributes (getGuestAttributes: the VM's sshd host keys).

Owns: GuestAgent (no tables of its own: the instances' metadata lives in their resources).
Imports operations, instances (the Instance type), guest, disk_images, resources and errors.
"""

from __future__ import annotations

import copy

from . import errors
from .disk_images import skel
from .errors import ApiError
from .guest import GuestAccounts, metadata_value, os_login_enabled
from .instances import Instance
from .operations import Operations
from .resources import Link, Request, check_metadata, query_arg, stored_metadata, validated_body
from .vm import pid_namespace


class GuestAgent(Operations):
    def _apply_guest_accounts(self, inst: Instance) -> None:
        """The guest agent's account pass on `inst`'s VM, from its instance and project metadata.
        Also for a VM whose sshd has not started yet (ssh_refused) or that is stopped: the agent
        applies the keys when it runs."""
        with inst.work_lock:
            with self.lock:
                metadata = copy.deepcopy(inst.resource["metadata"])
                project_metadata = copy.deepcopy(self._project_metadata(inst.project))
            if inst.vm is not None and inst.vm.root.is_dir():
                GuestAccounts(inst.vm.root, skel(inst.image_dir)).apply_metadata(
                    metadata, project_metadata, self.os_login.accounts()
                )

    def _os_login_account_made(self, account: dict) -> None:
        """A new OS Login account: every VM with OS Login resolves it from now on (nss_oslogin asks
        the metadata server at each lookup), before the import's answer leaves."""
        with self.lock:
            instances = list(self.instances.values())
        for inst in instances:
            self._apply_guest_accounts(inst)

    def _os_login_user(self, pid: int, username: str) -> dict | None:
        """The metadata server's `oslogin/users?username=` answer for the VM of `pid` (its PID
        namespace names it): None (its 404) when the caller is in no VM, OS Login is off for that
        VM, or there is no such user (localcloud/oslogin/guest.py)."""
        pidns = pid_namespace(pid)
        with self.lock:
            found = [i for i in self.instances.values() if i.vm is not None and pidns and i.vm.pidns == pidns]
            if len(found) != 1:
                return None
            metadata = copy.deepcopy(found[0].resource["metadata"])
            project_metadata = copy.deepcopy(self._project_metadata(found[0].project))
        if not os_login_enabled(metadata, project_metadata):
            return None
        return self.os_login.guest_user(username)

    def set_metadata(self, project: str, zone: str, instance: str, req: Request) -> dict:
        body = validated_body(req, "compute.instances.setMetadata", "Metadata", "metadata_resource")
        request_id = query_arg(req.query, "requestId")
        with self.lock:
            if replayed := self._replayed(project, request_id):
                return replayed
            inst = self._changeable_instance(project, zone, instance)
            if body.get("fingerprint") != inst.resource["metadata"]["fingerprint"]:
                raise errors.fingerprint_mismatch()
            check_metadata(body, "resource")
            # The fingerprint changes at once, so a second writer with the old one gets 412.
            inst.resource["metadata"] = stored_metadata(body)
            op = self._new_operation(inst, "setMetadata", request_id)
        self._spawn(self._run_set_metadata, inst, op)
        return copy.deepcopy(op)

    def get_guest_attributes(self, project: str, zone: str, instance: str, req: Request) -> dict:
        with self.lock:
            inst = self._instance(project, zone, instance)
            enabled = (metadata_value(inst.resource["metadata"], "enable-guest-attributes") or "").strip().lower()
            vm = inst.vm if inst.status == "RUNNING" else None
        if enabled not in ("true", "1", "yes"):
            raise ApiError(400, "badRequest", "Guest Attributes are not enabled.")
        # What the guest agent publishes once the VM booted: its sshd host keys.
        keys = ([inst.published_host_key] if inst.published_host_key else vm.host_keys()) if vm else []
        attributes = [("hostkeys", kind, blob) for kind, blob in keys]
        variable_key = query_arg(req.query, "variableKey")
        self_link = f"{inst.path}/guestAttributes/"
        if variable_key:
            for namespace, key, value in attributes:
                if f"{namespace}/{key}" == variable_key.strip("/"):
                    return {
                        "kind": "compute#guestAttributes",
                        "variableKey": variable_key,
                        "variableValue": value,
                        "selfLink": Link(self_link + variable_key),
                    }
            raise errors.ApiError(
                404, "notFound", f"The resource '{variable_key}' of type 'Guest Attribute' was not found."
            )
        query_path = query_arg(req.query, "queryPath") or ""
        parts = [p for p in query_path.split("/") if p]
        items = [
            {"namespace": ns, "key": key, "value": value}
            for ns, key, value in attributes
            if parts == [] or parts == [ns] or parts == [ns, key]
        ]
        if not items:
            raise errors.ApiError(
                404, "notFound", f"The resource '{query_path}' of type 'Guest Attribute' was not found."
            )
        return {
            "kind": "compute#guestAttributes",
            "queryPath": query_path,
            "queryValue": {"items": items},
            "selfLink": Link(self_link + query_path),
        }

    def _run_set_metadata(self, inst: Instance, op: dict) -> None:
        self._op_running(op)
        self._apply_guest_accounts(inst)
        self._op_done(op)
