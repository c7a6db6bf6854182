"""Entry point: `python -m localcloud.compute --state-dir DIR [--port 0] [--images-file FILE]`.

Startup takes over the state dir: a still-running emulator of the same dir (holder of its
lock file) is killed, and VMs left by a killed one are reaped. When listening, the ready
file (default STATE_DIR/compute-ready.json) gets {"port", "pid", "endpoint"}. SIGTERM or
SIGINT deletes every VM and exits 0; so does the death of --parent-pid.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from .._daemon import emulator_parser, parse_emulator_args, serve_until_stopped, take_over
from ..iap.relay import Relay, self_signed_certificate
from .emulator import ComputeEmulator
from .first_boot import FirstBoot
from .server import make_server
from .vm import reap_stale

log = logging.getLogger("localcloud.compute")


def main(argv: list[str] | None = None) -> int:
    parser = emulator_parser("localcloud.compute", __doc__)
    parser.add_argument("--images-file", type=Path, help='JSON {"PROJECT/FAMILY": "/abs/image/dir"}')
    parser.add_argument("--operation-wait-timeout", type=float, default=120.0)
    parser.add_argument("--vm-ready-timeout", type=float, default=30.0)
    parser.add_argument("--vm-env-file", type=Path, help='JSON {"NAME": "value"}: environment of every VM\'s SSH sessions')
    parser.add_argument("--keep-deleted-shm", action="store_true", help="move a deleted VM's /dev/shm aside")
    parser.add_argument("--first-boot-cloud-init", type=float, default=0.0, metavar="SECONDS",
                        help="each VM's cloud-init runs this long after boot (first_boot.py; default 0)")
    parser.add_argument("--first-boot-dpkg-lock", type=float, default=0.0, metavar="SECONDS",
                        help="each VM's unattended-upgrades holds the dpkg lock this long after boot (default 0)")
    args = parse_emulator_args(parser, argv)
    state_dir = args.state_dir
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
        first_boot=FirstBoot(args.first_boot_cloud_init, args.first_boot_dpkg_lock),
    )
    server = make_server(emulator, args.host, args.port)
    # IAP's TCP forwarding, on a port of its own (a WebSocket server): localcloud/iap/relay.py.
    relay = Relay(emulator.tokens.identity, emulator.iap_policy, emulator.iap_backend,
                  emulator.iap_request_log.append, self_signed_certificate(state_dir), args.host).start()

    def delete_vms() -> None:
        relay.stop()
        log.info("deleting %d VM(s)", len(emulator.instances))
        emulator.shutdown()

    status = serve_until_stopped(server, args, ready_file, "compute", "/compute/v1/", on_stop=delete_vms,
                                 extra_ready={"iap_tunnel_endpoint": relay.endpoint, "iap_tunnel_ca_file": str(relay.ca_file)})
    os.close(lock_fd)
    return status


if __name__ == "__main__":
    sys.exit(main())
