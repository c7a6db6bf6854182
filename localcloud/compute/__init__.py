"""Compute Engine v1 emulator whose VMs are real sshd processes on 127.0.0.N:22.

Run it as `python -m localcloud.compute --state-dir DIR [--port 0] [--images-file FILE]
[--vm-env-file FILE]`, or through `localcloud.cloud.LocalCloud`. Modules:
- emulator: the HTTP API (resources, operations, request log, /_localcloud/ controls)
- vm: sandbox VMs (unshare'd sshd) and reaping of stale ones
- guest: the guest agent's account handling (ssh-keys metadata → users)
- schema: body validation against the discovery document
- filters: the `filter` parameter of list calls
- errors: error bodies in the real API's shape
- testing: helpers for tests (discovery client, insert body, operation wait)
"""

from .emulator import ComputeEmulator, make_server

__all__ = ["ComputeEmulator", "make_server"]
