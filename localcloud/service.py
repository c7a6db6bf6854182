"""Launch one local-cloud emulator process and stop it again (the launcher side of `_daemon`).

Each emulator runs as `python -m localcloud.<service>` in its own session, writes a ready file
when it listens, and is stopped by process group: SIGTERM, then SIGKILL if it lingers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent


class ServiceError(RuntimeError):
    pass


class Service:
    """One emulator process: own session, ready file, log file; stopped by process group."""

    def __init__(self, label: str, module: str, ready_file: Path, log_file: Path) -> None:
        self.label, self.module, self.ready_file, self.log_file = label, module, ready_file, log_file
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.ready: dict = {}  # what its ready file said

    def start(self, python: str, args: list[str], timeout: float) -> None:
        self.ready_file.unlink(missing_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), env.get("PYTHONPATH")]))
        with open(self.log_file, "ab") as log_file:
            proc = subprocess.Popen(
                [python, "-m", self.module, *args, "--ready-file", str(self.ready_file), "--parent-pid", str(os.getpid())],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                env=env,
                cwd=_PACKAGE_ROOT,
                # Own process group: stop() signals the emulator alone, and a Ctrl-C in
                # the terminal reaches us, whose stop() then shuts it down in order.
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.ready_file.exists():
                ready = json.loads(self.ready_file.read_text())
                if ready.get("pid") == proc.pid:
                    break
            if proc.poll() is not None:
                raise ServiceError(f"{self.label} emulator exited with {proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                terminate(proc, 5.0)
                raise ServiceError(f"{self.label} emulator not ready after {timeout}s: {self.log_tail()}")
            time.sleep(0.02)
        self.proc, self.port, self.ready = proc, ready["port"], ready

    def stop(self, timeout: float) -> subprocess.Popen | None:
        """Stop it (idempotent); returns the process if it had to be killed or failed."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        forced = terminate(proc, timeout)
        return proc if forced or proc.returncode != 0 else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, size: int = 3000) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-size:]
        except FileNotFoundError:
            return ""


def terminate(proc: subprocess.Popen, timeout: float) -> bool:
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
