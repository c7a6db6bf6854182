"""A Unix socket in the abstract namespace that the sandbox VMs' shims ask the compute emulator
through (guest_power.py's power-off, oslogin/guest.py's OS Login keys).

VMs share the host's network namespace, so the socket is reachable from inside them with no path
or mount to set up. Each connection carries one request line and gets one answer line; who asks
is what the kernel says (SO_PEERCRED: the caller's pid and uid), never what the shim claims. The
accept loop blocks in the kernel (no polling); each request is served in its own thread.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class ShimListener:
    """Serves one kind of shim request: `answer(pid, uid, request)` gives (the answer line, then):
    `then()`, when not None, runs after the connection is closed (the shim has its answer)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.name = f"localcloud-{label}-{os.getpid()}-{os.urandom(6).hex()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind("\0" + self.name)
        self.sock.listen(64)
        self.closed = False
        threading.Thread(target=self._serve, name=label, daemon=True).start()

    def answer(self, pid: int, uid: int, request: str) -> tuple[str, Callable[[], None] | None]:
        raise NotImplementedError

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
        then = None
        with conn:
            try:
                conn.settimeout(10)
                pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
                reply, then = self.answer(pid, uid, conn.makefile().readline().strip())
                conn.sendall(f"{reply}\n".encode())
            except Exception:
                log.exception("%s request failed", self.label)
                return
        if then is not None:
            then()
