"""VmSSHHook against a real sshd VM of the local cloud, created through the endpoint-aware hook."""

from __future__ import annotations

import re
import shlex
import time
from datetime import datetime, timezone

import pytest

from localcloud.connections import LOCAL_PROJECT, LOCAL_RUN_CONF
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.vm.ssh import LoginRefused, VmSSHHook
from maxtext_sft.run.spec import build_run_spec

SSH_CONN_ID = "maxtext_sft_vm_ssh"


@pytest.fixture(scope="module")
def vm(pipeline_connections, local_cloud):
    """One VM made from a RunSpec's insert body (the pipeline's own key and user)."""
    from airflow.providers.ssh.hooks.ssh import SSHHook

    key = SSHHook(ssh_conn_id=SSH_CONN_ID, remote_host="unused").pkey
    spec = build_run_spec(
        {"reservation": LOCAL_RUN_CONF["reservation"], "project_id": LOCAL_PROJECT},
        dag_id="hook_tests",
        run_id=f"manual__{time.time()}",
        generation=0,
        started=datetime.now(timezone.utc),
        default_project_id=None,
        ssh_user="maxtext",
        ssh_public_key=f"{key.get_name()} {key.get_base64()}",
    )
    compute = ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default")
    where = {"zone": spec.zone, "project_id": spec.project_id}
    compute.insert_instance(body=spec.instance_body(), **where)
    try:
        address = compute.get_instance_address(resource_id=spec.vm_name, **where)
        yield address, compute.get_host_keys(resource_id=spec.vm_name, **where)
    finally:
        compute.delete_instance(resource_id=spec.vm_name, **where)


@pytest.fixture
def ssh(vm):
    address, host_keys = vm
    hook = VmSSHHook(ssh_conn_id=SSH_CONN_ID, remote_host=address, host_keys=host_keys, conn_timeout=10)
    with hook.get_conn():
        yield hook


def test_a_step_silent_for_longer_than_10_seconds_passes(ssh):
    lines: list[str] = []
    status, _ = ssh.run_command("sleep 11; echo done", timeout=60, on_line=lines.append)
    assert status == 0
    assert lines == ["done"]


def test_output_streams_line_by_line_and_the_exit_status_is_returned(ssh):
    lines: list[str] = []
    status, tail = ssh.run_command(
        "for i in 1 2 3; do echo line $i; done; echo to-stderr >&2; exit 7",
        timeout=30,
        on_line=lines.append,
        tail_lines=2,
    )
    assert status == 7
    # stderr is merged in; its order against stdout is the two pipes' business
    assert sorted(lines) == ["line 1", "line 2", "line 3", "to-stderr"]
    assert lines[:3] == [line for line in lines if line.startswith("line")]
    assert tail == lines[-2:]
    partial: list[str] = []
    ssh.run_command("printf 'a\\nno-newline'", timeout=30, on_line=partial.append)
    assert partial == ["a", "no-newline"]


def test_stdin_reaches_the_command_without_being_on_its_command_line(ssh):
    lines: list[str] = []
    secret = "hf_not_in_argv_0123456789"
    status, _ = ssh.run_command(
        "IFS= read -r token; echo length=${#token}; ps -eo args",
        stdin=f"{secret}\n".encode(),
        timeout=30,
        on_line=lines.append,
    )
    assert status == 0
    assert "length=25" in lines
    assert not any(secret in line for line in lines)


def test_a_command_past_its_deadline_raises(ssh):
    from maxtext_sft.vm.ssh import RemoteCommandError

    with pytest.raises(RemoteCommandError, match="still running after 2 s"):
        ssh.run_command("echo started; sleep 30", timeout=2, on_line=lambda line: None)


def test_root_cannot_log_in(vm):
    address, host_keys = vm
    hook = VmSSHHook(
        ssh_conn_id=SSH_CONN_ID, remote_host=address, host_keys=host_keys, conn_timeout=10, conn_retry_attempts=1
    )
    hook.username = "root"
    # A refused login fails without retries (not "still booting"), naming the host and user.
    with pytest.raises(LoginRefused, match=rf"{re.escape(address)} refused the SSH login of root"):
        hook.get_conn()


def test_the_vm_publishes_its_sshd_host_key(vm):
    """The key in the guest attributes is the one sshd shows (read with no trust at all)."""
    import paramiko

    address, host_keys = vm
    assert "ssh-ed25519" in host_keys
    with paramiko.Transport((address, 22)) as transport:
        transport.get_security_options().key_types = ["ssh-ed25519"]
        transport.start_client(timeout=10)
        assert transport.get_remote_server_key().get_base64() == host_keys["ssh-ed25519"]


