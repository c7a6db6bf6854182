#!/usr/bin/python3
"""localcloud's apt-get, apt and unattended-upgrade of a sandbox VM (see localcloud/compute/first_boot.py).

Installed in the read-only overlay over every VM's /usr/bin (vm.py's boot script), so `sudo apt-get`
finds it; it fetches and installs nothing (the host's packages must not change), but meets what
apt 2.4 (Ubuntu 22.04) meets on a freshly booted VM, with apt's own messages and exit codes:
  - its locks are fcntl F_SETLK write locks on the VM's own lock files, taken as apt-pkg's GetLock
    takes them (apt 2.4 apt-pkg/contrib/fileutl.cc GetLock: open O_RDWR|O_CREAT|O_NOFOLLOW 0640,
    then F_SETLK; on failure F_GETLK for the holder and its name from /proc/PID/status):
    "Could not open lock file F - open (13: Permission denied)" for a user who is not root,
    "Could not get lock F. It is held by process N (NAME)" and the notice "Be aware that removing
    the lock file is not a solution and may break your system." when another process holds it;
  - `update` locks /var/lib/apt/lists/lock without waiting ("Unable to lock directory D",
    apt-pkg/acquire.cc pkgAcquire::GetLock); the others lock dpkg's frontend lock, then its
    admin lock (apt-pkg/deb/debsystem.cc debSystem::Lock and LockInner: "Unable to acquire the
    dpkg frontend lock (F), is another process using it?" / "..., are you root?"), waiting up to
    DPkg::Lock::Timeout seconds (default 0: no wait; apt.conf(5), apt-get(8)) in apt's own loop
    (debsystem.cc GetLockMaybeWait: one try a second, "Waiting for cache lock: MESSAGE", after
    which only the "Unable to acquire" error is left);
  - every error is "E: ..." on stderr and the exit code 100 (apt-get(8): "apt-get returns zero on
    normal operation, decimal 100 on error");
  - `upgrade` (and dist-upgrade, full-upgrade) has one package to upgrade until an upgrade has
    configured it: google-compute-engine, whose conffile /etc/systemd/resolved.conf.d/gce-resolved.conf
    the image changed since installation, so dpkg asks its conffile question (dpkg's prompt, from
    dpkg src/main/configure.c promptconfaction, as a GCE image showed it in dstackai/dstack#3367)
    unless Dpkg::Options carry --force-confold, --force-confnew or --force-confdef (dpkg(1): the
    default action here is to keep the current version); with stdin at its end dpkg fails
    ("end of file on stdin at conffile prompt") and apt reports "Sub-process /usr/bin/dpkg
    returned an error code (1)" (apt-pkg/deb/dpkgpm.cc). Without -y apt asks "Do you want to
    continue? [Y/n]" first ("Abort." and exit 1 at the end of stdin; apt-private/private-install.cc);
  - when a package is configured without DEBIAN_FRONTEND=noninteractive and without a terminal,
    debconf falls back from frontend to frontend with its warnings (debconf's
    Debconf/AutoSelect.pm, FrontEnd/Dialog.pm, FrontEnd/Readline.pm; dpkg-preconfigure's
    "unable to re-open stdin");
  - it holds its locks until it exits, so another apt meanwhile meets them.
`apt` is the same, with apt's warning that it "does not have a stable CLI interface" when its
output is not a terminal (apt-private/private-main.cc).
`unattended-upgrade` (its process name, as apt reports it, is "unattended-upgr": the kernel's
15-character comm) takes dpkg's frontend and admin locks as apt does and holds them for the
seconds given (`--localcloud-hold SECONDS`), as the apt-daily-upgrade job does after a first
boot (ansible/ansible#51663, servo/ci-runners#57); a package with a conffile prompt is left for a
person ("has conffile prompt and needs to be upgraded manually", jnv/ansible-role-unattended-upgrades#56).
"""

import errno
import fcntl
import json
import os
import struct
import sys
import time

