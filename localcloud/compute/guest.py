"""The guest agent's account handling, done from the host side on a VM's files.

Compute Engine's guest agent turns the `ssh-keys` metadata item into local accounts: each
line `USER:KEYTYPE BASE64 [COMMENT]` makes USER exist (home from the image's skel) and
writes exactly that user's keys to `~/.ssh/authorized_keys`, and puts the user in the
`google-sudoers` group, which the agent's /etc/sudoers.d/google_sudoers gives passwordless sudo
(guest-agent google_guest_agent/non_windows_accounts.go: createGoogleUser, createSudoersGroup,
createSudoersFile; Debian's real sudo in the VM reads it, see vm.py). Users whose keys
disappear from the metadata keep their account but lose their keys and that group
(removeGoogleUser). Only the
instance's `ssh-keys` are read (project-wide keys are not). With OS Login in effect
(`enable-oslogin`, the instance's value over the project's) the agent leaves accounts alone,
and the OS Login accounts resolve instead: on a real image guest-oslogin's NSS module asks the
metadata server at each lookup (nss_oslogin), pam_mkhomedir makes the home at the first login and
an account with roles/compute.osAdminLogin gets passwordless sudo (/var/google-sudoers.d/USER).
Here they are written into the VM's passwd and group with their home (`os_login_accounts`, from
localcloud/oslogin), in google-sudoers: the local cloud has no IAM, every account is an admin.

The VM's /etc/passwd, /etc/group and /etc/shadow are per-VM files bind-mounted over the
originals, so they are edited in place (truncate + write): a rename would leave the bind
mount pointing at the old inode.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
from pathlib import Path

from ..oslogin.guest import OS_LOGIN_SWITCH

_USER = re.compile(r"[a-z_][a-z0-9_.-]{0,31}")
_KEY_TYPES = re.compile(r"(ssh-(rsa|dss|ed25519)|ecdsa-sha2-nistp(256|384|521)|sk-\S+)")
FIRST_UID = 1001
SUDOERS_GROUP = "google-sudoers"


def parse_ssh_keys(value: str, now: dt.datetime | None = None) -> dict[str, list[str]]:
    """`ssh-keys` metadata → {user: [key lines]}; invalid and expired lines are skipped."""
    now = now or dt.datetime.now(dt.timezone.utc)
    keys: dict[str, list[str]] = {}
    for line in value.splitlines():
        line = line.strip()
        if not line or ":" not in line:
            continue
        user, key = line.split(":", 1)
        key = key.strip()
        fields = key.split()
        if not _USER.fullmatch(user) or len(fields) < 2 or not _KEY_TYPES.fullmatch(fields[0]):
            continue
        if _expired(fields, now):
            continue
        keys.setdefault(user, []).append(key)
    return keys


def _expired(fields: list[str], now: dt.datetime) -> bool:
    # gcloud's ssh keys end in `google-ssh {"userName": ..., "expireOn": ...}`.
    if len(fields) < 4 or fields[2] != "google-ssh":
        return False
    try:
        expire_on = json.loads(" ".join(fields[3:])).get("expireOn")
        when = dt.datetime.fromisoformat(expire_on.replace("Z", "+00:00"))
    except (ValueError, AttributeError, TypeError):
        return False
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when <= now


def metadata_value(metadata: dict | None, key: str) -> str | None:
    for item in (metadata or {}).get("items") or []:
        if item.get("key") == key:
            return item.get("value")
    return None


def parse_bool(value: str | None) -> bool | None:
    """A boolean metadata value as the guest agent reads it (Go's strconv.ParseBool in its
    metadata package); anything else counts as not set."""
    if value in ("1", "t", "T", "TRUE", "true", "True"):
        return True
    if value in ("0", "f", "F", "FALSE", "false", "False"):
        return False
    return None


def os_login_enabled(metadata: dict | None, project_metadata: dict | None) -> bool:
    """`enable-oslogin`: the instance's value wins over the project's (guest-agent oslogin.go,
    getOSLoginEnabled; Google's "Setting up OS Login": enable it project-wide, set FALSE on
    the instances that cannot use it yet)."""
    enabled = parse_bool(metadata_value(project_metadata, "enable-oslogin"))
    instance = parse_bool(metadata_value(metadata, "enable-oslogin"))
    return bool(instance if instance is not None else enabled)


class GuestAccounts:
    """Accounts of one VM, given its host-side directory (see vm.SandboxVM)."""

    def __init__(self, vm_dir: Path, skel: Path | None) -> None:
        self.vm_dir = vm_dir
        self.skel = skel if skel and skel.is_dir() else None
        self.etc = vm_dir / "etc"
        self.home = vm_dir / "home"
        self.state_file = vm_dir / "guest-users.json"

    def managed_users(self) -> dict[str, int]:
        """Users the agent has created or given keys: {name: number of keys}."""
        try:
            return json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return {}

    def apply_metadata(
        self, metadata: dict | None, project_metadata: dict | None = None, os_login_accounts: list[dict] = ()
    ) -> None:
        """One pass of the agent's accounts manager over instance and project metadata.

        With OS Login in effect the accounts manager does not run at all (guest-agent
        non_windows_accounts.go: disabled() is true when OS Login is enabled): no user or key
        comes from `ssh-keys`; turning OS Login off makes the next pass apply them again. The
        OS Login accounts (PosixAccount JSON) resolve then, as NSS would resolve them.
        """
        enabled = os_login_enabled(metadata, project_metadata)
        self._switch_os_login(enabled)
        if enabled:
            self._ensure_os_login_accounts(os_login_accounts)
            return
        keys = parse_ssh_keys(metadata_value(metadata, "ssh-keys") or "")
        self._ensure_sudoers_group()
        passwd = read_table(self.etc / "passwd")
        managed = self.managed_users()
        for user, user_keys in keys.items():
            entry = passwd.get(user)
            if entry is None:
                entry = self._create_user(user, passwd)
            elif self._host_home(entry) is None:
                # System accounts other than root (sshd, daemon, ...) are left alone.
                continue
            self._write_keys(user, entry, user_keys)
            _set_group_member(self.etc / "group", SUDOERS_GROUP, user, True)
            managed[user] = len(user_keys)
        for user in list(managed):
            if user not in keys and user in passwd:
                self._write_keys(user, passwd[user], [])
                _set_group_member(self.etc / "group", SUDOERS_GROUP, user, False)
                managed[user] = 0
        self.state_file.write_text(json.dumps(managed, sort_keys=True))

    def _switch_os_login(self, enabled: bool) -> None:
        """The agent's sshd setting for OS Login, as a switch the VM's AuthorizedKeysCommand reads
        (its /etc/ssh/OS_LOGIN_SWITCH: localcloud/oslogin/guest.py)."""
        folder = self.vm_dir / "etc-ssh"
        if not folder.is_dir():
            return
        if enabled:
            (folder / OS_LOGIN_SWITCH).write_text("enable-oslogin\n")
        else:
            (folder / OS_LOGIN_SWITCH).unlink(missing_ok=True)

    def _ensure_os_login_accounts(self, accounts: list[dict]) -> None:
        """Each OS Login account in the VM's passwd, group and shadow (its uid, gid, home and shell
        from the profile, as nss_oslogin's ParseJsonToPasswd reads them), its home made, in
        google-sudoers. An account already there is left as it is."""
        if not accounts:
            return
        self._ensure_sudoers_group()
        passwd = read_table(self.etc / "passwd")
        for account in accounts:
            user = account.get("username") or ""
            if not _USER.fullmatch(user) or user in passwd:
                continue
            uid = int(account["uid"])
            gid = int(account.get("gid") or 0) or uid
            self._create_user(user, passwd, uid=uid, gid=gid, shell=account.get("shell") or "/bin/bash")
            _set_group_member(self.etc / "group", SUDOERS_GROUP, user, True)

    def _ensure_sudoers_group(self) -> None:
        """The agent's `groupadd google-sudoers`, if the group is missing, and its sudoers file.
        The group's gid is taken below 1000 (the highest free one), so the users' own gids stay
        what they were without it."""
        self._ensure_sudoers_file()
        group = read_table(self.etc / "group")
        if SUDOERS_GROUP in group:
            return
        used = {int(e[2]) for e in group.values() if len(e) > 2 and e[2].isdigit()}
        gid = next(g for g in range(999, 100, -1) if g not in used)
        _append_line(self.etc / "group", f"{SUDOERS_GROUP}:x:{gid}:")

    def _ensure_sudoers_file(self) -> None:
        """The agent's createSudoersFile: /etc/sudoers.d/google_sudoers, created once (O_EXCL,
        mode 0440), holding `%google-sudoers ALL=(ALL:ALL) NOPASSWD:ALL`. The VM's /etc/sudoers.d
        is its own (vm.py), so Debian's real sudo in the VM reads it and the host's is untouched."""
        folder = self.etc / "sudoers.d"
        folder.mkdir(mode=0o755, exist_ok=True)
        try:
            fd = os.open(folder / "google_sudoers", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o440)
        except FileExistsError:
            return
        with os.fdopen(fd, "w") as f:
            f.write(f"%{SUDOERS_GROUP} ALL=(ALL:ALL) NOPASSWD:ALL\n")

    def _create_user(
        self, user: str, passwd: dict[str, list[str]], *, uid: int | None = None, gid: int | None = None,
        shell: str = "/bin/bash",
    ) -> list[str]:
        """A new user with its own group and home (from skel); its uid and gid the first free
        from FIRST_UID unless given (an OS Login account's)."""
        group = read_table(self.etc / "group")
        used_uids = {int(e[2]) for e in passwd.values()}
        used_gids = {int(e[2]) for e in group.values()}
        if uid is None:
            uid = FIRST_UID
            while uid in used_uids:
                uid += 1
        if gid is None:
            gid = uid
            while gid in used_gids:
                gid += 1
        entry = [user, "x", str(uid), str(gid), "", f"/home/{user}", shell]
        days = (dt.date.today() - dt.date(1970, 1, 1)).days
        # `*` (not `!`) in the password field: no password, yet not "locked" for sshd.
        _append_line(self.etc / "group", f"{user}:x:{gid}:")
        _append_line(self.etc / "shadow", f"{user}:*:{days}:0:99999:7:::")
        _append_line(self.etc / "passwd", ":".join(entry))
        passwd[user] = entry

        home = self.home / user
        home.mkdir(mode=0o750, exist_ok=True)
        if self.skel:
            subprocess.run(["cp", "-a", "--", f"{self.skel}/.", str(home)], check=True)
        _chown_tree(home, uid, gid)
        # StrictModes: the home must not be group/world writable.
        os.chmod(home, 0o750)
        return entry

    def _host_home(self, entry: list[str]) -> Path | None:
        """Host path of a user's home, if it is one of the VM's own directories."""
        home = entry[5]
        if home == "/root" and entry[2] == "0":
            # The VM's /root is its own; keys written there are refused by sshd anyway
            # (PermitRootLogin no), as on Compute Engine images.
            return self.vm_dir / "root"
        if int(entry[2]) >= 1000 and home.startswith("/home/") and "/../" not in home:
            return self.home / home[len("/home/") :]
        return None

    def _write_keys(self, user: str, entry: list[str], keys: list[str]) -> None:
        uid, gid = int(entry[2]), int(entry[3])
        home = self._host_home(entry)
        if home is None or not home.is_dir() or home.is_symlink():
            return
        # Written as root on the host into a directory the VM user controls: never follow a
        # link the user may have planted.
        ssh_dir = home / ".ssh"
        if ssh_dir.is_symlink() or (ssh_dir.exists() and not ssh_dir.is_dir()):
            ssh_dir.unlink()
        if not ssh_dir.exists():
            ssh_dir.mkdir(mode=0o700)
        os.lchown(ssh_dir, uid, gid)
        os.chmod(ssh_dir, 0o700)
        tmp = ssh_dir / ".authorized_keys.localcloud"
        if tmp.exists() or tmp.is_symlink():
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{key}\n" for key in keys))
        os.lchown(tmp, uid, gid)
        os.replace(tmp, ssh_dir / "authorized_keys")


def _set_group_member(path: Path, group: str, user: str, member: bool) -> None:
    """Add or remove `user` in `group`'s member list (gpasswd -a / -d), in place."""
    with open(path, "r+") as f:
        lines = f.read().splitlines()
        changed = False
        for n, line in enumerate(lines):
            fields = line.split(":")
            if len(fields) == 4 and fields[0] == group:
                members = [m for m in fields[3].split(",") if m]
                if member and user not in members:
                    members.append(user)
                elif not member and user in members:
                    members.remove(user)
                else:
                    return
                fields[3] = ",".join(members)
                lines[n] = ":".join(fields)
                changed = True
        if changed:
            f.seek(0)
            f.write("".join(f"{line}\n" for line in lines))
            f.truncate()


def read_table(path: Path) -> dict[str, list[str]]:
    table = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            fields = line.split(":")
            table[fields[0]] = fields
    return table


def _append_line(path: Path, line: str) -> None:
    # In place (r+ then truncate), never a new file: the VM sees this file via a bind mount.
    with open(path, "r+") as f:
        text = f.read()
        if text and not text.endswith("\n"):
            text += "\n"
        f.seek(0)
        f.write(text + line + "\n")
        f.truncate()


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    os.lchown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, gid)

