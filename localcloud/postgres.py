"""A private PostgreSQL server for tests: a throwaway cluster in a directory of our choosing.

    with PostgresServer(Path("/tmp/some-dir")) as server:
        server.url            # "postgresql+psycopg2://postgres:PASSWORD@127.0.0.1:PORT/airflow"
        server.create_database("other")   # another database on the same server, its URL
        server.dump_database("other", Path("other.sql"))   # its schema and rows as SQL...
        another_server.load_database("copy", Path("other.sql"))   # ...run into a new database

`start()` creates a fresh cluster (`initdb`) in ROOT/data, owned by an unprivileged OS user
(PostgreSQL refuses to run as root: as root, Debian's `postgres` system user; otherwise the
current user), starts it with `pg_ctl` on a free 127.0.0.1 port (no unix socket) and creates
the database. The postmaster runs in its own process group (pg_ctl makes it a session leader;
each backend then leads a group of its own), and every process of the cluster has the data
directory as its working directory: `stop()` — `pg_ctl stop -m fast`, then SIGKILL to the
postmaster's group and to any process still working in the data directory — leaves nothing
behind. It runs at interpreter exit too.

One server per ROOT: the process that started it holds ROOT/server.lock. A server a previous,
dead run left in ROOT (its lock is free) is stopped and its data removed before the new
cluster is made, so every start is clean. Debian's binaries live in
/usr/lib/postgresql/<version>/bin (the newest is used; `PG_BINDIR` overrides).
"""

from __future__ import annotations

import atexit
import fcntl
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DEBIAN_PG_ROOT = Path("/usr/lib/postgresql")
SUPERUSER = "postgres"  # the database superuser (initdb --username)
# A test server: durability is not wanted, speed and enough connections for Airflow's
# components (each with its own pool) are.
SERVER_SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "unix_socket_directories": "''",
    "max_connections": "200",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "log_min_messages": "warning",
}


class PostgresError(RuntimeError):
    pass


class PostgresInUse(PostgresError):
    """Another live process holds the folder's server."""


