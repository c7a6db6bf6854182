"""The first boot of a sandbox VM: as unkind as a freshly booted Ubuntu cloud image's.

On a fresh Ubuntu cloud image cloud-init is still running when sshd already answers (its
modules-final stage ends the boot; `cloud-init status --wait` blocks until then: cloud-init's
docs, "Reported status"), and the apt-daily / apt-daily-upgrade jobs run unattended-upgrades,
which holds dpkg's lock for minutes: an `apt-get install` then fails with "Could not get lock
/var/lib/dpkg/lock-frontend. It is held by process N (unattended-upgr)" (ansible/ansible#51663,
servo/ci-runners#57). A VM of the local cloud boots the same way when its emulator is given a
first boot (`FirstBoot`): for `cloud_init_seconds` cloud-init reports "running", and for
`dpkg_lock_seconds` a root process of the VM named as unattended-upgrades' (`unattended-upgr`)
holds dpkg's frontend and admin locks. Both live in the VM's PID namespace, so they die with it.
The default is none (0 and 0): the toy paths boot at once, and a test that turns it on says why.

What the VM runs for this is in guest_os/ (installed in STATE_DIR/vm-etc/guest-os, seen read-only
at /run/localcloud/guest-os in every VM, and overlaid on the VM's /usr/bin and /usr/sbin by vm.py's
boot script): cloud-init (status, and the boot's status files), apt-get and apt (apt 2.4's locks,
messages and conffile question; they fetch and install nothing, so the host's packages never
change), unattended-upgrade (the lock holder), and guest_power.py's shutdown, poweroff and halt.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from . import guest_power

GUEST_OS_DIR = "guest-os"  # under vm-etc: /run/localcloud/guest-os in every VM
SOURCES = Path(__file__).resolve().parent / "guest_os"
# The VM's /usr/bin layer: each name and the program behind it.
USR_BIN = {"apt-get": "apt.py", "apt": "apt.py", "unattended-upgrade": "apt.py", "cloud-init": "cloud_init.py"}


@dataclass(frozen=True)
class FirstBoot:
    """Seconds after a VM's boot during which cloud-init is running and the dpkg lock is held."""

    cloud_init_seconds: float = 0.0
    dpkg_lock_seconds: float = 0.0

    def __post_init__(self) -> None:
        for value in (self.cloud_init_seconds, self.dpkg_lock_seconds):
            if not 0 <= value <= 3600:
                raise ValueError(f"a first boot's seconds must be within 0..3600, not {value}")

    @property
    def boot_args(self) -> tuple[float, float]:
        return (self.cloud_init_seconds, self.dpkg_lock_seconds)


def install_guest_os(vm_etc: Path, power_socket_name: str) -> Path:
    """Write the VM programs into STATE_DIR/vm-etc/guest-os/usr-bin and usr-sbin; returns guest-os."""
    root = vm_etc / GUEST_OS_DIR
    usr_bin = root / "usr-bin"
    usr_bin.mkdir(parents=True, exist_ok=True)
    for name, source in USR_BIN.items():
        tmp = usr_bin / f".{name}.tmp"
        tmp.write_text((SOURCES / source).read_text())
        tmp.chmod(0o755)
        os.replace(tmp, usr_bin / name)
    guest_power.write_shims(vm_etc, power_socket_name, root / "usr-sbin")
    return root
