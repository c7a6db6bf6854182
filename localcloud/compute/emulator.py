"""Compute Engine REST API v1 emulator (the subset the project uses), over plain HTTP (server.py).

Resources live in memory; each instance's VM is a real sshd (see vm.py). Work is
asynchronous like the real API: mutating calls answer with a zonal Operation at once and a
worker thread carries it to DONE. Links in responses use the request's own scheme and host.

ComputeEmulator is one object made of one mixin per resource family, each in its own module
with its own tables, all over one lock (core.py):
- operations: zonal, regional and global operations
- projects: projects (commonInstanceMetadata) and zones
- instances: instances through the API, with their faults (faults.py) and addresses (leases.py)
- lifecycle: the VMs behind the instances, time limits, the cloud's own terminations
- guest_agent: instances.setMetadata, the guest agent's accounts, guest attributes
- reservations: reservations and what an instance consumes of one
- images: custom images made from a boot disk, and the boot image of an insert
- groups: multi-host TPU slices (resource policies, instance templates, managed instance groups)
A family calls another's methods through the emulator (`self`), never by importing its module
(but for a type, an exception or a constant of a module below it), so the modules import each
other in one direction only.

Owns: ComputeEmulator (its settings, request log and background work). Imports the family
modules and guest_power; imported by server.py, __main__ and tests.
"""

from __future__ import annotations

import threading
from pathlib import Path

from .._daemon import RequestLog
from ..iap.relay import TunnelPolicy
from ..iap.tokens import TokenIssuer
from ..oslogin import guest as os_login_guest
from ..oslogin.store import OsLoginStore
from . import guest_power
from .errors import ApiError
from .first_boot import FirstBoot, install_guest_os
from .groups import SliceResources
from .guest_agent import GuestAgent
from .iam import Bindings
from .images import ImageResources
from .instances import InstanceResources
from .lifecycle import InstanceLifecycle
from .projects import ProjectResources
from .networks import NetworkResources
from .reservations import ReservationResources


class ComputeEmulator(
    ProjectResources,
    InstanceResources,
    InstanceLifecycle,
    GuestAgent,
    ReservationResources,
    NetworkResources,
    ImageResources,
    SliceResources,
):
    def __init__(
        self,
        state_dir: Path,
        images: dict[str, Path] | None = None,
        *,
        operation_wait_timeout: float = 120.0,
        vm_ready_timeout: float = 30.0,
        keep_deleted_shm: bool = False,
        vm_env: dict[str, str] | None = None,
        first_boot: FirstBoot | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.first_boot = first_boot or FirstBoot()
        self.keep_deleted_shm = keep_deleted_shm
        self.vm_env = dict(vm_env or {})
        self.images = {k: Path(v) for k, v in (images or {}).items()}
        self.operation_wait_timeout = operation_wait_timeout
        self.vm_ready_timeout = vm_ready_timeout
        super().__init__()  # each family's tables (operations, instances, reservations, ...)
        self.request_log = RequestLog(state_dir / "compute-requests.jsonl")
        (state_dir / "vm-etc").mkdir(parents=True, exist_ok=True)
        (state_dir / "vms").mkdir(parents=True, exist_ok=True)
        (state_dir / "images").mkdir(parents=True, exist_ok=True)
        # Enforces VM time limits (scheduling.maxRunDuration / terminationTime).
        threading.Thread(target=self._time_limit_loop, name="time-limits", daemon=True).start()
        # A power-off from inside a VM (`sudo shutdown -h now`) stops its instance (guest_power.py).
        self.guest_power = guest_power.PowerListener(self._guest_power_off)
        # ... through the VM's own shutdown, beside its apt-get, apt and cloud-init (first_boot.py).
        install_guest_os(state_dir / "vm-etc", self.guest_power.name)

        # The OS Login API (localcloud/oslogin), served beside this one: a new POSIX account
        # resolves on the VMs with OS Login at once, and their sshd asks for its keys.
        self.os_login = OsLoginStore(on_new_account=self._os_login_account_made)
        self.os_login_request_log = RequestLog(state_dir / "oslogin-requests.jsonl")
        self.os_login_keys = os_login_guest.KeysListener(self._os_login_user)
        os_login_guest.write_shim(state_dir / "vm-etc", self.os_login_keys.name, guest_power.SHIM_DIR)

        # Service-account keys' tokens and IAP's TCP forwarding (localcloud/iap): the relay runs
        # beside this server (__main__) and reaches the instances by their internal address.
        self.tokens = TokenIssuer()
        self.iam = Bindings()  # the permissions of bound callers (iam.py), checked on every API call
        self.iap_policy = TunnelPolicy()
        self.iap_request_log = RequestLog(state_dir / "iap-requests.jsonl")

    def iap_backend(self, project: str, zone: str, name: str) -> str | None:
        """The internal address IAP forwards to: a RUNNING instance's; None for any other."""
        with self.lock:
            inst = self.instances.get((project, zone, name))
            return inst.ip if inst is not None and inst.status == "RUNNING" and not inst.deleting else None

    def set_first_boot(self, body: object) -> dict:
        """The control call: what the boots of VMs made from now on go through (first_boot.py)."""
        fields = ("cloud_init_seconds", "dpkg_lock_seconds")
        if not isinstance(body, dict) or set(body) - set(fields) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in body.values()
        ):
            raise ApiError(400, "invalid", 'Expected {"cloud_init_seconds": S, "dpkg_lock_seconds": S}.')
        try:
            first_boot = FirstBoot(**body)
        except ValueError as exc:
            raise ApiError(400, "invalid", str(exc)) from None
        with self.lock:
            self.first_boot = first_boot
        return {name: getattr(first_boot, name) for name in fields}
