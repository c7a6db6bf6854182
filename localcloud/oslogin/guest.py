"""The VM side of OS Login: sshd asks for a user's keys, as a Compute Engine image with OS Login does.

With OS Login enabled the guest agent sets sshd's `AuthorizedKeysCommand /usr/bin/google_authorized_keys`
and `AuthorizedKeysCommandUser root` (google-guest-agent, oslogin.go updateSSHConfig;
GoogleCloudPlatform/guest-oslogin). That program asks the metadata server for the user's login
profile (`oslogin/users?username=USER`: 404 when OS Login is not enabled for the VM) and prints the
profile's keys, skipping each whose `expirationTimeUsec` is in the past (oslogin_utils.cc
ParseJsonToSshKeys, authorized_keys.cc). sshd then accepts only a key printed: an expired key's
login is refused like any unknown key's.

Here the program is a shim in the read-only /run/localcloud mount (STATE_DIR/vm-etc/guest-bin,
beside guest_power.py's) that sshd runs as root. Every sandbox VM's sshd_config names it (vm.py),
so the guest agent's part is a switch instead of an sshd_config edit: the file OS_LOGIN_SWITCH in
the VM's /etc/ssh while OS Login is on for it (compute/guest.py). Without it the shim prints
nothing at once (a plain shell test: sshd runs the command at every login, on every VM), as a VM
without the directive reads only ~/.ssh/authorized_keys. With it, the shim's Python part asks the
compute emulator over a Unix socket in the abstract namespace (VMs share the host's network
namespace); the emulator decides from what the kernel says (SO_PEERCRED's pid names the VM by its
PID namespace) and from that VM's metadata, and answers as the metadata server does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from ..guest_socket import ShimListener

SHIM_NAME = "google_authorized_keys"
SOCKET_FILE = "oslogin-socket"  # the abstract socket's name, beside the shim
OS_LOGIN_SWITCH = "localcloud-oslogin"  # in a VM's /etc/ssh while OS Login is on for it

_AUTHORIZED_KEYS = f"""#!/bin/sh
# localcloud's google_authorized_keys (see localcloud/oslogin/guest.py): nothing while OS Login is
# off for this VM, else the OS Login keys of the user sshd names whose expiry has not passed.
[ -e /etc/ssh/{OS_LOGIN_SWITCH} ] || exit 0
exec /usr/bin/python3 -I "$(dirname "$0")/{SHIM_NAME}.py" "$@"
"""

_AUTHORIZED_KEYS_PY = r"""# localcloud's google_authorized_keys, its part that asks the compute emulator (see
# localcloud/oslogin/guest.py): the user's profile keys whose expiry has not passed, one per line.
import json, os, re, socket, sys, time

if len(sys.argv) != 2:
    print("usage: google_authorized_keys [username]", file=sys.stderr)
    sys.exit(1)
user = sys.argv[1]
if not re.fullmatch(r"[a-zA-Z0-9._][a-zA-Z0-9._-]{0,31}", user):
    sys.exit(0)
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "oslogin-socket")) as f:
    name = f.read().strip()
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(5)
sock.connect("\0" + name)
sock.sendall(("users " + user + "\n").encode())
answer = sock.makefile().readline().strip()
if not answer.startswith("{"):
    sys.exit(0)  # not found: OS Login is off for this VM, or no such user
profiles = json.loads(answer).get("loginProfiles") or [{}]
now_usec = time.time_ns() // 1000
for entry in (profiles[0].get("sshPublicKeys") or {}).values():
    key, expiry = entry.get("key"), entry.get("expirationTimeUsec")
    if key and (expiry is None or now_usec <= int(expiry)):
        print(key)
"""


def write_shim(vm_etc: Path, socket_name: str, shim_dir: str) -> Path:
    """The shim in STATE_DIR/vm-etc/SHIM_DIR (root's, 0755: sshd refuses an AuthorizedKeysCommand
    that another user could change, and checks every folder above it the same way)."""
    folder = vm_etc / shim_dir
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SOCKET_FILE).write_text(socket_name + "\n")
    for name, text in ((f"{SHIM_NAME}.py", _AUTHORIZED_KEYS_PY), (SHIM_NAME, _AUTHORIZED_KEYS)):
        tmp = folder / f".{name}.tmp"
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, folder / name)
    return folder / SHIM_NAME


class KeysListener(ShimListener):
    """Serves the shims' `users USERNAME` requests: `lookup(pid, username)` gives the metadata
    server's answer for the VM of `pid` (a dict), or None for its 404."""

    def __init__(self, lookup: Callable[[int, str], dict | None]) -> None:
        self.lookup = lookup
        super().__init__("oslogin-keys")

    def answer(self, pid: int, uid: int, request: str) -> tuple[str, None]:
        verb, _, username = request.partition(" ")
        found = self.lookup(pid, username) if verb == "users" else None
        return (json.dumps(found) if found is not None else "404"), None
