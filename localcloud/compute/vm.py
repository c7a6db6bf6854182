"""Sandbox VMs: one OpenSSH sshd per instance, in its own mount, PID and UTS namespaces.

Layout on the host, `STATE_DIR/vms/NAME/`:
    vm.json        name, ip, host pid (+ start time) of `unshare`, PID namespace, owner pid
    etc/           the VM's passwd, group, shadow and hosts (bind-mounted over /etc/...), and
                   its sudoers.d (over /etc/sudoers.d)
    etc-ssh/       sshd_config (with a SetEnv line for the VM environment), host keys, moduli
                   (bind-mounted over /etc/ssh)
    home/ tmp/ var-tmp/ shm/ root/  bind-mounted over /home, /tmp, /var/tmp, /dev/shm, /root
    var-lib/ var-cache-apt/  the VM's dpkg lock files (over /var/lib/dpkg/lock-frontend and lock),
                   its /var/lib/apt and /var/cache/apt (apt's lists and archives locks)
    sshd.log       sshd's stderr
`STATE_DIR/vm-etc/` is bind-mounted read-only at /run/localcloud in every VM.

`unshare --pid --fork --kill-child` makes sshd PID 1 of the VM's PID namespace; SIGKILL to the
host-side unshare kills it, and the kernel then kills every other process of that namespace,
including ones a user detached with `setsid nohup`.

Each VM has its own hostname (UTS namespace), as the guest agent sets it on Compute Engine: the
first label of the instance's metadata hostname (NAME.ZONE.c.PROJECT.internal by default), and an
/etc/hosts line "IP FQDN HOSTNAME" (guest-agent google_guest_agent/hostname/hostname.go).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

HOST_KEY_TYPES = ("ed25519", "ecdsa", "rsa")

# Runs as PID 1 of the new namespaces, then becomes sshd. $1 = state dir, $2 = VM name,
# $3 = the VM's hostname (its own UTS namespace), $4 and $5 = the first boot's seconds of
# cloud-init running and of the dpkg lock held (first_boot.py; 0 and 0: no first-boot phase).
# The state dir is first bound at /mnt so that every source stays reachable even when the
# state dir lives under a directory that is overlaid below (/tmp, /home, /run); that staging
# mount is dropped again before sshd starts.
# The VM's users get real root through Debian's sudo (/etc/sudoers.d is the VM's own, where the
# guest agent writes google_sudoers; guest.py). What root may reach is the host's, so the host's
# root filesystem is read-only in the VM and the VM's own files are put over what sudo'd commands
# use: /usr/bin and /usr/sbin get a read-only overlay whose top layer holds the VM's apt-get, apt,
# cloud-init and unattended-upgrade and its shutdown, poweroff and halt (first_boot.py,
# guest_power.py; an overlay, not file binds, because the host has no /usr/bin/cloud-init to bind
# over and its /usr/sbin/shutdown is a link to systemctl), and each dpkg/apt lock file is the VM's
# own, so each VM's locks are its own and the host's are untouched.
_BOOT_SCRIPT = r"""
set -eu
hostname "$3"
mount --bind "$1" /mnt
V="/mnt/vms/$2"
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run
mkdir -p /run/sshd /run/localcloud
mount --bind -o ro /mnt/vm-etc /run/localcloud
mount --bind "$V/etc-ssh" /etc/ssh
for f in passwd group shadow hosts; do mount --bind "$V/etc/$f" "/etc/$f"; done
mount --bind "$V/etc/sudoers.d" /etc/sudoers.d
mount -t overlay overlay -o ro,lowerdir=/run/localcloud/guest-os/usr-bin:/usr/bin /usr/bin
mount -t overlay overlay -o ro,lowerdir=/run/localcloud/guest-os/usr-sbin:/usr/sbin /usr/sbin
for lock in dpkg/lock-frontend dpkg/lock; do
  [ -e "/var/lib/$lock" ] || : >"/var/lib/$lock"  # what dpkg itself creates on its first run
  mount --bind "$V/var-lib/$lock" "/var/lib/$lock"
