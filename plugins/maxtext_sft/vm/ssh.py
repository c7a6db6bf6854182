"""SSH to the fine-tuning VM: upload the step scripts, run one, stream its output.

Built on the SSH provider's `SSHHook` (connection: login = the VM user, extra `private_key`).
The remote host is the VM's address and its host keys are the ones the VM publishes in its
guest attributes, both known only at run time, so they are passed in rather than stored on the
connection. The host key is always verified: a connection's `no_host_key_check` is overridden.
"""

from __future__ import annotations

import base64
import io
import select
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath

import paramiko

from airflow.providers.ssh.hooks.ssh import SSHHook
from maxtext_sft.cloud.compute import HOST_KEY_TYPES
from maxtext_sft.vm.ssh_common import REMOTE_SCRIPT_DIR, HostKeyMismatch, LoginRefused, RemoteCommandError

__all__ = ["REMOTE_SCRIPT_DIR", "HostKeyMismatch", "LoginRefused", "RemoteCommandError", "VmSSHHook"]


# paramiko's AuthenticationException also reports a connection that ended, or timed out, before
# the server answered the login (paramiko/auth_handler.py, wait_for_response): no refusal.
LOST_DURING_AUTHENTICATION = ("transport shut down or saw EOF", "Authentication timeout")