LISTS_LOCK = "/var/lib/apt/lists/lock"
FRONTEND_LOCK = "/var/lib/dpkg/lock-frontend"
ADMIN_LOCK = "/var/lib/dpkg/lock"
STATE_FILE = "/var/lib/apt/localcloud-upgraded.json"  # the VM's own /var/lib/apt (vm.py)
# The package and conffile of dstackai/dstack#3367 (a GCE Ubuntu image); the versions and sizes below
# are illustrative (no archive is reachable to read real ones), the messages around them apt's and dpkg's.
PACKAGE, OLD_VERSION, NEW_VERSION = "google-compute-engine", "1:20240307.00-0ubuntu1~22.04.0", "1:20250328.00-0ubuntu1~22.04.0"
CONFFILE = "/etc/systemd/resolved.conf.d/gce-resolved.conf"
EXIT_ERROR = 100
PROG = os.path.basename(sys.argv[0])
# apt-get's other operations (apt-get(8)): not modelled here, and said so.
KNOWN = {"remove", "purge", "autoremove", "autoclean", "clean", "check", "source", "build-dep", "download",
         "changelog", "indextargets", "satisfy", "dselect-upgrade", "search", "show", "list", "policy"}


class AptError(Exception):
    """Ends the run: apt's pending messages, then exit 100."""


class Messages:
    def __init__(self):
        self.lines = []

    def error(self, text):
        self.lines.append(f"E: {text}")

    def notice(self, text):
        self.lines.append(f"N: {text}")

    def flush(self):
        for line in self.lines:
            print(line, file=sys.stderr)
        self.lines = []


def process_name(pid):
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Name:"):
                    return line[6:].strip()
    except OSError:
        pass
    return ""


def get_lock(path, messages):
    """apt-pkg's GetLock: an fd holding the write lock, or None with apt's messages queued
    (and the errno that decides the caller's message: EPERM when the file would not open)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o640)
    except OSError as exc:
        messages.error(f"Could not open lock file {path} - open ({exc.errno}: {os.strerror(exc.errno)})")
        return None, errno.EPERM
    flock = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_SETLK, flock)
        return fd, 0
    except OSError as exc:
        code = exc.errno
        holder = -1
        if code in (errno.EACCES, errno.EAGAIN):
            got = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, -1))
            holder = struct.unpack("hhqqi4x", got)[4]
        os.close(fd)
        if holder not in (-1, 0):
            name = process_name(holder)
            where = f"{path}. It is held by process {holder}" + (f" ({name})" if name else "")
            messages.error(f"Could not get lock {where}")
        else:
            messages.error(f"Could not get lock {path} - open ({code}: {os.strerror(code)})")
        messages.notice("Be aware that removing the lock file is not a solution and may break your system.")
        return None, code


def get_lock_maybe_wait(path, messages, timeout):
    """debsystem.cc GetLockMaybeWait: no wait for a timeout of 0; else a try a second, the
    failure shown as "Waiting for cache lock: ...", and only the caller's error at the end."""
    if timeout == 0:
        return get_lock(path, messages)
    shown = None
    i = 0
    while timeout < 0 or i < timeout:
        attempt = Messages()
        fd, code = get_lock(path, attempt)
        if fd is not None or code == errno.EPERM:
            messages.lines += attempt.lines
            return fd, code
        waiting = "Waiting for cache lock: " + attempt.lines[0][3:]
        time.sleep(1)
        if waiting != shown:  # quiet output (not a terminal): each new message once
            print(f"{waiting}...", flush=True)
            shown = waiting
        i += 1
    return None, code


def lock_dpkg(messages, timeout):
    fd, code = get_lock_maybe_wait(FRONTEND_LOCK, messages, timeout)
    if fd is None:
        why = "is another process using it?" if code in (errno.EACCES, errno.EAGAIN) else "are you root?"
        messages.error(f"Unable to acquire the dpkg frontend lock ({FRONTEND_LOCK}), {why}")
        raise AptError()
    admin, code = get_lock_maybe_wait(ADMIN_LOCK, messages, timeout)
    if admin is None:
        why = "is another process using it?" if code in (errno.EACCES, errno.EAGAIN) else "are you root?"
        messages.error(f"Unable to lock the administration directory (/var/lib/dpkg/), {why}")
        raise AptError()
    return [fd, admin]