done
mount --bind "$V/var-lib/apt" /var/lib/apt
mount --bind "$V/var-cache-apt" /var/cache/apt
mount --bind "$V/home" /home
mount --bind "$V/root" /root
mount --bind "$V/shm" /dev/shm
mount --bind "$V/var-tmp" /var/tmp
mount --bind "$V/tmp" /tmp
umount /mnt
# The host's root filesystem read-only for this VM's root (this namespace's mount only: the host's
# stays read-write): what a sudo'd command writes outside the VM's own mounts fails instead of
# changing the host. It keeps a script's mistakes out, not a determined root (who may remount).
mount -o remount,bind,ro /
# The first boot (first_boot.py): cloud-init's status (running for $4 s), the upgrade job's locks
# (held for $5 s); each returns once its state is in place, before sshd answers.
/usr/bin/cloud-init localcloud-boot "$4"
[ "$5" = 0 ] || /usr/bin/unattended-upgrade --localcloud-hold "$5"
exec /usr/sbin/sshd -D -e
"""

_SSHD_CONFIG = """\
# Written by localcloud: the sshd of a sandbox VM (Compute Engine image defaults).
ListenAddress {ip}
Port 22
HostKey /etc/ssh/ssh_host_ed25519_key
HostKey /etc/ssh/ssh_host_ecdsa_key
HostKey /etc/ssh/ssh_host_rsa_key
PidFile /run/sshd.pid
PermitRootLogin no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
UsePAM no
StrictModes yes
AuthorizedKeysFile .ssh/authorized_keys
# OS Login's keys, as the guest agent configures sshd (localcloud/oslogin/guest.py): none while
# OS Login is off for the VM.
AuthorizedKeysCommand /run/localcloud/guest-bin/google_authorized_keys
AuthorizedKeysCommandUser root
Subsystem sftp internal-sftp
ClientAliveInterval 120
ClientAliveCountMax 3
TCPKeepAlive yes
AcceptEnv LANG LC_*
PrintMotd no
X11Forwarding no
MaxStartups 100:30:200
"""

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def setenv_line(env: dict[str, str]) -> str:
    """The sshd_config `SetEnv` line: what every SSH session of the VM finds in its environment
    (the local cloud's stand-in for what a real VM gets from its image and service account).
    One line only: sshd uses the first SetEnv directive and ignores later ones."""
    words = []
    for name, value in sorted(env.items()):
        if not _ENV_NAME.fullmatch(name) or not isinstance(value, str) or any(c in value for c in '"\\\n\r'):
            raise VMError(f"VM environment variable {name}={value!r} cannot be written as an sshd SetEnv")
        words.append(f'"{name}={value}"')
    return f"SetEnv {' '.join(words)}\n" if words else ""


class VMError(RuntimeError):
    pass


class SandboxVM:
    def __init__(
        self,
        state_dir: Path,
        name: str,
        ip: str,
        owner_pid: int | None = None,
        env: dict[str, str] | None = None,
        fqdn: str | None = None,
        first_boot: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        """`fqdn`: the instance's hostname as the metadata server gives it (default: `name`).
        `first_boot`: seconds of cloud-init running and of the dpkg lock held after boot
        (first_boot.FirstBoot; (0, 0): none)."""
        self.first_boot = first_boot
        self.state_dir = state_dir
        self.env = dict(env or {})
        self.name = name
        self.ip = ip
        self.fqdn = fqdn or name
        self.hostname = self.fqdn.split(".", 1)[0]
        self.owner_pid = owner_pid or os.getpid()
        self.root = state_dir / "vms" / name
        self.proc: subprocess.Popen | None = None
        self.ns_init_pid: int | None = None
        self.pidns: str | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def prepare(self) -> None:
        """Create the VM's files: /etc copies, host keys, sshd_config, empty dirs."""
        if self.root.exists():
            shutil.rmtree(self.root)
        # VM users share uids across VMs (1001, ...): the host path of every VM's files must
        # stay closed to them; they reach their own only through the bind mounts.
        self.root.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root.parent, 0o700)
        (self.state_dir / "vm-etc").mkdir(parents=True, exist_ok=True)
        for sub, mode in (("etc", 0o755), ("etc-ssh", 0o755), ("home", 0o755), ("root", 0o700), ("tmp", 0o1777), ("var-tmp", 0o1777), ("shm", 0o1777),
                          ("etc/sudoers.d", 0o755), ("var-lib", 0o755), ("var-lib/dpkg", 0o755), ("var-lib/apt", 0o755),
                          ("var-lib/apt/lists", 0o755), ("var-cache-apt", 0o755), ("var-cache-apt/archives", 0o755)):
            path = self.root / sub
            path.mkdir(parents=True)
            os.chmod(path, mode)
        # The VM's own dpkg and apt lock files, as dpkg and apt create them (root, 0640: apt's
        # GetLock opens with mode 0640, so a user who is not root cannot open them).
        for lock in ("var-lib/dpkg/lock-frontend", "var-lib/dpkg/lock", "var-lib/apt/lists/lock", "var-cache-apt/archives/lock"):
            (self.root / lock).touch(mode=0o640)
            os.chmod(self.root / lock, 0o640)
        for name in ("passwd", "group", "shadow"):
            shutil.copy2(f"/etc/{name}", self.root / "etc" / name)
        # The machine's hosts file plus the line the guest agent writes for the VM's address.
        hosts = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else "127.0.0.1 localhost\n"
        hosts = hosts if hosts.endswith("\n") else hosts + "\n"
        (self.root / "etc" / "hosts").write_text(f"{hosts}{self.ip} {self.fqdn} {self.hostname}\n")
        ssh = self.root / "etc-ssh"
        if Path("/etc/ssh/moduli").exists():
            shutil.copy2("/etc/ssh/moduli", ssh / "moduli")
        # Three key types generated side by side, as a Debian image's `ssh-keygen -A` does. The rsa
        # host key is 1024 bits (OpenSSH's RequiredRSASize floor), not 3072: a client checks any
        # size the same way and the pipeline pins the ed25519 key, while 3072 bits took 0.3-0.8 s
        # of CPU per VM here, 2048 0.25 s and 1024 0.015 s (the suite makes ~200 VMs).
        keygens = [
            subprocess.Popen(
                ["ssh-keygen", "-q", "-t", kind, *(["-b", "1024"] if kind == "rsa" else []), "-N", "", "-C",
                 f"root@{self.name}", "-f", str(ssh / f"ssh_host_{kind}_key")],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for kind in HOST_KEY_TYPES
        ]
        for proc in keygens:
            _, err = proc.communicate()
            if proc.returncode:
                raise VMError(f"ssh-keygen failed: {err.decode(errors='replace')}")
        (ssh / "sshd_config").write_text(_SSHD_CONFIG.format(ip=self.ip) + setenv_line(self.env))

    def start(self) -> None:
        with open(self.root / "sshd.log", "ab") as log_file:
            self.proc = subprocess.Popen(
                [
                    "unshare", "--mount", "--pid", "--uts", "--fork", "--kill-child", "--mount-proc",
                    "--propagation", "private",
                    "/bin/sh", "-c", _BOOT_SCRIPT, "vm-boot", str(self.state_dir), self.name, self.hostname,
                    *(f"{seconds:g}" for seconds in self.first_boot),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                close_fds=True,
                # Own session: a Ctrl-C or a signal to the emulator's process group must not
                # kill VMs behind the emulator's back; the emulator deletes them itself.
                start_new_session=True,
            )
        self._write_record()

    def wait_ready(self, timeout: float) -> None:
        """Until sshd answers with its banner on IP:22 (bounded by `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise VMError(f"sshd of VM {self.name} exited during boot: {self.log_tail()}")
            try:
                with socket.create_connection((self.ip, 22), timeout=1.0) as sock:
                    if sock.recv(64).startswith(b"SSH-"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise VMError(f"sshd of VM {self.name} not ready after {timeout}s: {self.log_tail()}")
            time.sleep(0.02)
        # unshare's only child is the VM's PID 1 (sshd); its namespace identifies the VM's
        # processes for the wait at deletion.
        children = _children(self.proc.pid)
        self.ns_init_pid = children[0] if children else None
        self.pidns = _pidns(self.ns_init_pid) if self.ns_init_pid else None
        self._write_record()

    def pause_sshd(self) -> bool:
        """Freeze the VM's sshd (SIGSTOP): the kernel still completes TCP handshakes on port 22
        and queues the connections, but no SSH banner is sent, like a hung sshd. False if there
        is no sshd to freeze."""
        return self._signal_sshd(signal.SIGSTOP)

    def resume_sshd(self) -> bool:
        """Let a frozen sshd go on (SIGCONT): it serves the queued connections, then new ones."""
        return self._signal_sshd(signal.SIGCONT)

    def _signal_sshd(self, signum: int) -> bool:
        if not self.alive() or not self.ns_init_pid or _pidns(self.ns_init_pid) != self.pidns:
            return False
        try:
            os.kill(self.ns_init_pid, signum)
        except ProcessLookupError:
            return False
        return True

    def first_boot_state(self) -> dict:
        """What the VM's first boot shows now, seen from the host: cloud-init's state from its
        status files in the VM's /run ("running", "done", or None before it wrote any), and the
        host pid of the VM's unattended-upgr while it runs (None after: it then released dpkg's
        lock)."""
        state: dict = {"cloud_init": None, "dpkg_lock_holder": None}
        if not self.alive() or not self.ns_init_pid or not self.pidns or _pidns(self.ns_init_pid) != self.pidns:
            return state
        run = Path(f"/proc/{self.ns_init_pid}/root/run/cloud-init")  # the VM's own /run
        if (run / "result.json").exists():
            state["cloud_init"] = "done"
        elif (run / "status.json").exists():
            state["cloud_init"] = "running"
        if self.first_boot[1] <= 0:
            # No lock holder was started: no scan of /proc (every pid's namespace link), which each
            # read of vms() would otherwise pay per VM: the suite's waits read vms() often.
            return state
        for pid in pids_in_namespace(self.pidns):
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == "unattended-upgr":
                    state["dpkg_lock_holder"] = pid
            except OSError:
                pass
        return state

    def log_tail(self, size: int = 2000) -> str:
        try:
            return (self.root / "sshd.log").read_text(errors="replace")[-size:]
        except FileNotFoundError:
            return ""

    def host_keys(self) -> list[tuple[str, str]]:
        """[(key type, base64 blob)] as the guest agent publishes them in guest attributes."""
        keys = []
        for kind in HOST_KEY_TYPES:
            path = self.root / "etc-ssh" / f"ssh_host_{kind}_key.pub"
            if path.exists():
                fields = path.read_text().split()
                keys.append((fields[0], fields[1]))
        return keys

    def manifest(self) -> list[dict]:
        """Regular files under the VM's /dev/shm and /home: [{path, size, mtime}], VM-relative
        (mtime in seconds since the epoch: when a step's marker file was written, e.g. the
        training's pid and exit_code files, which the bench reads after the VM is gone)."""
        entries = []
        for top, prefix in ((self.root / "shm", "dev/shm"), (self.root / "home", "home")):
            for dirpath, _dirnames, filenames in os.walk(top):
                for filename in filenames:
                    path = Path(dirpath) / filename
                    st = os.lstat(path)
                    if stat.S_ISREG(st.st_mode):
                        entries.append({"path": f"{prefix}/{path.relative_to(top)}", "size": st.st_size, "mtime": st.st_mtime})
        return sorted(entries, key=lambda e: e["path"])

    def stop(self, timeout: float = 15.0) -> None:
        """Kill every process of the VM and wait until they are gone."""
        if self.proc is None:
            return
        # Once reaped, the unshare pid may belong to someone else, and a dead VM's namespace
        # inode may name a new VM's namespace: only a live VM is killed and waited for.
        alive = self.proc.poll() is None
        if alive:
            _kill(self.proc.pid)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise VMError(f"unshare of VM {self.name} (pid {self.proc.pid}) did not exit")
        if alive and self.pidns:
            _wait_namespace_empty(self.pidns, timeout)

    def destroy(self, deleted_dir: Path | None, keep_shm: bool = False) -> None:
        """Stop the VM, record its files in `deleted_dir/NAME.json`, remove its directory.

        With `keep_shm`, the VM's /dev/shm is moved to `deleted_dir/NAME-shm/` instead of being
        removed, for tests that inspect what a run left there (e.g. load an exported model).
        """
        self.stop()
        if deleted_dir is not None and self.root.exists():
            deleted_dir.mkdir(parents=True, exist_ok=True)
            tmp = deleted_dir / f".{self.name}.json.tmp"
            tmp.write_text(json.dumps(self.manifest(), indent=1))
            os.replace(tmp, deleted_dir / f"{self.name}.json")
            if keep_shm:
                kept = deleted_dir / f"{self.name}-shm"
                shutil.rmtree(kept, ignore_errors=True)
                os.replace(self.root / "shm", kept)
        shutil.rmtree(self.root, ignore_errors=True)

    def _write_record(self) -> None:
        record = {
            "name": self.name,
            "ip": self.ip,
            "pid": self.pid,
            "starttime": _starttime(self.pid) if self.pid else None,
            "ns_init_pid": self.ns_init_pid,
            "pidns": self.pidns,
            "owner_pid": self.owner_pid,
        }
        tmp = self.root / ".vm.json.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.root / "vm.json")


def reap_stale(state_dir: Path, only_owner: int | None = None, timeout: float = 15.0) -> list[str]:
    """Kill the processes of VMs left behind by a dead emulator and remove their dirs.

    With `only_owner`, only VMs started by that emulator pid are touched (so a launcher that
    cleans up after its own emulator never hits a newer emulator's VMs on the same dir).
    Returns the names reaped.
    """
    reaped = []
    vms_dir = state_dir / "vms"
    if not vms_dir.is_dir():
        return reaped
    for root in sorted(vms_dir.iterdir()):
        try:
            record = json.loads((root / "vm.json").read_text())
        except (FileNotFoundError, ValueError):
            record = None
        if only_owner is not None and (record is None or record.get("owner_pid") != only_owner):
            continue
        if record:
            pid = record.get("pid")
            # The recorded start time guards against killing an unrelated process that
            # reused the pid.
            if pid and _starttime(pid) == record.get("starttime"):
                _kill(pid)
                _wait(lambda: not _running(pid), timeout)
                # Only a namespace whose unshare was still alive is checked: a dead one's
                # namespace died with it, and its inode number may name a new one by now.
                if record.get("pidns"):
                    _wait_namespace_empty(record["pidns"], timeout)
        shutil.rmtree(root, ignore_errors=True)
        reaped.append(root.name)
    return reaped


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _wait_namespace_empty(pidns: str, timeout: float) -> None:
    # The kernel kills a PID namespace's processes when its init dies; anything still there
    # after that (it should not happen) is killed by hand.
    if _wait(lambda: not pids_in_namespace(pidns), min(timeout, 5.0)):
        return
    for pid in pids_in_namespace(pidns):
        _kill(pid)
    if not _wait(lambda: not pids_in_namespace(pidns), timeout):
        raise VMError(f"processes of PID namespace {pidns} survive: {pids_in_namespace(pidns)}")


def pids_in_namespace(pidns: str) -> list[int]:
    """Live (non-zombie) host pids whose PID namespace is `pidns` ("pid:[4026...]")."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if _pidns(pid) == pidns and _running(pid):
            pids.append(pid)
    return pids


def pid_namespace(pid: int) -> str | None:
    """The PID namespace of a host pid ("pid:[4026...]"), None if it is gone."""
    return _pidns(pid)


def _pidns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _stat_fields(pid: int) -> list[str] | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after "(comm)"; comm itself may contain spaces and parentheses.
    return data[data.rindex(")") + 2 :].split()


def _starttime(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return fields[19] if fields else None


def _running(pid: int) -> bool:
    """Exists and is not a zombie (a zombie holds no socket, file or mount any more)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]
