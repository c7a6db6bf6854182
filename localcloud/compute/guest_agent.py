"""What the guest agent of each VM does with metadata and publishes: instances.setMetadata (its
ssh-keys made users, guest.py), the account pass over instance and project metadata, guest
attributes (getGuestAttributes: the VM's sshd host keys), and the first-boot host key change of
the first_boot_host_keys fault.

Owns: GuestAgent (no tables of its own: the instances' metadata lives in their resources).
Imports operations, instances (the Instance type), guest, disk_images, resources and errors.
"""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import threading

from . import errors
from .disk_images import skel
from .errors import ApiError
from .guest import GuestAccounts, metadata_value, os_login_enabled
from .instances import Instance
from .operations import Operations
from .resources import Link, Request, check_metadata, query_arg, stored_metadata, validated_body
from .vm import HOST_KEY_TYPES, SandboxVM, pid_namespace

log = logging.getLogger(__name__)


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
        if vm is None:
            keys = []
        elif inst.published_host_key:
            keys = [inst.published_host_key]
        elif inst.published_host_keys is not None:  # first_boot_host_keys: not republished yet
            keys = list(inst.published_host_keys)
        else:
            keys = vm.host_keys()
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

    # ----- the first_boot_host_keys fault -----
    #
    # What can change a new VM's host keys during its first boot, and in which order:
    # - cloud-init's ssh module (cloudinit/config/cc_ssh.py, frequency PER_INSTANCE) deletes the
    #   image's /etc/ssh/ssh_host_*key* (`ssh_deletekeys`, default true), generates one key of each
    #   `ssh_genkeytypes` type with ssh-keygen, and publishes the public keys through its datasource
    #   (`ssh_publish_hostkeys`, enabled by default; on GCE: guest attributes hostkeys/). It runs in
    #   cloud-init's early stage, before sshd starts: these are the keys a VM first serves (here,
    #   the keys SandboxVM.prepare makes before sshd starts, published at once).
    # - google-guest-agent (google_guest_agent/instance_setup.go, agentInit) compares the metadata
    #   server's instance id with /etc/google_instance_id; when they differ ("Instance ID changed,
    #   running first-boot actions") and InstanceSetup.set_host_keys is on (the default), its
    #   generateSSHKeys makes a new key for every type on disk and in host_key_types (default
    #   ecdsa,ed25519,rsa): ssh-keygen into ssh_host_TYPE_key.temp, renamed over the key files,
    #   then each public key written to the guest attribute hostkeys/TYPE. It does not restart
    #   sshd. agentInit runs when the agent starts, before its metadata watch that creates users
    #   from ssh-keys (google_guest_agent/main.go, run).
    # So a client can meet: the old keys published and served; the new ones served while the old
    # are still published (a mismatch); then the new ones published. Modelled here all types at
    # once (the agent goes type by type, in a map's order), `publish_after` seconds apart; the
    # users of the ssh-keys metadata are made after that, as the agent's metadata watch comes
    # after agentInit (until then sshd refuses their login).

    def _first_boot_host_keys(self, inst: Instance, vm: SandboxVM, rule: dict, since: float) -> None:
        """Start the guest agent's first-boot key change of `inst`'s new VM, RUNNING since `since`."""
        with self.lock:
            inst.published_host_keys = vm.host_keys()  # cloud-init's, published before sshd started
        threading.Thread(
            target=self._change_host_keys, args=(inst, vm, rule["seconds"], rule.get("publish_after", 1), since),
            daemon=True,
        ).start()

    def _change_host_keys(self, inst: Instance, vm: SandboxVM, after: float, publish_after: float, since: float) -> None:
        try:
            if not self._wait_while_current(inst, vm, since + after):
                return
            with inst.work_lock:
                with self.lock:
                    if not self._current(inst, vm):
                        return
                ssh = vm.root / "etc-ssh"
                for kind in HOST_KEY_TYPES:
                    temp = ssh / f"ssh_host_{kind}_key.temp"
                    for stale in (temp, temp.with_name(temp.name + ".pub")):
                        stale.unlink(missing_ok=True)
                    # 1024-bit rsa, as SandboxVM.prepare makes it (its comment says why).
                    subprocess.run(
                        ["ssh-keygen", "-q", "-t", kind, *(["-b", "1024"] if kind == "rsa" else []), "-N", "",
                         "-C", f"root@{vm.name}", "-f", str(temp)],
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=True,
                    )
                    os.chmod(temp, 0o600)
                    os.replace(temp, ssh / f"ssh_host_{kind}_key")
                    os.replace(temp.with_name(temp.name + ".pub"), ssh / f"ssh_host_{kind}_key.pub")
            log.info("first boot of %s: new host keys served, published in %s s", inst.path, publish_after)
            self._wait_while_current(inst, vm, since + after + publish_after)
            with self.lock:
                inst.published_host_keys = None  # the guest attributes show the VM's keys again
            self._apply_guest_accounts(inst)  # the agent's metadata watch, after agentInit
        except Exception:
            log.exception("first-boot host key change of %s failed", inst.path)
