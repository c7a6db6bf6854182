"""VM addresses: each VM's loopback address (127.0.0.N, its sshd on port 22), leased machine-wide.

Owns: LEASE_DIR, VM_ADDRESSES, NEVER_LEASED and AddressLeases (one emulator's leases). The
functions here read LEASE_DIR when called, so a test that patches `leases.LEASE_DIR` moves
every lease. Imports errors only.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from .errors import ApiError

# Machine-wide leases of VM addresses, shared by all emulators (see AddressLeases.allocate).
LEASE_DIR = Path("/tmp/localcloud-ip-leases")
# VMs get 127.0.0.2 to 127.0.0.249. The rest is never leased: a test that needs an address where
# nothing answers (port 22 refuses) takes one of these, and no other worker's VM can be there.
VM_ADDRESSES = tuple(f"127.0.0.{n}" for n in range(2, 250))
NEVER_LEASED = tuple(f"127.0.0.{n}" for n in range(250, 255))


class AddressLeases:
    """The addresses one emulator holds; its callers hold the emulator's lock."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}  # address -> fd holding its machine-wide flock

    def allocate(self) -> str:
        """A free 127.0.0.N (N >= 2), the one released longest ago: leased by no emulator on this
        machine, port 22 bindable.

        The lease is an flock on a file per address, shared by every emulator on the machine (a
        developer's and a CI run's, say): checking the port alone races with another emulator
        whose VM has the address but has not bound it yet. The kernel drops a dead emulator's
        leases with its file descriptors. A release writes its time into the file, and addresses
        are handed out oldest release first, never-used ones before all: an address a deleted VM
        just gave up is not at once another VM's, so a check that the deleted VM no longer
        answers there cannot meet a newer VM (Compute Engine documents no order for ephemeral
        internal addresses; not reusing the last one is the cautious reading).
        """
        LEASE_DIR.mkdir(parents=True, exist_ok=True)
        for ip in sorted(VM_ADDRESSES, key=released_at):
            if ip in self.held:
                continue
            fd = os.open(LEASE_DIR / ip, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if not port_free(ip, 22):
                os.close(fd)
                continue
            self.held[ip] = fd
            return ip
        raise ApiError(503, "backendError", "localcloud: no free loopback address for another VM.")

    def release(self, ip: str | None) -> None:
        fd = self.held.pop(ip, None) if ip else None
        if fd is not None:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{time.time():.6f}".encode(), 0)
            os.close(fd)  # closing the descriptor drops the flock


def released_at(ip: str) -> tuple[float, int]:
    """When `ip` was last released (0 if never), then its last octet: allocate's order."""
    try:
        stamp = float((LEASE_DIR / ip).read_text() or 0)
    except (OSError, ValueError):
        stamp = 0.0
    return stamp, int(ip.rsplit(".", 1)[1])


def port_free(ip: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((ip, port))
        except OSError:
            return False
    return True
