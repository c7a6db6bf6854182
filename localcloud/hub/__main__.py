"""Entry point: `python -m localcloud.hub --state-dir DIR [--port 0] [--ready-file F] [--parent-pid P]`.

Repos, objects and users persist under STATE_DIR/hub/; startup takes over the state dir (a
still-running server of the same dir is killed: two would lose each other's commits). When
listening, the ready file (default STATE_DIR/hub-ready.json) gets {"port", "pid", "endpoint"}. SIGTERM or SIGINT exits 0; so does the death of --parent-pid.
"""

from __future__ import annotations

import os
import sys

from .._daemon import emulator_parser, parse_emulator_args, serve_until_stopped, take_over
from .server import make_server


def main(argv: list[str] | None = None) -> int:
    args = parse_emulator_args(emulator_parser("localcloud.hub", __doc__), argv)
    state_dir = args.state_dir
    ready_file = args.ready_file or state_dir / "hub-ready.json"
    ready_file.unlink(missing_ok=True)
    lock_fd = take_over(state_dir / "hub-server.lock", "localcloud.hub")
    server = make_server(state_dir, args.host, args.port)
    status = serve_until_stopped(server, args, ready_file, "hub")
    os.close(lock_fd)
    return status


if __name__ == "__main__":
    sys.exit(main())
