"""A local Hugging Face Hub: the part of the Hub API that `huggingface_hub` uses for repos,
commits (regular and LFS files), downloads, refs, gated and private repos.

Run it as `python -m localcloud.hub --state-dir DIR [--port 0]`, or through
`localcloud.hub.launcher.HubEmulator`. Point clients at it with `HfApi(endpoint=URL)` or
`HF_ENDPOINT=URL`; uploads of LFS files need `HF_HUB_DISABLE_XET=1` (there is no Xet storage).
Modules:
- store: repos as histories of immutable snapshots; files content-addressed on disk
- server: the Hub's HTTP API, auth, errors in the Hub's shape
- control: /_localcloud/ controls (users, seeded repos, grants, request log)
- launcher: start/stop from Python, seeding helpers
"""

from .server import make_server

__all__ = ["make_server"]
