"""A private Redis server for tests: the Celery broker of a deployment-shaped Airflow.

    with RedisServer(Path("/tmp/some-dir")) as redis:
        redis.url            # "redis://127.0.0.1:PORT/0"

`start()` runs Debian's `redis-server` on a free 127.0.0.1 port in a session of its own, with no
persistence (a broker's queue is worth nothing after the test) and its files in ROOT; it is ready
once it answers PING. `stop()` SIGTERMs its process group, SIGKILLs it after a grace period, and
runs at interpreter exit too. Each start is on a fresh, empty server.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from localcloud.airflow_harness import free_port

REDIS_SERVER = Path("/usr/bin/redis-server")


class RedisError(RuntimeError):
    pass


class RedisServer:
    def __init__(self, root: Path, *, startup_timeout: float = 30.0, stop_timeout: float = 15.0) -> None:
        self.root = Path(root).resolve()
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.port: int | None = None
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RedisError("start() the server first")
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server") or str(REDIS_SERVER)
        if not Path(binary).exists():
            raise RedisError("redis-server is not installed (Debian: apt-get install redis-server; `make system-deps` does it)")
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        self.port = free_port()
        arguments = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.root),
            "--save", "", "--appendonly", "no", "--daemonize", "no",
        ]
        with open(self.root / "redis.log", "ab") as log:
            self.process = subprocess.Popen(
                arguments, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        atexit.register(self.stop)
        deadline = time.monotonic() + self.startup_timeout
        while not self.ping():
            if self.process.poll() is not None:
                raise RedisError(f"redis-server exited {self.process.returncode}: {self._log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RedisError(f"redis-server did not answer PING within {self.startup_timeout} s")
            time.sleep(0.1)  # polling interval until it listens

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        atexit.unregister(self.stop)
        process, self.process = self.process, None
        if process is None:
            return
        for signum, wait in ((signal.SIGTERM, self.stop_timeout), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(process.pid, signum)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue

    def _log_tail(self) -> str:
        try:
            return (self.root / "redis.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