@pytest.mark.parametrize("connection_says", [None, "true"], ids=["the connection as is", "no_host_key_check true"])
def test_a_host_key_other_than_the_published_one_is_refused(vm, connection_says, monkeypatch):
    """Whatever the connection's extra says: the key is checked (on the SSH provider before 7.0
    too, whose hook takes no no_host_key_check argument: make test-floor)."""
    import json

    from airflow.models import Connection
    from localcloud.compute.faults import unrelated_ed25519_key
    from maxtext_sft.vm.ssh import HostKeyMismatch

    conn_id = SSH_CONN_ID
    if connection_says:
        conn = Connection.get_connection_from_secrets(SSH_CONN_ID)
        extra = {**conn.extra_dejson, "no_host_key_check": connection_says}
        monkeypatch.setenv("AIRFLOW_CONN_VM_SSH_UNCHECKED", json.dumps({
            "conn_type": "ssh", "login": conn.login, "extra": extra}))
        conn_id = "vm_ssh_unchecked"
    address, _ = vm
    hook = VmSSHHook(
        ssh_conn_id=conn_id,
        remote_host=address,
        host_keys={"ssh-ed25519": unrelated_ed25519_key()},
        conn_timeout=10,
        conn_retry_attempts=1,
    )
    with pytest.raises(HostKeyMismatch, match="not the ssh-ed25519 key the VM published"):
        hook.get_conn()


def test_no_usable_host_key_is_refused_before_connecting():
    with pytest.raises(ValueError, match="no usable SSH host key"):
        VmSSHHook(ssh_conn_id=SSH_CONN_ID, remote_host="192.0.2.1", host_keys={"ssh-dss": "AAAA"})


@pytest.mark.parametrize(
    ("paramiko_says", "refused"),
    [
        ("Authentication failed.", True),  # the server answered the login: no
        ("Authentication failed: transport shut down or saw EOF", False),  # the VM went away mid-login
        ("Authentication timeout.", False),  # no answer to the login in time: a frozen VM
    ],
)
def test_only_an_answered_login_is_a_refusal(monkeypatch, vm, paramiko_says, refused):
    """A preempted VM can drop the connection during the login; paramiko reports that as an
    AuthenticationException too (auth_handler.wait_for_response). That VM is lost, not refusing:
    the training sensor must see an unreachable VM (and recover it), not fail the run."""
    import paramiko
    from airflow.providers.ssh.hooks.ssh import SSHHook

    def login(self):
        raise paramiko.AuthenticationException(paramiko_says)

    address, host_keys = vm
    hook = VmSSHHook(ssh_conn_id=SSH_CONN_ID, remote_host=address, host_keys=host_keys)
    monkeypatch.setattr(SSHHook, "get_conn", login)
    with pytest.raises((LoginRefused, paramiko.SSHException)) as raised:
        hook.get_conn()
    # A refusal fails the task at once; anything else is what the sensors take as "not reachable now".
    assert isinstance(raised.value, LoginRefused) is refused
    assert isinstance(raised.value, paramiko.SSHException) is not refused
    assert not isinstance(raised.value, paramiko.AuthenticationException)


# ----- a step past its timeout: its process group is ended before a retry can start it again -----

# A step script's shape (include/vm/*.sh): lib.sh, note_contact; then "hang" leaves a child in the
# step's group (as pip under install_maxtext.sh) and a detached process (as start_training.sh's
# training, in a session of its own), or "check PID" says whether process PID is still there.
STAND_IN_STEP = b"""#!/usr/bin/env bash
set -euo pipefail
source "$(dirname "$0")/lib.sh"
work_dir=$(resolve_dir "$1")
note_contact "$work_dir"
if [ "$2" = check ]; then
  if process_alive "$3"; then echo "pid $3 alive"; else echo "pid $3 gone"; fi
  exit 0
fi
setsid nohup sleep 600 </dev/null >/dev/null 2>&1 &
echo "detached $!"
sleep 600 &
echo "child $!"
wait
"""
STAND_IN_DIR = ".maxtext-sft/test-steps"


