"""What a boot disk holds, and how an image made from one (images.insert with `sourceDisk`)
gives it to the next VM.

A sandbox VM's own files are its folders under STATE_DIR/vms/NAME/ (see vm.py); the rest of
its filesystem is the host's, read-only to the VM user. Of those folders, these are on a real
VM's boot disk and so go into an image of it:
    etc/passwd, etc/group, etc/shadow   the accounts (a user the guest agent made exists in
                                        every VM booted from the image, with the same uid)
    home/  root/  var-tmp/              the users' files (a venv installed in a home, say)
    guest-users.json                    the guest agent's own list of the users it manages
                                        (google-guest-agent keeps it on the disk too)
Not on the disk: tmp/ (Ubuntu empties /tmp at every boot, systemd's tmp.conf), shm/ (RAM), and
etc-ssh/: a new VM gets host keys of its own (the guest agent regenerates them on a new
instance id, google-guest-agent's instance_setup), so no two VMs share a host key.

An image folder made here holds `disk/` (the files above) next to `skel/` (the /etc/skel of the
image it came from, which a *new* user's home is copied from) and `environment.json` (the
/etc/environment the image's SSH sessions get, see `image_environment`).

On Compute Engine a new VM from such an image keeps every home of the disk: the guest agent
adds keys to an existing user and copies /etc/skel only for a user it creates. So a user name
seen at bake time finds its home as it was; another user name starts from /etc/skel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

DISK_DIR = "disk"
ENVIRONMENT_FILE = "environment.json"
ACCOUNT_FILES = ("passwd", "group", "shadow")
DISK_FOLDERS = ("home", "root", "var-tmp")
AGENT_STATE = "guest-users.json"


def skel(image_dir: Path | None) -> Path | None:
    """The image's /etc/skel, which the guest agent copies a new user's home from."""
    return image_dir / "skel" if image_dir else None


def _copy_tree(source: Path, target: Path) -> None:
    """Copy a folder with owners, modes and symlinks kept (as a disk copy would)."""
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-a", "--", f"{source}/.", str(target)], check=True)


def capture(vm_root: Path, source_image: Path | None, target: Path) -> int:
    """Write an image of the VM at `vm_root` (booted from `source_image`) into `target`, a new
    folder; returns the bytes of the disk's files (the image's archive size)."""
    target.mkdir(parents=True)
    disk = target / DISK_DIR
    (disk / "etc").mkdir(parents=True)
    _copy_disk_files(vm_root, disk)
    if source_image is not None and (source_image / "skel").is_dir():
        _copy_tree(source_image / "skel", target / "skel")
    (target / ENVIRONMENT_FILE).write_text(json.dumps(image_environment(source_image), indent=1))
    os.chmod(target, 0o755)
    return sum(
        (Path(folder) / name).lstat().st_size for folder, _, names in os.walk(disk) for name in names
    )


def restore(image_dir: Path | None, vm_root: Path) -> None:
    """Put the disk of an image made by `capture` onto a freshly prepared VM (before it starts);
    an image without a disk (a local base image) leaves the VM as prepared."""
    disk = image_dir / DISK_DIR if image_dir else None
    if disk is not None and disk.is_dir():
        _copy_disk_files(disk, vm_root)


def _copy_disk_files(source: Path, target: Path) -> None:
    """The boot disk's files from one root to another (a VM's folder and an image's disk/ have
    the same layout)."""
    for name in ACCOUNT_FILES:
        # Into the existing file when there is one: a VM bind-mounts these files at boot.
        shutil.copyfile(source / "etc" / name, target / "etc" / name)
    for folder in DISK_FOLDERS:
        if (source / folder).is_dir():
            _copy_tree(source / folder, target / folder)
    if (source / AGENT_STATE).is_file():
        shutil.copy2(source / AGENT_STATE, target / AGENT_STATE)


def image_environment(image_dir: Path | None) -> dict[str, str]:
    """The environment an image gives every SSH session of its VMs (its /etc/environment, which
    pam_env reads on a real VM; here the sshd's SetEnv), e.g. a PATH with the image's tools."""
    path = image_dir / ENVIRONMENT_FILE if image_dir else None
    if path is None or not path.is_file():
        return {}
    return json.loads(path.read_text())