def parse(argv):
    """(command, words, config, assume_yes); apt's -o NAME=VALUE keys are case-insensitive."""
    config = {"dpkg::options::": []}
    words, assume_yes, command = [], False, None
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-o", "--option"):
            if not args:
                raise AptError(f"Option {arg} requires an argument.")
            arg = "-o" + args.pop(0)
        if arg.startswith("-o") and len(arg) > 2:
            name, sep, value = arg[2:].partition("=")
            if not sep:
                raise AptError(f"Option {arg}: Configuration item specification must have an =<val>.")
            if name.lower() == "dpkg::options::":
                config["dpkg::options::"].append(value)
            else:
                config[name.lower()] = value
        elif arg in ("-y", "--yes", "--assume-yes"):
            assume_yes = True
        elif arg in ("-q", "-qq", "--quiet", "-m", "--fix-missing", "--no-install-recommends", "--no-upgrade"):
            pass
        elif arg.startswith("-"):  # apt knows many more; what is not modelled is said so, not faked
            raise AptError(f"localcloud's {PROG} does not model the option {arg} (only -y, -q, -qq, -m,"
                           " --fix-missing, --no-install-recommends, --no-upgrade and -o)")
        elif command is None:
            command = arg
        else:
            words.append(arg)
    return command, words, config, assume_yes


def lock_timeout(config):
    value = config.get("dpkg::lock::timeout", "0")
    try:
        return int(value)
    except ValueError:
        return 0


def debconf_warnings():
    """What debconf prints when it must configure a package with no terminal and no frontend set."""
    if os.environ.get("DEBIAN_FRONTEND") == "noninteractive" or sys.stdin.isatty():
        return
    term = os.environ.get("TERM") or ""
    if not term:
        why = "TERM is not set, so the dialog frontend is not usable."
    elif term in ("dumb", "unknown"):
        why = "Dialog frontend will not work on a dumb terminal, an emacs shell buffer, or without a controlling terminal."
    else:
        why = None
    if why:
        for line in ("unable to initialize frontend: Dialog", f"({why})", "falling back to frontend: Readline",
                     "unable to initialize frontend: Readline", "(This frontend requires a controlling tty.)",
                     "falling back to frontend: Teletype"):
            print(f"debconf: {line}", file=sys.stderr)
    print("dpkg-preconfigure: unable to re-open stdin: No such device or address", file=sys.stderr)


def read_answer():
    line = sys.stdin.readline()
    return None if line == "" else line.strip()


def conffile_choice(options):
    """dpkg's answer for a conffile changed on both sides: from --force-conf*, or asked."""
    if "--force-confnew" in options:
        return "install"
    if "--force-confold" in options or "--force-confdef" in options:
        return "keep"
    base = os.path.basename(CONFFILE)
    while True:
        print(f"\nConfiguration file '{CONFFILE}'\n"
              " ==> Modified (by you or by a script) since installation.\n"
              " ==> Package distributor has shipped an updated version.\n"
              "   What would you like to do about it ?  Your options are:\n"
              "    Y or I  : install the package maintainer's version\n"
              "    N or O  : keep your currently-installed version\n"
              "      D     : show the differences between the versions\n"
              "      Z     : start a shell to examine the situation\n"
              " The default action is to keep your current version.\n"
              f"*** {base} (Y/I/N/O/D/Z) [default=N] ? ", end="", flush=True)
        answer = read_answer()
        if answer is None:
            return None
        if answer.lower() in ("y", "i"):
            return "install"
        if answer.lower() in ("", "n", "o"):
            return "keep"
        print(f"localcloud: answer '{answer}' is not modelled (only Y, I, N and O are)", flush=True)


def upgraded():
    try:
        with open(STATE_FILE) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def reading_lists():
    print("Reading package lists... Done\nBuilding dependency tree... Done\nReading state information... Done", flush=True)


