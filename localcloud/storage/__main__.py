"""Entry point: `python -m localcloud.storage --state-dir DIR [--port 0] [--ready-file F] [--parent-pid P]`.

Startup takes over the state dir (a still-running emulator of the same dir is killed) and
keeps the buckets and objects already there. When listening, the ready file (default
STATE_DIR/ready.json) gets {"port", "pid", "endpoint"}; `endpoint` is in gcloud's
api_endpoint_overrides/storage format. SIGTERM or SIGINT exits 0; so does the death of
--parent-pid. The request log (STATE_DIR/requests.jsonl) describes one emulator run.
"""

from __future__ import annotations

import os
import sys

from .._daemon import emulator_parser, parse_emulator_args, serve_until_stopped, take_over
from .server import make_server


def main(argv: list[str] | None = None) -> int:
    args = parse_emulator_args(emulator_parser("localcloud.storage", __doc__), argv)
    state_dir = args.state_dir
    ready_file = args.ready_file or state_dir / "ready.json"
    ready_file.unlink(missing_ok=True)
    lock_fd = take_over(state_dir / "emulator.lock", "localcloud.storage")
    (state_dir / "requests.jsonl").write_text("")
    server = make_server(state_dir, args.host, args.port)
    status = serve_until_stopped(server, args, ready_file, "storage", "/storage/v1/")
    os.close(lock_fd)
    return status


if __name__ == "__main__":
    sys.exit(main())
