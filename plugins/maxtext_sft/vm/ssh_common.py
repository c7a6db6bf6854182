"""What callers of the VM's SSH hook (vm/ssh.py) need without it: where the step scripts
live on the VM and the errors it raises. Kept apart so that a module can name them without
importing paramiko and the SSH provider, which DAG parsing does not need (docs/architecture.md,
Cheap to parse).
"""

from __future__ import annotations

from airflow.sdk.exceptions import AirflowFailException

# Where the step scripts live on the VM, relative to the user's home (SFTP starts there).
REMOTE_SCRIPT_DIR = ".maxtext-sft/bin"


class RemoteCommandError(RuntimeError):
    """A remote step exited non-zero or ran past its deadline."""

    def __init__(self, message: str, exit_status: int | None, tail: list[str]):
        super().__init__(message)
        self.exit_status = exit_status
        self.tail = tail


class HostKeyMismatch(AirflowFailException):
    """The VM's sshd showed a host key other than the one the VM published: not the VM we made.

    It fails the task without retries: a retry would meet the same host.
    """


class LoginRefused(AirflowFailException):
    """The VM's sshd refused the pipeline's user and key (authentication failed).

    Not a "still booting" error: the VM answered. It fails the task without retries, which would
    be refused too; the wait for a new VM tolerates it briefly (see vm.access.SshLoginProbe).
    """
