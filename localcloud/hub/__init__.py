"""A local Hugging Face Hub: the part of the Hub API that `huggingface_hub` uses for repos,
commits (regular and LFS files), downloads, refs, gated and private repos.

Run it as `python -m localcloud.hub --state-dir DIR [--port 0]`, or through
`localcloud.hub.launcher.HubEmulator`. Point clients at it with `HfApi(endpoint=URL)` or
`HF_ENDPOINT=URL`; uploads of LFS files need `HF_HUB_DISABLE_XET=1` (there is no Xet storage).
Modules:
- store: repos as histories of immutable snapshots; files content-addressed on disk
- protocol: a request, its caller and reply, errors in the Hub's shape
- accounts: users and tokens (who an Authorization header names)
- api: the Hub's API (routes and handlers)
- control: /_localcloud/ controls (users, seeded repos, grants, request log)
- server: the HTTP server over api and control, the request log
- launcher: start/stop from Python, seeding helpers
Each module imports only those above it in this list (launcher: none of them).
"""

from .server import make_server

__all__ = ["make_server"]
