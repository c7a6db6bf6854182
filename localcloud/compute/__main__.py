"""Entry point: `python -m localcloud.compute --state-dir DIR [--port 0] [--images-file FILE]`.

Startup takes over the state dir: a still-running emulator of the same dir (holder of its
lock file) is killed, and VMs left by a killed one are reaped. When listening, the ready
file (default STATE_DIR/compute-ready.json) gets {"port", "pid", "endpoint"}. SIGTERM or
SIGINT deletes every VM and exits 0; so does the death of --parent-pid.
"""

from __future__ import annotations

import argparse
import fcntl
import ipaddress
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from .emulator import ComputeEmulator, make_server
from .vm import reap_stale

log = logging.getLogger("localcloud.compute")


def _take_over(state_dir: Path) -> int:
    """Hold STATE_DIR/compute-emulator.lock for our lifetime; kill a live previous holder."""
    fd = os.open(state_dir / "compute-emulator.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        old_pid = int(os.pread(fd, 32, 0).decode().strip() or 0)
        try:
            cmdline = Path(f"/proc/{old_pid}/cmdline").read_bytes()
        except OSError:
            cmdline = b""
        # Only ever kill what is provably an emulator of this state dir.
        if old_pid and b"localcloud.compute" in cmdline:
            log.warning("killing previous emulator pid %d of %s", old_pid, state_dir)
            os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"state dir {state_dir} is locked by pid {old_pid}")
                time.sleep(0.05)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localcloud.compute", description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1", help="loopback address to listen on")
    parser.add_argument("--images-file", type=Path, help='JSON {"PROJECT/FAMILY": "/abs/image/dir"}')
    parser.add_argument("--ready-file", type=Path, help="default: STATE_DIR/compute-ready.json")
    parser.add_argument("--parent-pid", type=int, help="shut down when this process is gone")
    parser.add_argument("--operation-wait-timeout", type=float, default=120.0)
    parser.add_argument("--vm-ready-timeout", type=float, default=30.0)
    parser.add_argument("--keep-deleted-shm", action="store_true", help="move a deleted VM's /dev/shm aside")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if not ipaddress.ip_address(args.host).is_loopback:
        parser.error("--host must be a loopback address")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )

    state_dir = args.state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    ready_file = args.ready_file or state_dir / "compute-ready.json"
    ready_file.unlink(missing_ok=True)
    lock_fd = _take_over(state_dir)
    reaped = reap_stale(state_dir)
    if reaped:
        log.warning("reaped stale VMs: %s", ", ".join(reaped))
    # The request log describes one emulator run.
    (state_dir / "compute-requests.jsonl").write_text("")

    images = json.loads(args.images_file.read_text()) if args.images_file else {}
    emulator = ComputeEmulator(
        state_dir,
        images,
        operation_wait_timeout=args.operation_wait_timeout,
        vm_ready_timeout=args.vm_ready_timeout,
        keep_deleted_shm=args.keep_deleted_shm,
    )
    server = make_server(emulator, args.host, args.port)
    port = server.server_address[1]

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    if args.parent_pid:
        threading.Thread(target=_watch_parent, args=(args.parent_pid, stop), daemon=True).start()
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()

    ready = {"port": port, "pid": os.getpid(), "endpoint": f"http://{args.host}:{port}/compute/v1/"}
    tmp = ready_file.with_name(ready_file.name + ".tmp")
    tmp.write_text(json.dumps(ready))
    os.replace(tmp, ready_file)
    log.info("compute emulator listening on %s (state dir %s)", ready["endpoint"], state_dir)

    while not stop.wait(0.5):
        pass
    log.info("shutting down: deleting %d VM(s)", len(emulator.instances))
    server.shutdown()
    emulator.shutdown()
    server.server_close()
    ready_file.unlink(missing_ok=True)
    os.close(lock_fd)
    return 0


def _watch_parent(parent_pid: int, stop: threading.Event) -> None:
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


if __name__ == "__main__":
    sys.exit(main())
