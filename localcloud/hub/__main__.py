"""Entry point: `python -m localcloud.hub --state-dir DIR [--port 0] [--ready-file F] [--parent-pid P]`.

Repos, objects and users persist under STATE_DIR/hub/; startup takes over the state dir (a
still-running server of the same dir is killed: two would lose each other's commits). When listening, the ready file (default STATE_DIR/hub-ready.json)
gets {"port", "pid", "endpoint"}. SIGTERM or SIGINT exits 0; so does the death of --parent-pid.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
import threading
from pathlib import Path

from .._daemon import stop_event, take_over, write_ready
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
    lock_fd = take_over(state_dir / "hub-server.lock", "localcloud.hub")

    server = make_server(state_dir, args.host, args.port)
    port = server.server_address[1]
    stop = stop_event(args.parent_pid)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()

    ready = {"port": port, "pid": os.getpid(), "endpoint": f"http://{args.host}:{port}"}
    write_ready(ready_file, ready)
    log.info("hub emulator listening on %s (state dir %s)", ready["endpoint"], state_dir)

    while not stop.wait(0.5):
        pass
    log.info("shutting down")
    server.shutdown()
    server.server_close()
    ready_file.unlink(missing_ok=True)
    os.close(lock_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
