"""Entry point: `python -m localcloud.hub --state-dir DIR [--port 0] [--ready-file F] [--parent-pid P]`.

Repos, objects and users persist under STATE_DIR/hub/; one server per state dir (a second
one refuses to start). When listening, the ready file (default STATE_DIR/hub-ready.json)
gets {"port", "pid", "endpoint"}. SIGTERM or SIGINT exits 0; so does the death of --parent-pid.
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
from pathlib import Path

from .server import make_server

log = logging.getLogger("localcloud.hub")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localcloud.hub", description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1", help="loopback address to listen on")
    parser.add_argument("--ready-file", type=Path, help="default: STATE_DIR/hub-ready.json")
    parser.add_argument("--parent-pid", type=int, help="shut down when this process is gone")
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
    ready_file = args.ready_file or state_dir / "hub-ready.json"
    ready_file.unlink(missing_ok=True)
    # Two servers writing the same repos would lose commits: hold a lock for our lifetime.
    lock_fd = os.open(state_dir / "hub-server.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(f"state dir {state_dir} is in use by another hub server") from None

    server = make_server(state_dir, args.host, args.port)
    port = server.server_address[1]
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    if args.parent_pid:
        threading.Thread(target=_watch_parent, args=(args.parent_pid, stop), daemon=True).start()
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()

    ready = {"port": port, "pid": os.getpid(), "endpoint": f"http://{args.host}:{port}"}
    tmp = ready_file.with_name(ready_file.name + ".tmp")
    tmp.write_text(json.dumps(ready))
    os.replace(tmp, ready_file)
    log.info("hub emulator listening on %s (state dir %s)", ready["endpoint"], state_dir)

    while not stop.wait(0.5):
        pass
    log.info("shutting down")
    server.shutdown()
    server.server_close()
    ready_file.unlink(missing_ok=True)
    os.close(lock_fd)
    return 0


def _watch_parent(parent_pid: int, stop: threading.Event) -> None:
    # Our parent's death reparents us: polling getppid needs no guard against pid reuse.
    # (If the given pid is not our parent, fall back to checking that it exists.)
    is_parent = os.getppid() == parent_pid
    while not stop.wait(0.5):
        gone = os.getppid() != parent_pid if is_parent else not Path(f"/proc/{parent_pid}").exists()
        if gone:
            log.warning("parent %d is gone", parent_pid)
            stop.set()


if __name__ == "__main__":
    sys.exit(main())
