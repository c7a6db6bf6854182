"""A power-off from inside a sandbox VM (`sudo -n shutdown -h now`, `poweroff`, `halt -p`).

On Compute Engine an OS shutdown in the guest stops the instance: STOPPING, then TERMINATED
("Stop or restart a Compute Engine instance" lists stopping "from the guest OS";
https://cloud.google.com/compute/docs/instances/instance-lifecycle). No Google document found
says the instance is deleted then, whatever `scheduling.instanceTerminationAction` says (that is
the action at the VM's time limit, "Limit the run time of a VM"), so this is modelled as a STOP.

A sandbox VM has no kernel of its own to power off. Its users get real root through Debian's
sudo (the VM's /etc/sudoers.d holds the guest agent's google_sudoers, guest.py), so the guest side
is `shutdown`, `poweroff` and `halt` in the read-only overlay over the VM's /usr/sbin (vm.py's boot
script; sudo's secure_path finds /usr/sbin, not a user's PATH): they refuse a caller that is not
root ("must be superuser"), otherwise ask the emulator to power the VM off, through a Unix socket
in the abstract namespace (VMs share the host's network namespace, so it is reachable, and no path
length or mount matters). The socket's name is in /run/localcloud/guest-bin/power-socket.
The emulator decides from what the kernel says, not from what the program claims: SO_PEERCRED
gives the caller's pid and uid; the pid's PID namespace names the VM, the uid must be root or a
google-sudoers member in that VM's own /etc/passwd and /etc/group. The product code sees only
`sudo` and `shutdown`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from ..guest_socket import ShimListener
from .guest import SUDOERS_GROUP, read_table

SHIM_DIR = "guest-bin"  # under vm-etc, so /run/localcloud/guest-bin in every VM
VM_SHIM_DIR = f"/run/localcloud/{SHIM_DIR}"
SOCKET_FILE = "power-socket"  # the abstract socket's name, in SHIM_DIR
POWER_PROGRAMS = ("shutdown", "poweroff", "halt")  # in the VM's /usr/sbin layer (first_boot.py)

_POWER = r"""#!/usr/bin/python3
# localcloud's shutdown / poweroff / halt (see localcloud/compute/guest_power.py): a power-off of
# this VM, asked of the compute emulator, for root only. Reboot, delays and cancels are not modelled.
import os, socket, sys

prog = os.path.basename(sys.argv[0])
args = sys.argv[1:]
if prog == "shutdown":
    words = [a for a in args if a not in ("-h", "-P", "--poweroff", "--halt", "--no-wall")]
    ok = words in ([], ["now"], ["+0"])
elif prog == "poweroff":
    ok = all(a in ("-f", "--force", "--no-wall") for a in args)
else:  # halt powers off only with -p
    ok = "-p" in args or "--poweroff" in args
if not ok:
    print(f"{prog}: localcloud models only an immediate power-off ({prog} {' '.join(args)})", file=sys.stderr)
    sys.exit(1)
if os.geteuid() != 0:
    print(f"{prog}: must be superuser.", file=sys.stderr)
    sys.exit(1)
with open("/run/localcloud/guest-bin/power-socket") as f:
    name = f.read().strip()
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect("\0" + name)
sock.sendall(b"poweroff\n")
answer = sock.makefile().readline().strip()
if answer != "ok":
    print(f"{prog}: {answer}", file=sys.stderr)
    sys.exit(1)
"""


def write_shims(vm_etc: Path, socket_name: str, sbin: Path) -> None:
    """The power-off programs in `sbin` (the VM's /usr/sbin layer) and the socket's name in
    STATE_DIR/vm-etc/guest-bin (seen read-only by every VM)."""
    folder = vm_etc / SHIM_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SOCKET_FILE).write_text(socket_name + "\n")
    sbin.mkdir(parents=True, exist_ok=True)
    for name in POWER_PROGRAMS:
        tmp = sbin / f".{name}.tmp"
        tmp.write_text(_POWER)
        tmp.chmod(0o755)
        os.replace(tmp, sbin / name)


def session_path(env: dict[str, str]) -> str:
    """The PATH a VM's SSH sessions get: the image's, or sshd's default."""
    # Debian's sshd gives a user session this PATH when nothing sets one.
    return env.get("PATH") or "/usr/local/bin:/usr/bin:/bin:/usr/games"


def may_power_off(vm_etc_dir: Path, uid: int) -> bool:
    """Root, or a member of google-sudoers (by the group's member list or as primary group), in the
    VM's own account files."""
    if uid == 0:
        return True
    try:
        passwd = read_table(vm_etc_dir / "passwd")
        group = read_table(vm_etc_dir / "group")
    except OSError:
        return False
    user = next((fields for fields in passwd.values() if len(fields) > 3 and fields[2] == str(uid)), None)
    sudoers = group.get(SUDOERS_GROUP)
    if user is None or sudoers is None or len(sudoers) < 4:
        return False
    return user[0] in sudoers[3].split(",") or user[3] == sudoers[2]


class PowerListener(ShimListener):
    """Serves the shims' requests. `handle(pid, uid)` decides one: (None, then) accepts it, and
    `then()` runs once the shim has its answer (the power-off kills the shim too); (reason, None)
    refuses it."""

    def __init__(self, handle: Callable[[int, int], tuple[str | None, Callable[[], None] | None]]) -> None:
        self.handle = handle
        super().__init__("guest-power")

    def answer(self, pid: int, uid: int, request: str) -> tuple[str, Callable[[], None] | None]:
        if request != "poweroff":
            return "unknown request", None
        refused, then = self.handle(pid, uid)
        return refused or "ok", then
