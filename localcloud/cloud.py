"""Launcher for the local cloud's emulators (today: Compute Engine), for tests and local runs.

    with LocalCloud(state_dir, images={"PROJECT/FAMILY": Path("/image/dir")}) as cloud:
        cloud.compute_endpoint   # "http://127.0.0.1:PORT/compute/v1/"

The emulator runs as `python -m localcloud.compute` in its own session; it is stopped by
`stop()`, at interpreter exit, or by itself when this process dies. One emulator per state
dir: starting on a dir whose previous emulator crashed (or still runs) takes it over and
reaps that emulator's VMs.
"""

from __future__ import annotations

import atexit
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

from localcloud.compute.vm import reap_stale

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent


class LocalCloudError(RuntimeError):
    pass


class LocalCloud:
    def __init__(
        self,
        state_dir: Path,
        images: dict[str, Path] | None = None,
        *,
        startup_timeout: float = 30.0,
        stop_timeout: float = 30.0,
        python: str = sys.executable,
        keep_deleted_shm: bool = False,
    ) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.keep_deleted_shm = keep_deleted_shm
        self.images = {k: Path(v) for k, v in (images or {}).items()}
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.python = python
        self.port: int | None = None
        self.pid: int | None = None
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    # ----- lifecycle -----------------------------------------------------------------------

    def start(self) -> LocalCloud:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return self
            self.state_dir.mkdir(parents=True, exist_ok=True)
            images_file = self.state_dir / "compute-images.json"
            images_file.write_text(json.dumps({k: str(v) for k, v in self.images.items()}, indent=1))
            ready_file = self.state_dir / "compute-ready.json"
            ready_file.unlink(missing_ok=True)
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), env.get("PYTHONPATH")]))
            with open(self.state_dir / "compute-emulator.log", "ab") as log_file:
                proc = subprocess.Popen(
                    [
                        self.python, "-m", "localcloud.compute",
                        "--state-dir", str(self.state_dir),
                        "--port", "0",
                        "--images-file", str(images_file),
                        "--ready-file", str(ready_file),
                        "--parent-pid", str(os.getpid()),
                        *(["--keep-deleted-shm"] if self.keep_deleted_shm else []),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=log_file,
                    env=env,
                    cwd=_PACKAGE_ROOT,
                    # Own process group: stop() signals the emulator alone, and a Ctrl-C in
                    # the terminal reaches us, whose stop() then shuts it down in order.
                    start_new_session=True,
                )
            ready = self._wait_ready(proc, ready_file)
            self._proc = proc
            self.port = ready["port"]
            self.pid = proc.pid
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
                raise LocalCloudError(f"compute emulator exited with {proc.returncode}: {self._log_tail()}")
            if time.monotonic() > deadline:
                _terminate(proc, 5.0)
                raise LocalCloudError(f"compute emulator not ready after {self.startup_timeout}s: {self._log_tail()}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop the emulator (it deletes its VMs); idempotent."""
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is None:
                return
            atexit.unregister(self.stop)
            forced = _terminate(proc, self.stop_timeout)
            if forced or proc.returncode != 0:
                # The emulator was killed or crashed, so it could not delete its VMs: reap
                # them from their records (only its own, never a newer emulator's).
                reap_stale(self.state_dir, only_owner=proc.pid)

    def __enter__(self) -> LocalCloud:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ----- endpoints and controls ----------------------------------------------------------

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise LocalCloudError("LocalCloud is not started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def compute_endpoint(self) -> str:
        """gcloud's api_endpoint_overrides/compute format (and the discovery client's)."""
        return f"{self.base_url}/compute/v1/"

    def requests(self) -> list[dict]:
        return self._control("GET", "requests")

    def clear_requests(self) -> None:
        self._control("DELETE", "requests")

    def set_faults(self, faults: dict) -> dict:
        return self._control("POST", "faults", faults)

    def add_image(self, key: str, image_dir: Path) -> None:
        """Make PROJECT/FAMILY `key` boot from `image_dir` (a custom image, in Compute Engine terms)."""
        self.images[key] = Path(image_dir)
        self._control("POST", "images", {key: str(image_dir)})

    def vms(self) -> list[dict]:
        return self._control("GET", "vms")

    def set_vm_file(self, relpath: str, content: str | bytes) -> Path:
        """Write STATE_DIR/vm-etc/RELPATH, seen read-only by every VM at /run/localcloud/."""
        root = (self.state_dir / "vm-etc").resolve()
        path = (root / relpath).resolve()
        if root not in path.parents:
            raise ValueError(f"{relpath!r} is not a path inside vm-etc")
        path.parent.mkdir(parents=True, exist_ok=True)
        data = content.encode() if isinstance(content, str) else content
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)  # readers on the VMs never see a half-written file
        return path

    def deleted_shm(self, name: str) -> Path:
        """The /dev/shm of a deleted VM, kept when the cloud runs with keep_deleted_shm."""
        return self.state_dir / "deleted" / f"{name}-shm"

    def deleted_manifest(self, name: str) -> list | None:
        try:
            return json.loads((self.state_dir / "deleted" / f"{name}.json").read_text())
        except FileNotFoundError:
            return None

    def _control(self, method: str, what: str, body: object = None) -> object:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.base_url}/_localcloud/{what}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise LocalCloudError(f"{method} /_localcloud/{what}: {exc.code} {exc.read().decode(errors='replace')}") from None

    def _log_tail(self, size: int = 3000) -> str:
        try:
            return (self.state_dir / "compute-emulator.log").read_text(errors="replace")[-size:]
        except FileNotFoundError:
            return ""


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
