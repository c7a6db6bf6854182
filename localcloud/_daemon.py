"""What every emulator process of the local cloud shares: the state-dir lock, the parent
watch, the ready file and the request log.

An emulator runs as `python -m localcloud.<service> --state-dir DIR --ready-file F
--parent-pid P` in its own session (see `localcloud.cloud`); it holds a lock file in its
state dir for its lifetime, writes {"port", "pid", "endpoint", ...} to its ready file once it
listens, and exits 0 on SIGTERM/SIGINT or when the parent is gone.
"""

from __future__ import annotations

import argparse
import fcntl
import ipaddress
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


# ----- the entry points' shared shape ------------------------------------------------------


def emulator_parser(module: str, doc: str) -> argparse.ArgumentParser:
    """The arguments every emulator takes; an entry point adds its own."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.splitlines()[0])
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1", help="loopback address to listen on")
    parser.add_argument("--ready-file", type=Path, help="default: a file in the state dir")
    parser.add_argument("--parent-pid", type=int, help="shut down when this process is gone")
    parser.add_argument("--verbose", action="store_true")
    return parser


def parse_emulator_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse, refuse a non-loopback host, set up logging, resolve and create the state dir."""
    args = parser.parse_args(argv)
    if not ipaddress.ip_address(args.host).is_loopback:
        parser.error("--host must be a loopback address")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    args.state_dir = args.state_dir.resolve()
    args.state_dir.mkdir(parents=True, exist_ok=True)
    return args


def serve_until_stopped(
    server, args: argparse.Namespace, ready_file: Path, name: str, endpoint_path: str = "", on_stop=None,
    extra_ready: dict | None = None,
) -> int:
    """Serve in a thread, announce readiness (with `extra_ready`'s fields), and shut down on
    SIGTERM/SIGINT or the parent's death."""
    port = server.server_address[1]
    stop = stop_event(args.parent_pid)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    ready = {"port": port, "pid": os.getpid(), "endpoint": f"http://{args.host}:{port}{endpoint_path}",
             **(extra_ready or {})}
    write_ready(ready_file, ready)
    log.info("%s emulator listening on %s (state dir %s)", name, ready["endpoint"], args.state_dir)
    while not stop.wait(0.5):
        pass
    log.info("%s emulator shutting down", name)
    server.shutdown()
    if on_stop:
        on_stop()
    server.server_close()
    ready_file.unlink(missing_ok=True)
    return 0
