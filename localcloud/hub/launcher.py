"""Start and stop the local Hub from Python, and seed it.

    with HubEmulator(state_dir) as hub:
        hub.add_user("alice", "hf_alice_write", role="write")
        hub.seed_repo("google/gemma", {"config.json": "{}"}, gated=True)
        HfApi(endpoint=hub.endpoint, token="hf_alice_write").model_info("google/gemma")

The server runs as `python -m localcloud.hub` in its own session; it is stopped by `stop()`,
at interpreter exit, or by itself when this process dies.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent


class HubEmulatorError(RuntimeError):
    pass


class HubEmulator:
    def __init__(self, state_dir: Path, *, startup_timeout: float = 30.0, stop_timeout: float = 15.0,
                 python: str = sys.executable) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.python = python
        self.port: int | None = None
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    # ----- lifecycle -----------------------------------------------------------------------

    def start(self) -> HubEmulator:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return self
            self.state_dir.mkdir(parents=True, exist_ok=True)
            ready_file = self.state_dir / "hub-ready.json"
            ready_file.unlink(missing_ok=True)
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), env.get("PYTHONPATH")]))
            with open(self.state_dir / "hub-server.log", "ab") as log_file:
                proc = subprocess.Popen(
                    [self.python, "-m", "localcloud.hub", "--state-dir", str(self.state_dir), "--port", "0",
                     "--ready-file", str(ready_file), "--parent-pid", str(os.getpid())],
                    stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, env=env, cwd=_PACKAGE_ROOT,
                    # Own process group: stop() signals the server alone, and a Ctrl-C in the
                    # terminal reaches us, whose stop() then shuts it down.
                    start_new_session=True,
                )
            self.port = self._wait_ready(proc, ready_file)["port"]
            self._proc = proc
            atexit.register(self.stop)
            return self

    def _wait_ready(self, proc: subprocess.Popen, ready_file: Path) -> dict:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if ready_file.exists():
                ready = json.loads(ready_file.read_text())
                if ready.get("pid") == proc.pid:
                    return ready
            if proc.poll() is not None:
                raise HubEmulatorError(f"hub server exited with {proc.returncode}: {self._log_tail()}")
            if time.monotonic() > deadline:
                _terminate(proc, 5.0)
                raise HubEmulatorError(f"hub server not ready after {self.startup_timeout}s: {self._log_tail()}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop the server (SIGTERM to its process group, SIGKILL if it lingers); idempotent."""
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is None:
                return
            atexit.unregister(self.stop)
            _terminate(proc, self.stop_timeout)

    def __enter__(self) -> HubEmulator:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

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

    def add_user(self, name: str, token: str, *, role: str = "write", orgs: tuple[str, ...] = ()) -> None:
        """Create user `name` (or update its orgs) and give it `token` with `role` read or write."""
        self._control("POST", "users", {"name": name, "token": token, "role": role, "orgs": list(orgs)})

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

    def _log_tail(self, size: int = 3000) -> str:
        try:
            return (self.state_dir / "hub-server.log").read_text(errors="replace")[-size:]
        except FileNotFoundError:
            return ""


def _encode_file(value: str | bytes | Path) -> object:
    if isinstance(value, Path):
        return {"local_path": str(value.resolve())}
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode()}
    return {"text": value}


def _terminate(proc: subprocess.Popen, timeout: float) -> bool:
    """SIGTERM the process group, wait, SIGKILL if needed. True if it had to be killed."""
    if proc.poll() is not None:
        return False
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=timeout)
        return False
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    return True
