"""A sandbox VM's first boot (localcloud/compute/first_boot.py) through real SSH sessions, with
Debian's real sudo: cloud-init running, unattended-upgrades holding dpkg's lock, and the VM's
apt-get answering as apt 2.4 does; then the VM scripts' helpers (include/vm/lib.sh) passing
through it.

The VMs here are SandboxVMs without an emulator (no API, no power-off: cheap). Their holds are
short where a test waits for their end (a few seconds) and long (10 minutes) where a test shows
what meets the lock while it is held: such a VM is killed at the test's end, and its holder with it.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import paramiko
import pytest

from localcloud.compute.first_boot import install_guest_os
from localcloud.compute.guest import GuestAccounts
from localcloud.compute.leases import AddressLeases
from localcloud.compute.vm import SandboxVM, pids_in_namespace
from maxtext_sft.vm.steps import vm_scripts_dir
from tests.conftest import poll
from tests.localcloud.test_compute_emulator import exec_status, ssh, ssh_keys_line

HELD = 600.0  # a lock or a cloud-init run that outlasts the test (the VM is killed after it)
LIB = vm_scripts_dir() / "lib.sh"
FRONTEND = "/var/lib/dpkg/lock-frontend"


@pytest.fixture
def first_boot_vm(tmp_path):
    """Factory: `first_boot_vm(cloud_init_seconds, dpkg_lock_seconds)` boots a VM whose user
    `maxtext` is a google-sudoers member (as the guest agent makes every ssh-keys user) and
    `visitor` is not; returns (vm, client for maxtext, client for visitor). All stop after."""
    made: list[tuple[SandboxVM, list[paramiko.SSHClient]]] = []
    leases = AddressLeases()
    install_guest_os(tmp_path / "vm-etc", "localcloud-no-power-here")
    key = paramiko.ECDSAKey.generate()

    def boot(cloud_init_seconds: float, dpkg_lock_seconds: float):
        vm = SandboxVM(tmp_path, f"fb-{len(made)}", leases.allocate(), first_boot=(cloud_init_seconds, dpkg_lock_seconds),
                       env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"})
        vm.prepare()
        keys = ssh_keys_line("maxtext", key) + "\n" + ssh_keys_line("visitor", key)
        GuestAccounts(vm.root, None).apply_metadata({"items": [{"key": "ssh-keys", "value": keys}]})
        group = vm.root / "etc" / "group"
        text = group.read_text()
        with open(group, "r+") as f:  # in place: the VM sees the file through a bind mount
            f.write(text.replace(":maxtext,visitor\n", ":maxtext\n"))
            f.truncate()
        clients: list[paramiko.SSHClient] = []
        made.append((vm, clients))
        vm.start()
        vm.wait_ready(30)
        clients += [ssh(vm.ip, "maxtext", key), ssh(vm.ip, "visitor", key)]
        return vm, clients[0], clients[1]

    yield boot
    for vm, clients in made:
        for client in clients:
            client.close()
        vm.stop()
        leases.release(vm.ip)


def bash(client: paramiko.SSHClient, script: str, timeout: float = 60) -> tuple[int, str, str]:
    """Runs `script` with bash -c, stdin closed at once (an SSH step's), -> (status, stdout, stderr)."""
    stdin, stdout, stderr = client.exec_command(f"bash -c {shlex.quote(script)}", timeout=timeout)
    stdin.channel.shutdown_write()
    out, err = stdout.read().decode(), stderr.read().decode()
    return stdout.channel.recv_exit_status(), out, err


def holder(client: paramiko.SSHClient) -> int:
    """The VM pid of the process that holds dpkg's frontend lock, from ps: unattended-upgr, root."""
    rows = [line.split() for line in bash(client, "ps -eo pid=,user=,comm=")[1].splitlines()]
    [pid] = [int(pid) for pid, user, comm in rows if comm == "unattended-upgr" and user == "root"]
    return pid


def test_the_old_install_fails_on_a_vm_in_its_first_boot(first_boot_vm):
    """What install_maxtext.sh did before (DEBIAN_FRONTEND exported, `sudo apt-get` at once, no
    lock wait) fails on a VM in its first boot, with apt's own message naming the holder."""
    vm, maxtext, _ = first_boot_vm(HELD, HELD)
    assert exec_status(maxtext, "cloud-init status") == (0, "status: running\n")
    pid = holder(maxtext)
    old_way = ("set -e; export DEBIAN_FRONTEND=noninteractive; sudo apt-get update;"
               " sudo apt-get upgrade -y --fix-missing; sudo apt-get install -y build-essential cmake ninja-build")
    status, out, err = bash(maxtext, old_way)
    assert status == 100, out + err
    assert err.splitlines() == [
        f"E: Could not get lock {FRONTEND}. It is held by process {pid} (unattended-upgr)",
        "N: Be aware that removing the lock file is not a solution and may break your system.",
        f"E: Unable to acquire the dpkg frontend lock ({FRONTEND}), is another process using it?",
    ]
    assert "nothing fetched" in out  # `update` takes apt's lists lock only: the holder leaves it free
    # The holder is a process of the VM: it dies with it.
    host_pids = pids_in_namespace(vm.pidns)
    vm.stop()
    assert not [p for p in host_pids if Path(f"/proc/{p}").exists() and p in pids_in_namespace(vm.pidns)]


def test_apt_get_answers_as_apt_does(first_boot_vm):
    """Without root, with a lock timeout, with conffile questions and no stdin, without
    DEBIAN_FRONTEND: apt 2.4's and dpkg's and debconf's messages and exit codes."""
    _, maxtext, visitor = first_boot_vm(0, HELD)
    pid = holder(maxtext)
    assert bash(maxtext, "apt-get install -y cmake") == (100, "", (
        f"E: Could not open lock file {FRONTEND} - open (13: Permission denied)\n"
        f"E: Unable to acquire the dpkg frontend lock ({FRONTEND}), are you root?\n"))
    assert bash(visitor, "sudo -n apt-get install -y cmake") == (1, "", "sudo: a password is required\n")
    # Root in the VM is real, but the host's files stay out of its reach: its root filesystem is
    # read-only in the VM, the VM's own mounts are not.
    assert bash(maxtext, "sudo touch /usr/local/localcloud-root-was-here") == (
        1, "", "touch: cannot touch '/usr/local/localcloud-root-was-here': Read-only file system\n")
    assert bash(maxtext, "sudo touch /root/here /var/tmp/here && echo ok") == (0, "ok\n", "")
    # DPkg::Lock::Timeout: apt's own wait, a try a second, then only the "Unable to acquire" error.
    started = time.monotonic()
    status, out, err = bash(maxtext, "sudo apt-get -o DPkg::Lock::Timeout=2 install -y cmake")
    assert time.monotonic() - started >= 2
    assert status == 100
    assert out == f"Waiting for cache lock: Could not get lock {FRONTEND}. It is held by process {pid} (unattended-upgr)...\n"
    assert err == f"E: Unable to acquire the dpkg frontend lock ({FRONTEND}), is another process using it?\n"


def test_an_upgrade_asks_dpkgs_conffile_question_and_holds_the_lock_while_it_works(first_boot_vm):
    _, maxtext, _ = first_boot_vm(0, 0)
    # Exported DEBIAN_FRONTEND is dropped by sudo's env_reset; stdin at its end: dpkg's question fails.
    status, out, err = bash(maxtext, "export DEBIAN_FRONTEND=noninteractive; sudo apt-get upgrade -y")
    assert status == 100
    assert "*** gce-resolved.conf (Y/I/N/O/D/Z) [default=N] ? " in out
    assert " ==> Modified (by you or by a script) since installation." in out
    assert err.splitlines() == [
        "debconf: unable to initialize frontend: Dialog",
        "debconf: (Dialog frontend will not work on a dumb terminal, an emacs shell buffer, or without a controlling terminal.)",
        "debconf: falling back to frontend: Readline",
        "debconf: unable to initialize frontend: Readline",
        "debconf: (This frontend requires a controlling tty.)",
        "debconf: falling back to frontend: Teletype",
        "dpkg-preconfigure: unable to re-open stdin: No such device or address",
        "dpkg: error processing package google-compute-engine (--configure):",
        " end of file on stdin at conffile prompt",
        "Errors were encountered while processing:",
        " google-compute-engine",
        "E: Sub-process /usr/bin/dpkg returned an error code (1)",
    ]
    # Without -y apt asks first; at the end of stdin it aborts (exit 1).
    status, out, _ = bash(maxtext, "sudo DEBIAN_FRONTEND=noninteractive apt-get upgrade")
    assert (status, out.splitlines()[-1]) == (1, "Do you want to continue? [Y/n] Abort.")

    # While one apt-get waits for its answer it holds dpkg's lock: another one meets it.
    stdin, stdout, _ = maxtext.exec_command("sudo DEBIAN_FRONTEND=noninteractive apt-get upgrade -y", timeout=60)
    shown: list[str] = []

    def asked() -> bool:
        if stdout.channel.recv_ready():
            shown.append(stdout.channel.recv(65536).decode())
        return "[default=N] ? " in "".join(shown)

    poll(asked, 20, "dpkg's conffile question")
    assert "Setting up google-compute-engine" in "".join(shown)
    rows = [line.split() for line in bash(maxtext, "ps -eo pid=,comm=")[1].splitlines()]
    waiting = [int(pid) for pid, comm in rows if comm == "apt-get"]
    status, _, err = bash(maxtext, "sudo apt-get install -y cmake")
    assert status == 100 and f"It is held by process {waiting[0]} (apt-get)" in err, err
    stdin.write("N\n")
    stdin.channel.shutdown_write()
    rest = stdout.read().decode()
    assert stdout.channel.recv_exit_status() == 0 and "Keeping old config file as default." in rest
    # Done once: the next upgrade has nothing to do, the settings a careful script passes ask nothing.
    careful = ("sudo DEBIAN_FRONTEND=noninteractive apt-get -o Dpkg::Options::=--force-confdef"
               " -o Dpkg::Options::=--force-confold upgrade -y")
    status, out, err = bash(maxtext, careful)
    assert (status, err) == (0, "") and "0 upgraded, 0 newly installed" in out


def test_the_vm_scripts_wait_for_the_first_boot_then_install(first_boot_vm):
    """lib.sh's wait_for_cloud_init and apt_get on a VM whose cloud-init runs 2 s and whose
    lock is held 3 s: both wait, then the tutorial's apt commands succeed (the conffile question
    answered on the command line)."""
    vm, maxtext, _ = first_boot_vm(2, 3)
    pid = holder(maxtext)
    lib = (LIB).read_text()
    script = (f"set -euo pipefail\n{lib}\nwait_for_cloud_init\ncloud-init status\n"
              "apt_get update\napt_get upgrade -y --fix-missing\napt_get install -y build-essential cmake ninja-build\n")
    started = time.monotonic()
    status, out, err = bash(maxtext, script)
    assert status == 0, out + err
    assert time.monotonic() - started >= 2
    assert "status: done" in out and "Keeping old config file as default." in out
    assert f"Waiting for cache lock: Could not get lock {FRONTEND}. It is held by process {pid} (unattended-upgr)" in out \
        or time.monotonic() - started >= 3  # the lock had gone by the time apt asked
    assert "cmake is already the newest version" in out
    assert err == ""


def test_the_vm_scripts_give_up_at_their_bound_naming_the_first_boot(first_boot_vm):
    _, maxtext, _ = first_boot_vm(HELD, HELD)
    lib = LIB.read_text()
    status, _, err = bash(maxtext, f"FIRST_BOOT_WAIT_SECONDS=1\n{lib}\nwait_for_cloud_init")
    assert status == 1 and "cloud-init was still running after 1 s (the VM's first boot)" in err
    status, _, err = bash(maxtext, f"FIRST_BOOT_WAIT_SECONDS=2\n{lib}\napt_get install -y cmake")
    assert status == 100
    assert err.splitlines()[-1].startswith(
        "apt-get install -y cmake: the package manager's lock was still held after 2 s (on a VM's first boot"
        " unattended-upgrades holds dpkg's lock")