class VmSSHHook(SSHHook):
    """One SSH client to one VM; no inactivity timeout, since real steps are silent for minutes.

    `host_keys` ({key type: base64 key}, from `ComputeEngineEndpointHook.get_host_keys`) are
    the only keys the VM's sshd may show.
    """

    def __init__(
        self, *, ssh_conn_id: str, remote_host: str, host_keys: Mapping[str, str], conn_timeout: int = 30,
        iap: Mapping | None = None, **kwargs
    ):
        # Keepalives keep NAT and load balancers from dropping a connection that is silent for minutes.
        super().__init__(
            ssh_conn_id=ssh_conn_id,
            remote_host=remote_host,
            conn_timeout=conn_timeout,
            banner_timeout=conn_timeout,
            auth_timeout=conn_timeout,
            keepalive_interval=30,
            cmd_timeout=None,
            **kwargs,
        )
        # Set after the connection's extras are read (in __init__): whatever they say, the key is
        # checked. (Not the constructor argument: the SSH provider before 7.0 has none.)
        self.no_host_key_check = False
        self.look_for_keys = False  # only the connection's key, never whatever is in the worker's ~/.ssh
        self.allow_host_key_change = False
        kind = next((kind for kind in HOST_KEY_TYPES if kind in host_keys), None)
        if kind is None:
            raise ValueError(f"no usable SSH host key for {remote_host} (got types {sorted(host_keys)})")
        # Paramiko asks the server for the type of the known key first, so one key is enough.
        self.host_key = self._host_key_mappings[kind](data=base64.b64decode(host_keys[kind]))
        # With ssh_via_iap, each connection attempt goes through a tunnel of its own
        # (cloud/iap_tunnel.py), under the Google connection's identity.
        self.iap = dict(iap) if iap else None
        self._tunnel = None

    @property
    def host_proxy(self):
        """The socket the SSH client talks over: the IAP tunnel of the attempt under way, else
        None (a direct connection). Replaces the provider's ProxyCommand."""
        return self._tunnel

    def _connect(self) -> paramiko.SSHClient:
        """The provider's connection; through IAP, a new tunnel for each attempt (a socket that
        failed once cannot carry the next), retried as the provider retries (every error, a few
        seconds apart) but for IAP's refusal of the identity."""
        if not self.iap:
            return super().get_conn()
        from maxtext_sft.cloud.iap_tunnel import open_tunnel

        attempts, self.conn_retry_attempts = self.conn_retry_attempts, 1
        try:
            for attempt in range(attempts):
                self._tunnel = open_tunnel(self.iap, timeout=self.conn_timeout or 30)
                try:
                    return super().get_conn()
                except Exception:
                    self._tunnel.close()
                    if attempt == attempts - 1:
                        raise
                    self.log.info("Failed to connect through IAP. Retrying (attempt %d)", attempt + 2)
                    time.sleep(3)
        finally:
            self.conn_retry_attempts = attempts
        raise AssertionError("unreachable")

    def get_conn(self) -> paramiko.SSHClient:
        try:
            return self._connect()
        except paramiko.AuthenticationException as error:
            if any(sign in str(error) for sign in LOST_DURING_AUTHENTICATION):
                # The VM went away (preempted, deleted) or froze mid-login: unreachable, not refused.
                raise paramiko.SSHException(
                    f"{self.remote_host}: the connection ended during the SSH login: {error}"
                ) from error
            raise LoginRefused(
                f"{self.remote_host} refused the SSH login of {self.username} with the connection's key: {error}"
            ) from None
        except paramiko.BadHostKeyException as error:
            raise HostKeyMismatch(
                f"SSH host key of {self.remote_host} is {error.key.get_name()} {error.key.get_base64()[:24]}..., "
                f"not the {error.expected_key.get_name()} key the VM published in its guest attributes "
                "(hostkeys/): refusing to connect"
            ) from None

    def upload_scripts(self, scripts: Mapping[str, bytes]) -> None:
        """Copy the step scripts to REMOTE_SCRIPT_DIR (overwriting: the DAG's version wins)."""
        sftp = self.get_conn().open_sftp()
        try:
            path = PurePosixPath()
            for part in PurePosixPath(REMOTE_SCRIPT_DIR).parts:
                path = path / part
                try:
                    sftp.stat(str(path))
                except FileNotFoundError:
                    sftp.mkdir(str(path), mode=0o700)
            for name, content in scripts.items():
                remote = f"{REMOTE_SCRIPT_DIR}/{name}"
                sftp.putfo(io.BytesIO(content), remote)
                sftp.chmod(remote, 0o700)
        finally:
            sftp.close()

    def download_dir(self, remote_dir: str, local_dir: Path) -> list[str]:
        """Copy the regular files of `remote_dir` (recursively) into `local_dir`; return their names."""
        sftp = self.get_conn().open_sftp()
        copied: list[str] = []
        try:

            def walk(remote: PurePosixPath, local: Path) -> None:
                local.mkdir(parents=True, exist_ok=True)
                for entry in sftp.listdir_attr(str(remote)):
                    if stat.S_ISDIR(entry.st_mode or 0):
                        walk(remote / entry.filename, local / entry.filename)
                    elif stat.S_ISREG(entry.st_mode or 0):
                        sftp.get(str(remote / entry.filename), str(local / entry.filename))
                        copied.append(str((local / entry.filename).relative_to(local_dir)))

            walk(PurePosixPath(remote_dir), Path(local_dir))
        finally:
            sftp.close()
        return sorted(copied)

    def run_command(
        self,
        command: str,
        *,
        stdin: bytes | None = None,
        timeout: float,
        on_line: Callable[[str], None],
        tail_lines: int = 40,
    ) -> tuple[int, list[str]]:
        """Run `command` (already quoted), feed `stdin`, call `on_line` per output line.

        Returns the exit status and the last `tail_lines` lines. Raises RemoteCommandError past `timeout` seconds in total,
        once the step's process group is ended (a step script names it: steps.STEP_GROUP_LINE): a channel without a pty
        that closes sends the remote side no signal, so the step would run on beside the task's retry.
        `stdin` is how secrets travel: never on the command line, never in the log.
        """
        from maxtext_sft.vm.steps import step_group  # not at parse time: steps reads the include folder

        channel = self.get_conn().get_transport().open_session()
        channel.set_combine_stderr(True)
        channel.exec_command(command)
        if stdin:
            channel.sendall(stdin)
        channel.shutdown_write()
        deadline = time.monotonic() + timeout
        pending = b""
        tail: list[str] = []
        group: tuple[int, int] | None = None  # the step's process group, once it named it

        def emit(raw: bytes) -> None:
            nonlocal group
            line = raw.decode("utf-8", errors="replace").rstrip("\r")
            if named := step_group(line):  # for this hook, not for the task log
                group = group or named
                return
            tail.append(line)
            del tail[:-tail_lines]
            on_line(line)

        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    channel.close()
                    ended = self.end_step_group(group, on_line) if group else "it named no process group to end"
                    raise RemoteCommandError(
                        f"remote command still running after {timeout:.0f} s ({ended})", None, list(tail)
                    )
                select.select([channel], [], [], min(remaining, 5.0))
                while channel.recv_ready():
                    pending += channel.recv(65536)
                    *lines, pending = pending.split(b"\n")
                    for raw in lines:
                        emit(raw)
                if channel.exit_status_ready() and not channel.recv_ready():
                    break
            while chunk := channel.recv(65536):  # whatever arrived between the last read and exit
                pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines + ([pending] if pending else []):
                emit(raw)
            status = channel.recv_exit_status()
        finally:
            channel.close()
        return status, tail

    def end_step_group(self, group: tuple[int, int], on_line: Callable[[str], None]) -> str:
        """End a timed-out step's process group over a new channel (include/vm/end_step_group.sh:
        SIGTERM, SIGKILL after a grace); what happened, for the error. Never raises: when the VM
        does not answer, the next run of an exclusive step ends the group (lib.sh's claim_step_group)."""
        from maxtext_sft.vm.steps import STEP_GROUP_GRACE_SECONDS, end_step_command

        try:
            status, tail = self.run_command(
                end_step_command(group), timeout=STEP_GROUP_GRACE_SECONDS + 30, on_line=on_line, tail_lines=5
            )
        except (RemoteCommandError, OSError, EOFError, paramiko.SSHException) as error:
            return f"its process group {group[0]} could not be ended: {error}"
        if status != 0:
            return f"its process group {group[0]} could not be ended: end_step_group.sh exited {status}: " + " | ".join(tail)
        return f"its process group {group[0]} was ended"
