"""A local Hugging Face Hub: the part of the Hub API that `huggingface_hub` uses for repos,
commits (regular and LFS files), downloads, refs, gated and private repos.

Run it as `python -m localcloud.hub --state-dir DIR [--port 0]`, or through
`localcloud.hub.launcher.HubEmulator`. Point clients at it with `HfApi(endpoint=URL)` or
`HF_ENDPOINT=URL`; uploads of LFS files need `HF_HUB_DISABLE_XET=1` (there is no Xet storage).
Modules, each importing only modules below it in this list:
- launcher: start/stop from Python, seeding helpers (a separate process: it imports none of these)
- server: the HTTP server over api and control, the request log
- control: /_localcloud/ controls (users, seeded repos, grants, request log)
- api: the Hub's API (routes and handlers)
- accounts: users and tokens (who an Authorization header names)
- protocol: a request, its caller and reply, errors in the Hub's shape
- store: repos as histories of immutable snapshots; files content-addressed on disk
"""

from .server import make_server

__all__ = ["make_server"]
