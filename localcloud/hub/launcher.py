"""Start and stop the local Hub from Python, and seed it.

    with HubEmulator(state_dir) as hub:
        hub.add_user("alice", "hf_alice_write", role="write")
        hub.seed_repo("google/gemma", {"config.json": "{}"}, gated=True)
        HfApi(endpoint=hub.endpoint, token="hf_alice_write").model_info("google/gemma")

The server runs as `python -m localcloud.hub` in its own session; it is stopped by `stop()`,
at interpreter exit, or by itself when this process dies (see `localcloud.service`).
"""

from __future__ import annotations

import atexit
import base64
import json
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

from localcloud.service import Service, ServiceError


class HubEmulatorError(ServiceError):
    pass


class HubEmulator:
    def __init__(self, state_dir: Path, *, startup_timeout: float = 30.0, stop_timeout: float = 15.0,
                 python: str = sys.executable) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.python = python
        self._service = Service("hub", "localcloud.hub", self.state_dir / "hub-ready.json",
                                self.state_dir / "hub-server.log")
        self._lock = threading.Lock()

    # ----- lifecycle -----------------------------------------------------------------------

    def start(self) -> HubEmulator:
        with self._lock:
            if not self._service.running:
                self.state_dir.mkdir(parents=True, exist_ok=True)
                self._service.start(self.python, ["--state-dir", str(self.state_dir), "--port", "0"],
                                    self.startup_timeout)
                atexit.register(self.stop)
            return self

    def stop(self) -> None:
        """Stop the server (SIGTERM to its process group, SIGKILL if it lingers); idempotent."""
        with self._lock:
            atexit.unregister(self.stop)
            self._service.stop(self.stop_timeout)

    def __enter__(self) -> HubEmulator:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._service.running

    @property
    def port(self) -> int | None:
        return self._service.port

    @property
    def endpoint(self) -> str:
        """For `HfApi(endpoint=...)` and `HF_ENDPOINT`."""
        if self.port is None:
            raise HubEmulatorError("HubEmulator is not started")
        return f"http://127.0.0.1:{self.port}"

    # ----- controls ------------------------------------------------------------------------

    def requests(self) -> list[dict]:
        """Hub API requests so far: time, method, path, query, status, user (no bodies, no tokens)."""
        return self._control("GET", "requests")

    def clear_requests(self) -> None:
        self._control("DELETE", "requests")

    def add_user(self, name: str, token: str, *, role: str = "write", orgs: tuple[str, ...] = (),
                 org_roles: dict[str, str] | None = None, scoped: dict[str, list[str]] | None = None) -> None:
        """Create user `name` (or update its orgs) and give it `token` with `role` read, write or
        fineGrained. `org_roles`: {org: read, contributor, write (the default) or admin}. `scoped`:
        a fineGrained token's permissions, {entity: [permission, ...]} where the entity is
        "user:NAME", "org:NAME" or "model:OWNER/NAME"."""
        body = {"name": name, "token": token, "role": role, "orgs": list(orgs), "org_roles": org_roles}
        if scoped is not None:
            body["fine_grained"] = {"scoped": [
                {"entity": dict(zip(("type", "name"), entity.split(":", 1))), "permissions": permissions}
                for entity, permissions in scoped.items()
            ]}
        self._control("POST", "users", body)

    def seed_repo(
        self,
        repo_id: str,
        files: dict[str, str | bytes | Path] | None = None,
        *,
        repo_type: str = "model",
        private: bool | None = None,
        gated: bool | str | None = None,
        date: str | None = None,
        title: str | None = None,
        branch: str = "main",
        commits: list[dict] | None = None,
    ) -> dict:
        """Create `repo_id` if needed and add one commit of `files` (text, bytes, or a local
        Path), or several `commits` ({files, deleted, title, message, date, author, branch}).
        `date` is ISO 8601 (naive = UTC). Returns {"id", "type", "commits": [ids], "sha"}."""
        body: dict = {"type": repo_type, "id": repo_id}
        if private is not None:
            body["private"] = private
        if gated is not None:
            body["gated"] = gated
        if commits is None:
            commits = [{"files": files or {}, "date": date, "title": title, "branch": branch}]
        body["commits"] = [
            {**{k: v for k, v in c.items() if v is not None},
             "files": {p: _encode_file(v) for p, v in (c.get("files") or {}).items()}}
            for c in commits
        ]
        return self._control("POST", "repos", body)

    def grant(self, user: str, repo_id: str, *, repo_type: str = "model") -> None:
        """Give `user` access to the gated repo `repo_id` (an accepted access request)."""
        self._control("POST", "grants", {"user": user, "repo": repo_id, "type": repo_type})

    def _control(self, method: str, what: str, body: object = None) -> object:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.endpoint}/_localcloud/{what}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise HubEmulatorError(f"{method} /_localcloud/{what}: {exc.code} {exc.read().decode(errors='replace')}") from None

def _encode_file(value: str | bytes | Path) -> object:
    if isinstance(value, Path):
        return {"local_path": str(value.resolve())}
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode()}
    return {"text": value}