def upgrade(config, assume_yes, messages):
    reading_lists()
    print("Calculating upgrade... Done", flush=True)
    if upgraded() is not None:
        print("0 upgraded, 0 newly installed, 0 to remove and 0 not upgraded.", flush=True)
        return 0
    print(f"The following packages will be upgraded:\n  {PACKAGE}\n"
          "1 upgraded, 0 newly installed, 0 to remove and 0 not upgraded.\n"
          "Need to get 0 B/31.2 kB of archives.\nAfter this operation, 0 B of additional disk space will be used.",
          flush=True)
    if not assume_yes and config.get("apt::get::assume-yes", "").lower() not in ("1", "true", "yes"):
        print("Do you want to continue? [Y/n] ", end="", flush=True)
        answer = read_answer()
        if answer is None or answer.lower() not in ("", "y", "yes"):
            print("Abort.", flush=True)
            return 1
    debconf_warnings()
    print("(Reading database ... 74712 files and directories currently installed.)\n"
          f"Preparing to unpack .../{PACKAGE}_{NEW_VERSION.split(':')[1]}_all.deb ...\n"
          f"Unpacking {PACKAGE} ({NEW_VERSION}) over ({OLD_VERSION}) ...\n"
          f"Setting up {PACKAGE} ({NEW_VERSION}) ...", flush=True)
    choice = conffile_choice(config["dpkg::options::"])
    if choice is None:
        print(f"dpkg: error processing package {PACKAGE} (--configure):\n end of file on stdin at conffile prompt",
              file=sys.stderr)
        print(f"Errors were encountered while processing:\n {PACKAGE}", file=sys.stderr)
        messages.error("Sub-process /usr/bin/dpkg returned an error code (1)")
        raise AptError()
    if choice == "keep":
        print(f"\nConfiguration file '{CONFFILE}'\n ==> Keeping old config file as default.", flush=True)
    else:
        print(f"\nConfiguration file '{CONFFILE}'\n ==> Installing new version of config file {CONFFILE} ...", flush=True)
    tmp = STATE_FILE + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"package": PACKAGE, "version": NEW_VERSION, "conffile": choice}, f)
    os.replace(tmp, STATE_FILE)
    return 0


def install(words, messages):
    reading_lists()
    for package in words:
        print(f"{package} is already the newest version (localcloud: the host's, nothing installed).", flush=True)
    pending = 0 if upgraded() is not None else 1
    print(f"0 upgraded, 0 newly installed, 0 to remove and {pending} not upgraded.", flush=True)
    return 0


def update(messages):
    fd, code = get_lock(LISTS_LOCK, messages)
    if fd is None:
        messages.error("Unable to lock directory /var/lib/apt/lists/")
        raise AptError()
    print("Reading package lists... Done  (localcloud: nothing fetched)", flush=True)
    return 0


def apt_main(prog, argv):
    messages = Messages()
    try:
        if prog == "apt" and not sys.stdout.isatty():
            print(f"\nWARNING: {prog} does not have a stable CLI interface. Use with caution in scripts.\n", file=sys.stderr)
        command, words, config, assume_yes = parse(argv)
        if command is None:
            raise AptError(f"No operation given (localcloud's {PROG} models update, upgrade, dist-upgrade, full-upgrade"
                           " and install)")
        if command == "update":
            status = update(messages)
        elif command in ("upgrade", "dist-upgrade", "full-upgrade"):
            held = lock_dpkg(messages, lock_timeout(config))  # noqa: F841 (held until exit)
            status = upgrade(config, assume_yes, messages)
        elif command == "install":
            held = lock_dpkg(messages, lock_timeout(config))  # noqa: F841
            status = install(words, messages)
        else:  # apt-pkg/contrib/cmndline.cc DispatchArg; apt's other operations are not modelled
            raise AptError(f"Invalid operation {command}" if command not in KNOWN else
                           f"localcloud's {PROG} does not model the operation {command}")
    except AptError as exc:
        if exc.args:
            messages.error(exc.args[0])
        messages.flush()
        return EXIT_ERROR
    messages.flush()
    return status


def hold(argv):
    """unattended-upgrade --localcloud-hold SECONDS: the first boot's upgrade job. Returns once a
    process left behind holds dpkg's locks (fcntl locks belong to a process, so the one that
    holds them is the one that took them); that process lets them go SECONDS later."""
    seconds = float(argv[argv.index("--localcloud-hold") + 1])
    ready_read, ready_write = os.pipe()
    if os.fork() > 0:
        os.close(ready_write)
        with os.fdopen(ready_read) as ready:
            return 0 if ready.readline() == "locked\n" else 1
    os.close(ready_read)
    os.setsid()
    messages = Messages()
    try:
        held = lock_dpkg(messages, 0)  # noqa: F841 (held until exit)
    except AptError:
        messages.flush()
        os._exit(EXIT_ERROR)
    os.write(ready_write, b"locked\n")
    os.close(ready_write)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    time.sleep(seconds)  # the modelled length of the upgrade run, not a wait for anything
    os._exit(0)


if __name__ == "__main__":
    name = os.path.basename(sys.argv[0])
    if name == "unattended-upgrade":
        sys.exit(hold(sys.argv[1:]))
    sys.exit(apt_main(name, sys.argv[1:]))