def postgres_bindir() -> Path:
    """The directory of initdb/pg_ctl/postgres: $PG_BINDIR, Debian's newest, or the PATH."""
    if os.environ.get("PG_BINDIR"):
        return Path(os.environ["PG_BINDIR"])
    versions = []
    if DEBIAN_PG_ROOT.is_dir():
        for child in DEBIAN_PG_ROOT.iterdir():
            if child.name.isdigit() and (child / "bin" / "pg_ctl").exists():
                versions.append((int(child.name), child / "bin"))
    if versions:
        return max(versions)[1]
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    raise PostgresError("PostgreSQL is not installed (Debian: apt-get install postgresql; `make system-deps` does it)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _pgrp(pid: int) -> int | None:
    """The process group of a live (non-zombie) process, or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    if fields[0] == "Z":
        return None
    return int(fields[2])


def _cwd(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


class PostgresServer:
    def __init__(
        self,
        root: Path,
        *,
        database: str = "airflow",
        os_user: str | None = None,
        startup_timeout: float = 60.0,
        stop_timeout: float = 30.0,
    ) -> None:
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", database):
            raise ValueError(f"database name {database!r}: lowercase letters, digits and _ only")
        self.root = Path(root).resolve()
        self.data_dir = self.root / "data"
        self.log_file = self.root / "postgres.log"
        self.database = database
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        if os_user is None:
            os_user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        try:
            self.os_user = pwd.getpwnam(os_user)
        except KeyError:
            raise PostgresError(
                f"no OS user {os_user!r} to run PostgreSQL as (Debian's postgresql package creates "
                "`postgres`; `make system-deps` installs it)"
            ) from None
        if self.os_user.pw_uid == 0:
            raise PostgresError("PostgreSQL refuses to run as root: pass an unprivileged os_user")
        self.bindir = postgres_bindir()
        self.port: int | None = None
        self.password: str | None = None
        self.pgid: int | None = None  # the postmaster's pid, leader of the cluster's process group
        self._lock_fd: int | None = None

    # ----- public ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.url_for(self.database)

    def url_for(self, database: str) -> str:
        if self.port is None:
            raise PostgresError("the server is not running")
        return f"postgresql+psycopg2://{SUPERUSER}:{self.password}@127.0.0.1:{self.port}/{database}"

    def start(self) -> str:
        """Create a fresh cluster, start it and create the database; returns its URL."""
        if self.port is not None:
            return self.url
        self.root.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        try:
            self._stop_cluster(leftover=True)
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self._check_reachable()
            self._initdb()
            atexit.register(self.stop)
            self._start_postmaster()
            self.create_database(self.database)
        except BaseException:
            self.stop()
            raise
        return self.url

    def reap_leftover(self) -> bool:
        """Stop and remove a server a dead run left in the folder, unless a live process holds it.
        True if the folder is free (now) and empty of a cluster."""
        if self.port is not None or not self.root.is_dir():
            return self.port is None
        try:
            self._take_lock()
        except PostgresInUse:
            return False
        try:
            self._stop_cluster(leftover=True)
            shutil.rmtree(self.data_dir, ignore_errors=True)
        finally:
            self._release_lock()
        return True

    def create_database(self, name: str, template: str | None = None) -> str:
        """CREATE DATABASE `name` (optionally a copy of `template`); returns its URL."""
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", name) or (template and not re.fullmatch(r"[a-z_][a-z0-9_]*", template)):
            raise ValueError(f"database name {name!r}/{template!r}: lowercase letters, digits and _ only")
        self._admin(f"CREATE DATABASE {name}" + (f" TEMPLATE {template}" if template else ""))
        return self.url_for(name)

    def drop_database(self, name: str) -> None:
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", name):
            raise ValueError(f"database name {name!r}")
        self._admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def dump_database(self, name: str, path: Path) -> None:
        """Write database `name`, schema and rows, to `path` as SQL (pg_dump's plain format,
        without owners or privileges): what load_database reads into another server's database."""
        path.write_text(self._client(["pg_dump", "--no-owner", "--no-privileges", f"--dbname={name}"]).stdout)

    def load_database(self, name: str, path: Path) -> None:
        """Run dump_database's SQL from `path` into database `name` (new and empty), stopping at
        the first error."""
        self._client(["psql", "--quiet", "--no-psqlrc", "--set=ON_ERROR_STOP=1", f"--dbname={name}"],
                     input=path.read_text())

    def processes(self) -> list[int]:
        """Live processes of this cluster: in the postmaster's process group or working in its data dir."""
        data = str(self.data_dir)
        found = []
        for pid in _pids():
            group = _pgrp(pid)
            if group is None:
                continue
            if (self.pgid is not None and group == self.pgid) or _cwd(pid) in (data, data + " (deleted)"):
                found.append(pid)
        return found

    def stop(self) -> None:
        """Stop the server (idempotent): pg_ctl stop -m fast, then SIGKILL whatever is left."""
        atexit.unregister(self.stop)
        try:
            if self._lock_fd is not None:
                self._stop_cluster(leftover=False)
                shutil.rmtree(self.data_dir, ignore_errors=True)
        finally:
            self.port = None
            self.pgid = None
            self._release_lock()

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----- internals ------------------------------------------------------------------------

    def _take_lock(self) -> None:
        fd = os.open(self.root / "server.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode().strip()
            os.close(fd)
            raise PostgresInUse(f"{self.root} is in use by a live process (pid {holder or '?'})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    def _run_as_user(self, args: list[str], timeout: float) -> subprocess.CompletedProcess:
        """Run a PostgreSQL program as the cluster's OS user (never root), output captured."""
        switch = {}
        if os.geteuid() != self.os_user.pw_uid:
            switch = {"user": self.os_user.pw_uid, "group": self.os_user.pw_gid, "extra_groups": []}
        env = {
            "PATH": f"{self.bindir}:/usr/bin:/bin",
            "HOME": self.os_user.pw_dir,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
        }
        return subprocess.run(
            [str(self.bindir / args[0]), *args[1:]],
            cwd=self.root,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            **switch,
        )

    def _client(self, args: list[str], input: str | None = None) -> subprocess.CompletedProcess:
        """Run a PostgreSQL client program against this server (over TCP, as the superuser)."""
        if self.port is None:
            raise PostgresError("the server is not running")
        env = {
            "PATH": f"{self.bindir}:/usr/bin:/bin",
            "PGHOST": "127.0.0.1",
            "PGPORT": str(self.port),
            "PGUSER": SUPERUSER,
            "PGPASSWORD": self.password,
            "LC_ALL": "C.UTF-8",
        }
        done = subprocess.run([str(self.bindir / args[0]), *args[1:]], env=env, input=input,
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise PostgresError(f"{args[0]} exited {done.returncode}: {done.stderr[-2000:]}")
        return done

    def _chown(self, path: Path) -> None:
        if os.geteuid() != self.os_user.pw_uid:
            os.chown(path, self.os_user.pw_uid, self.os_user.pw_gid)

    def _check_reachable(self) -> None:
        """Every folder above the data dir must be searchable by the cluster's OS user."""
        uid, groups = self.os_user.pw_uid, {self.os_user.pw_gid}
        groups |= {g for g in os.getgrouplist(self.os_user.pw_name, self.os_user.pw_gid)}
        for folder in [self.root, *self.root.parents]:
            st = folder.stat()
            if st.st_uid == uid:
                ok = st.st_mode & 0o100
            elif st.st_gid in groups:
                ok = st.st_mode & 0o010
            else:
                ok = st.st_mode & 0o001
            if not ok:
                raise PostgresError(
                    f"{folder} is not searchable by OS user {self.os_user.pw_name}: put the cluster elsewhere"
                )

    def _initdb(self) -> None:
        self.root.chmod(0o755)
        self.data_dir.mkdir(mode=0o700)
        self._chown(self.data_dir)
        self.log_file.write_text("")
        self._chown(self.log_file)
        self.password = secrets.token_hex(16)
        pwfile = self.root / "initdb.pw"
        pwfile.write_text(self.password + "\n")
        pwfile.chmod(0o600)
        self._chown(pwfile)
        try:
            result = self._run_as_user(
                [
                    "initdb",
                    f"--pgdata={self.data_dir}",
                    f"--username={SUPERUSER}",
                    f"--pwfile={pwfile}",
                    "--auth-local=peer",
                    "--auth-host=scram-sha-256",
                    "--encoding=UTF8",
                    "--locale=C",
                    "--no-sync",
                    "--no-instructions",
                ],
                timeout=120,
            )
        finally:
            pwfile.unlink(missing_ok=True)
        if result.returncode != 0:
            raise PostgresError(f"initdb failed ({result.returncode}): {result.stdout}{result.stderr}")
        with open(self.data_dir / "postgresql.conf", "a") as conf:
            conf.write("\n# localcloud.postgres: a private test server\n")
            conf.writelines(f"{key} = {value}\n" for key, value in SERVER_SETTINGS.items())

    def _start_postmaster(self) -> None:
        for _attempt in range(5):
            port = free_port()
            result = self._run_as_user(
                [
                    "pg_ctl",
                    "start",
                    f"--pgdata={self.data_dir}",
                    f"--log={self.log_file}",
                    "--wait",
                    f"--timeout={int(self.startup_timeout)}",
                    f"--options=-p {port}",
                ],
                timeout=self.startup_timeout + 10,
            )
            postmaster = self._postmaster_pid()
            if result.returncode == 0 and postmaster:
                self.port, self.pgid = port, os.getpgid(postmaster)
                return
            self._stop_cluster(leftover=False)
            log = self.log_file.read_text(errors="replace")[-2000:]
            if "Address already in use" not in log and "could not create any TCP/IP sockets" not in log:
                raise PostgresError(f"pg_ctl start failed ({result.returncode}): {result.stdout}{result.stderr}\n{log}")
        raise PostgresError("no free port for PostgreSQL after 5 tries")

    def _postmaster_pid(self) -> int | None:
        """The pid in DATA/postmaster.pid when it is this cluster's live postmaster."""
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None
        if _pgrp(pid) is None or _cwd(pid) != str(self.data_dir):
            return None
        return pid

    def _stop_cluster(self, leftover: bool) -> None:
        """pg_ctl stop (fast; immediate for a dead run's leftover), then SIGKILL what remains."""
        if self.pgid is None:
            postmaster = self._postmaster_pid()
            if postmaster:
                self.pgid = os.getpgid(postmaster)
        if self._postmaster_pid():
            self._run_as_user(
                [
                    "pg_ctl",
                    "stop",
                    f"--pgdata={self.data_dir}",
                    f"--mode={'immediate' if leftover else 'fast'}",
                    "--wait",
                    f"--timeout={int(self.stop_timeout)}",
                ],
                timeout=self.stop_timeout + 10,
            )
        deadline = time.monotonic() + 15
        while True:
            remaining = self.processes()
            if not remaining:
                break
            if self.pgid is not None:
                try:
                    os.killpg(self.pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for pid in remaining:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise PostgresError(f"PostgreSQL processes {remaining} of {self.data_dir} did not go away")
            time.sleep(0.05)  # polling interval while the kernel reaps them
        self.pgid = None

    def _admin(self, statement: str) -> None:
        import psycopg2

        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                connection = psycopg2.connect(
                    host="127.0.0.1", port=self.port, user=SUPERUSER, password=self.password, dbname="postgres"
                )
                break
            except psycopg2.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)  # polling interval until the server accepts connections
        try:
            connection.autocommit = True
            with connection.cursor() as cursor:
                cursor.execute(statement)
        finally:
            connection.close()
