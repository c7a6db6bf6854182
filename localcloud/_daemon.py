"""What every emulator process of the local cloud shares: the state-dir lock, the parent
watch, the ready file and the request log.

An emulator runs as `python -m localcloud.<service> --state-dir DIR --ready-file F
--parent-pid P` in its own session (see `localcloud.cloud`); it holds a lock file in its
state dir for its lifetime, writes {"port", "pid", "endpoint", ...} to its ready file once it
listens, and exits 0 on SIGTERM/SIGINT or when the parent is gone.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

log = logging.getLogger("localcloud")


def take_over(lock_path: Path, module: str) -> int:
    """Hold `lock_path` for our lifetime; SIGKILL a live previous holder running `module`."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        old_pid = int(os.pread(fd, 32, 0).decode().strip() or 0)
        try:
            cmdline = Path(f"/proc/{old_pid}/cmdline").read_bytes()
        except OSError:
            cmdline = b""
        # Only ever kill what is provably an emulator of the same kind.
        if old_pid and module.encode() in cmdline:
            log.warning("killing previous %s pid %d (lock %s)", module, old_pid, lock_path)
            os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{lock_path} is locked by pid {old_pid}")
                time.sleep(0.05)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def watch_parent(parent_pid: int, stop: threading.Event) -> None:
    """Set `stop` once `parent_pid` is gone (run in a daemon thread)."""
    # Our parent's death reparents us: polling getppid needs no guard against pid reuse.
    # (If the given pid is not our parent, fall back to checking that it exists.)
    is_parent = os.getppid() == parent_pid
    while not stop.wait(0.5):
        if is_parent:
            gone = os.getppid() != parent_pid
        else:
            gone = not Path(f"/proc/{parent_pid}").exists()
        if gone:
            log.warning("parent %d is gone", parent_pid)
            stop.set()


def stop_event(parent_pid: int | None) -> threading.Event:
    """An event set by SIGTERM, SIGINT or the death of `parent_pid`."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    if parent_pid:
        threading.Thread(target=watch_parent, args=(parent_pid, stop), daemon=True).start()
    return stop


def write_ready(path: Path, ready: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(ready))
    os.replace(tmp, path)  # the launcher never reads half a file


class RequestLog:
    """One JSON line per API request in a file (the tests read it through the control API)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def append(self, entry: dict) -> None:
        line = json.dumps(entry, sort_keys=True) + "\n"
        with self._lock, open(self.path, "a") as f:
            f.write(line)

    def read(self) -> list[dict]:
        with self._lock:
            try:
                text = self.path.read_text()
            except FileNotFoundError:
                return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def clear(self) -> None:
        with self._lock:
            self.path.write_text("")