@pytest.fixture
def stand_in_steps(ssh):
    """The stand-in under an exclusive step's name and a read-only step's, beside the real lib.sh;
    every process it started is ended after the test."""
    from maxtext_sft.vm.steps import script_files

    lib = script_files()["lib.sh"]
    sftp = ssh.get_conn().open_sftp()
    for path in (".maxtext-sft", STAND_IN_DIR):
        try:
            sftp.mkdir(path, mode=0o700)
        except OSError:
            pass  # there already
    for name, content in {"lib.sh": lib, "install_maxtext.sh": STAND_IN_STEP, "training_status.sh": STAND_IN_STEP}.items():
        with sftp.open(f"{STAND_IN_DIR}/{name}", "wb") as remote:
            remote.write(content)
    sftp.close()
    ssh.upload_scripts(script_files())  # end_step_group.sh, as run_vm_step uploads it before a step
    yield lambda step, *args: shlex.join(["bash", f"{STAND_IN_DIR}/{step}", "~/stand-in-work", *args])
    ssh.run_command("pkill -KILL -f 'sleep 600' || true", timeout=30, on_line=lambda line: None)


def start_detached_from_the_worker(hook_args, command: str) -> dict[str, int]:
    """Start `command` on its own connection and drop that connection once the step said what it
    started, as a worker that died mid-step would (the VM gets no signal): its pids by name."""
    hook = VmSSHHook(**hook_args)
    started: dict[str, int] = {}
    with hook.get_conn() as client:
        channel = client.get_transport().open_session()
        channel.set_combine_stderr(True)
        channel.exec_command(command)
        channel.shutdown_write()
        output = b""
        deadline = time.monotonic() + 30
        while "child" not in started and time.monotonic() < deadline:
            if channel.recv_ready():
                output += channel.recv(65536)
                started = {k: int(v) for k, v in re.findall(rb"^(detached|child) ([0-9]+)$", output, re.M)}
                started = {k.decode(): v for k, v in started.items()}
            else:
                time.sleep(0.05)
    return started


def alive(ssh, pid: int) -> bool:
    lines: list[str] = []
    ssh.run_command(f"ps -o stat= -p {int(pid)} || true", timeout=30, on_line=lines.append)
    return bool(lines) and not lines[0].startswith("Z")


def test_a_step_past_its_timeout_is_ended_and_its_retry_finds_none_of_it(ssh, stand_in_steps):
    from maxtext_sft.vm.ssh import RemoteCommandError

    lines: list[str] = []
    with pytest.raises(RemoteCommandError, match=r"after 3 s \(its process group [0-9]+ was ended\)"):
        ssh.run_command(stand_in_steps("install_maxtext.sh", "hang"), timeout=3, on_line=lines.append)
    pids = {k: int(v) for k, v in (line.split() for line in lines if line.split()[0] in ("child", "detached"))}
    assert not any(line.startswith("MAXTEXT_SFT_STEP_GROUP") for line in lines)  # for the hook, not the log
    retry: list[str] = []
    status, _ = ssh.run_command(stand_in_steps("install_maxtext.sh", "check", str(pids["child"])), timeout=60,
                                on_line=retry.append)
    assert status == 0 and f"pid {pids['child']} gone" in retry
    assert not any("still running" in line for line in retry)  # the timeout had ended it already
    assert alive(ssh, pids["detached"])  # what a step detaches (the training, the autostop) stays


def test_a_new_run_of_an_exclusive_step_ends_an_earlier_one_its_worker_left_running(vm, ssh, stand_in_steps):
    address, host_keys = vm
    hook_args = dict(ssh_conn_id=SSH_CONN_ID, remote_host=address, host_keys=host_keys, conn_timeout=10)
    first = start_detached_from_the_worker(hook_args, stand_in_steps("install_maxtext.sh", "hang"))
    assert alive(ssh, first["child"])  # no SIGHUP without a pty: the first install goes on
    second: list[str] = []
    status, _ = ssh.run_command(stand_in_steps("install_maxtext.sh", "check", str(first["child"])), timeout=60,
                                on_line=second.append)
    assert status == 0, second
    assert any(line.startswith("An earlier install_maxtext.sh is still running") for line in second), second
    assert f"pid {first['child']} gone" in second  # gone before the second one's own work began
    assert alive(ssh, first["detached"])


def test_read_only_steps_run_side_by_side(vm, ssh, stand_in_steps):
    """training_status.sh from the trigger and from a worker at once: neither ends the other."""
    address, host_keys = vm
    hook_args = dict(ssh_conn_id=SSH_CONN_ID, remote_host=address, host_keys=host_keys, conn_timeout=10)
    first = start_detached_from_the_worker(hook_args, stand_in_steps("training_status.sh", "hang"))
    second: list[str] = []
    status, _ = ssh.run_command(stand_in_steps("training_status.sh", "check", str(first["child"])), timeout=60,
                                on_line=second.append)
    assert status == 0 and f"pid {first['child']} alive" in second, second
