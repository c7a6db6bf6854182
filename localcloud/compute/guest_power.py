"""A power-off from inside a sandbox VM (`sudo -n shutdown -h now`, `poweroff`, `halt -p`).

On Compute Engine an OS shutdown in the guest stops the instance: STOPPING, then TERMINATED
("Stop or restart a Compute Engine instance" lists stopping "from the guest OS";
https://cloud.google.com/compute/docs/instances/instance-lifecycle). No Google document found
says the instance is deleted then, whatever `scheduling.instanceTerminationAction` says (that is
the action at the VM's time limit, "Limit the run time of a VM"), so this is modelled as a STOP.

A sandbox VM has no kernel of its own to power off, and its users are not root, so the guest side
is three shims in the read-only /run/localcloud mount (STATE_DIR/vm-etc/guest-bin), first on every
SSH session's PATH:
  - `sudo`: runs the command (as the calling user: nothing here makes anyone root) only for root
    and members of `google-sudoers`, the group the guest agent puts every `ssh-keys` user in and
    that /etc/sudoers.d/google_sudoers gives `ALL=(ALL:ALL) NOPASSWD:ALL` (guest-agent
    google_guest_agent/non_windows_accounts.go: createGoogleUser, createSudoersFile); anyone
    else gets sudo's "a password is required". Like sudo it marks what it runs with SUDO_USER/
    SUDO_UID.
  - `shutdown`, `poweroff`, `halt`: refuse a caller that is neither root nor under sudo ("must be
    superuser"); otherwise ask the emulator to power the VM off, through a Unix socket in the
    abstract namespace (VMs share the host's network namespace, so it is reachable, and no path
    length or mount matters).
The emulator decides from what the kernel says, not from what the shim claims: SO_PEERCRED gives
the caller's pid and uid; the pid's PID namespace names the VM, the uid must be root or a
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
SOCKET_FILE = "power-socket"  # the abstract socket's name, beside the shims

_SUDO = r"""#!/bin/bash
# localcloud's sudo (see localcloud/compute/guest_power.py): root and google-sudoers members run
# the command (as themselves: the sandbox has no root to give); everyone else is refused, as sudo
# refuses a user the sudoers files do not name.
non_interactive=no
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; break ;;
    -n|--non-interactive) non_interactive=yes; shift ;;
    -u|-g|-C|-D|-h|-p|-r|-t|-T|-U) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
if [ $# -eq 0 ]; then
  echo "usage: sudo [-n] command [arg ...]" >&2
  exit 1
fi
allowed=no
if [ "$(id -u)" = 0 ]; then
  allowed=yes
else
  for group in $(id -Gn); do
    [ "$group" = google-sudoers ] && allowed=yes
  done
fi
if [ "$allowed" != yes ]; then
  if [ "$non_interactive" = yes ]; then
    echo "sudo: a password is required" >&2
  else
    echo "sudo: a terminal is required to read the password; either use the -S option to read from standard input or configure an askpass helper" >&2
  fi
  exit 1
fi
export SUDO_USER="$(id -un)" SUDO_UID="$(id -u)" SUDO_GID="$(id -g)" SUDO_COMMAND="$*"
exec "$@"
"""

_POWER = r"""#!/usr/bin/python3
# localcloud's shutdown / poweroff / halt (see localcloud/compute/guest_power.py): a power-off of
# this VM, asked of the compute emulator. Reboot, delays and cancels are not modelled.
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
if os.geteuid() != 0 and "SUDO_UID" not in os.environ:
    print(f"{prog}: must be superuser.", file=sys.stderr)
    sys.exit(1)
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "power-socket")) as f:
    name = f.read().strip()
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect("\0" + name)
sock.sendall(b"poweroff\n")
answer = sock.makefile().readline().strip()
if answer != "ok":
    print(f"{prog}: {answer}", file=sys.stderr)
    sys.exit(1)
"""


def write_shims(vm_etc: Path, socket_name: str) -> Path:
    """The shims in STATE_DIR/vm-etc/guest-bin (seen read-only by every VM); returns that folder."""
    folder = vm_etc / SHIM_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SOCKET_FILE).write_text(socket_name + "\n")
    for name, text in (("sudo", _SUDO), ("shutdown", _POWER), ("poweroff", _POWER), ("halt", _POWER)):
        tmp = folder / f".{name}.tmp"
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, folder / name)
    return folder


def session_path(env: dict[str, str]) -> str:
    """The PATH a VM's SSH sessions get: the shims first, then the image's (or sshd's default)."""
    # Debian's sshd gives a user session this PATH when nothing sets one.
    rest = env.get("PATH") or "/usr/local/bin:/usr/bin:/bin:/usr/games"
    return f"{VM_SHIM_DIR}:{rest}"


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
