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
import logging
import os
import socket
import struct
import threading
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

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


class KeysListener:
    """Serves the shims' `users USERNAME` requests: `lookup(pid, username)` gives the metadata
    server's answer for the VM of `pid` (a dict), or None for its 404. The accept loop blocks in
    the kernel (no polling)."""

    def __init__(self, lookup: Callable[[int, str], dict | None]) -> None:
        self.lookup = lookup
        self.name = f"localcloud-oslogin-{os.getpid()}-{os.urandom(6).hex()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind("\0" + self.name)
        self.sock.listen(64)
        self.closed = False
        threading.Thread(target=self._serve, name="oslogin-keys", daemon=True).start()

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self.sock.close()

    def _serve(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(10)
                pid, _uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
                verb, _, username = conn.makefile().readline().strip().partition(" ")
                answer = self.lookup(pid, username) if verb == "users" else None
                conn.sendall((json.dumps(answer) if answer is not None else "404").encode() + b"\n")
            except Exception:
                log.exception("OS Login keys request failed")
