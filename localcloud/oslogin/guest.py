"""The VM side of OS Login: sshd asks for a user's keys, as a Compute Engine image with OS Login does.

With OS Login enabled the guest agent sets sshd's `AuthorizedKeysCommand /usr/bin/google_authorized_keys`
and `AuthorizedKeysCommandUser root` (google-guest-agent, oslogin.go updateSSHConfig;
GoogleCloudPlatform/guest-oslogin). That program asks the metadata server for the user's login
profile (`oslogin/users?username=USER`: 404 when OS Login is not enabled for the VM) and prints the
profile's keys, skipping each whose `expirationTimeUsec` is in the past (oslogin_utils.cc
ParseJsonToSshKeys, authorized_keys.cc). sshd then accepts only a key printed: an expired key's
login is refused like any unknown key's.

Here the program is a shim in the read-only /run/localcloud mount (STATE_DIR/vm-etc/guest-bin,
beside guest_power.py's) that sshd runs as root; it asks the compute emulator over a Unix socket
in the abstract namespace (VMs share the host's network namespace). The emulator decides from
what the kernel says: SO_PEERCRED's pid names the VM by its PID namespace, and that VM's
metadata says whether OS Login is on. Every sandbox VM's sshd_config names the shim (vm.py): with
OS Login off the emulator answers "not found" and the shim prints nothing, as a VM without the
directive reads only ~/.ssh/authorized_keys.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from ..guest_socket import ShimListener

SHIM_NAME = "google_authorized_keys"
SOCKET_FILE = "oslogin-socket"  # the abstract socket's name, beside the shim

_AUTHORIZED_KEYS = r"""#!/usr/bin/python3
# localcloud's google_authorized_keys (see localcloud/oslogin/guest.py): the OS Login keys of the
# user sshd names, those whose expiry has not passed, one per line.
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
    tmp = folder / f".{SHIM_NAME}.tmp"
    tmp.write_text(_AUTHORIZED_KEYS)
    tmp.chmod(0o755)
    os.replace(tmp, folder / SHIM_NAME)
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
