"""Entry point: `python -m localcloud.compute --state-dir DIR [--port 0] [--images-file FILE]`.

Startup takes over the state dir: a still-running emulator of the same dir (holder of its
lock file) is killed, and VMs left by a killed one are reaped. When listening, the ready
file (default STATE_DIR/compute-ready.json) gets {"port", "pid", "endpoint"}. SIGTERM or
SIGINT deletes every VM and exits 0; so does the death of --parent-pid.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import sys
import threading
from pathlib import Path

from .._daemon import stop_event, take_over, write_ready
from .emulator import ComputeEmulator, make_server
from .vm import reap_stale

log = logging.getLogger("localcloud.compute")


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
    parser.add_argument("--vm-env-file", type=Path, help='JSON {"NAME": "value"}: environment of every VM\'s SSH sessions')
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
    lock_fd = take_over(state_dir / "compute-emulator.lock", "localcloud.compute")
    reaped = reap_stale(state_dir)
    if reaped:
        log.warning("reaped stale VMs: %s", ", ".join(reaped))
    # The request log describes one emulator run.
    (state_dir / "compute-requests.jsonl").write_text("")

    images = json.loads(args.images_file.read_text()) if args.images_file else {}
    vm_env = json.loads(args.vm_env_file.read_text()) if args.vm_env_file else {}
    emulator = ComputeEmulator(
        state_dir,
        images,
        operation_wait_timeout=args.operation_wait_timeout,
        vm_ready_timeout=args.vm_ready_timeout,
        keep_deleted_shm=args.keep_deleted_shm,
        vm_env=vm_env,
    )
    server = make_server(emulator, args.host, args.port)
    port = server.server_address[1]

    stop = stop_event(args.parent_pid)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()

    ready = {"port": port, "pid": os.getpid(), "endpoint": f"http://{args.host}:{port}/compute/v1/"}
    write_ready(ready_file, ready)
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


if __name__ == "__main__":
    sys.exit(main())
