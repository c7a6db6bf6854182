"""How a task reaches the run's VM: its current address, an SSH hook that trusts only the host
key the VM published, the probe that tells a booting VM from one that refuses the login, and one
step script run on it.

Below the operators and sensors that use it (VmScriptOperator, the sensors, collect_outputs) and
the VM recovery, which runs the same steps on a recreated VM.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from google.api_core.exceptions import NotFound
from googleapiclient.errors import HttpError

from airflow.sdk.exceptions import AirflowException
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.cloud.hub import hf_token
from maxtext_sft.vm.ssh_common import LoginRefused
from maxtext_sft.run.spec import RunSpec
from maxtext_sft.vm.steps import STEPS, parse_results, remote_command, script_files

if TYPE_CHECKING:
    from maxtext_sft.vm.ssh import VmSSHHook


def vm_address(spec: RunSpec, gcp_conn_id: str, hook: ComputeEngineEndpointHook | None = None) -> str:
    """The VM's address, asked from the Compute API each time (a recreated VM may have a new one).

    Raises google.api_core's NotFound when the instance is gone (the hook's discovery client
    reports that as an HttpError 404).
    """
    hook = hook or ComputeEngineEndpointHook(gcp_conn_id=gcp_conn_id)
    try:
        return hook.get_instance_address(
            zone=spec.zone, resource_id=spec.vm_name, project_id=spec.project_id,
            use_internal_ip=not spec.external_address,
        )
    except HttpError as error:
        if error.resp.status == 404:
            raise NotFound(f"instance {spec.vm_name} not found") from error
        raise


class HostKeysNotPublished(RuntimeError):
    """The VM's guest agent has not published its SSH host keys (yet)."""


def transient_ssh_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "not reachable yet / right now", not "broken" (for `except`: only
    evaluated when something was raised, so paramiko is imported only by a task that uses SSH)."""
    import paramiko

    return (OSError, EOFError, paramiko.SSHException)


def vm_ssh_hook(spec: RunSpec, gcp_conn_id: str, ssh_conn_id: str, **kwargs) -> VmSSHHook:
    """An SSH hook to the VM's current address that accepts only the host key the VM published.

    Raises NotFound when the VM is gone, HostKeysNotPublished before its guest agent ran.
    """
    from maxtext_sft.vm.ssh import VmSSHHook  # imported when used: DAG files stay cheap to parse (docs/architecture.md)

    target = ssh_target(spec, gcp_conn_id)
    if target["proxy_command"]:
        kwargs["host_proxy_cmd"] = target["proxy_command"]
    hook = VmSSHHook(
        ssh_conn_id=ssh_conn_id,
        remote_host=target["host"],
        host_keys=target["host_keys"],
        conn_timeout=spec.ssh_connect_timeout_seconds,
        **kwargs,
    )
    if target["username"]:
        hook.username = target["username"]
    return hook


def published_host_keys(
    gcp_conn_id: str, vm_name: str, zone: str, project_id: str, hook: ComputeEngineEndpointHook | None = None
) -> dict[str, str]:
    """The SSH host keys VM `vm_name` published, the only ones to accept; raises
    HostKeysNotPublished before its guest agent ran (blocking: a trigger runs it in a thread)."""
    keys = (hook or ComputeEngineEndpointHook(gcp_conn_id=gcp_conn_id)).get_host_keys(
        resource_id=vm_name, zone=zone, project_id=project_id
    )
    if not keys:
        raise HostKeysNotPublished(f"VM {vm_name} has published no SSH host keys in its guest attributes yet")
    return keys


def ssh_target(
    spec: RunSpec, gcp_conn_id: str, *, host_keys_required: bool = True, caller: str = "worker"
) -> dict[str, Any]:
    """Where and how to reach the VM now: {host, host_keys (the only ones to accept), username
    (OS Login's, else None: the connection's login), os_login (with the Param os_login, what a
    trigger renews the key from: cloud/os_login.py; else None), proxy_command (IAP's, else None)}.
    With os_login the key is imported anew, valid for its whole lifetime (`caller`: who asks).

    Raises NotFound when the VM is gone, HostKeysNotPublished before its guest agent ran (without
    `host_keys_required`, host_keys is then empty: a trigger reads them when they are published).
    """
    from maxtext_sft.cloud.os_login import os_login_key

    hook = ComputeEngineEndpointHook(gcp_conn_id=gcp_conn_id)  # one client for both reads
    address = vm_address(spec, gcp_conn_id, hook)
    try:
        keys = published_host_keys(gcp_conn_id, spec.vm_name, spec.zone, spec.project_id, hook)
    except HostKeysNotPublished:
        if host_keys_required:
            raise
        keys = {}
    login = os_login_key(spec, gcp_conn_id, caller=caller) if spec.os_login else {"username": None, "os_login": None}
    return {
        "host": address,
        "host_keys": keys,
        **login,
        "proxy_command": iap_tunnel_command(spec) if spec.ssh_via_iap else None,
    }


def iap_tunnel_command(spec: RunSpec) -> str:
    """gcloud's IAP TCP tunnel to the VM's port 22, as an SSH ProxyCommand (stdin/stdout)."""
    return shlex.join([
        "gcloud", "compute", "start-iap-tunnel", spec.vm_name, "22", "--listen-on-stdin",
        f"--zone={spec.zone}", f"--project={spec.project_id}", "--verbosity=warning",
    ])


# A new VM's guest agent creates the user from the ssh-keys metadata shortly after sshd starts;
# until then a login is refused. Refused for longer than this, something else refuses it.
LOGIN_GRACE_SECONDS = 90


class SshLoginProbe:
    """Whether a new VM accepts an SSH login as the pipeline's (non-root) user yet.

    Unreachable, no host keys published yet: still booting, False. A refused login is not booting:
    if OS Login is on by metadata and the run does not use it, it fails at once (the VM ignores the
    ssh-keys metadata the run's key is in); otherwise it is given LOGIN_GRACE_SECONDS from the
    first refusal, then fails naming what may refuse it. Keep one probe for one wait.
    """

    def __init__(self, spec: RunSpec, gcp_conn_id: str, ssh_conn_id: str, log: Any, *, first_refused: float | None = None):
        self.spec = spec
        self.gcp_conn_id = gcp_conn_id
        self.ssh_conn_id = ssh_conn_id
        self.log = log
        # When a login was first refused (epoch seconds: a deferred wait's next process goes on from it).
        self.first_refused = first_refused
        self.last_unreachable: BaseException | None = None  # why the VM last did not answer

    def __call__(self) -> bool:
        spec = self.spec
        try:
            hook = vm_ssh_hook(spec, self.gcp_conn_id, self.ssh_conn_id, conn_retry_attempts=1)
            with hook.get_conn():
                status, _ = hook.run_command("true", timeout=60, on_line=self.log.info)
        except LoginRefused as refused:
            return self.judge_refusal(refused)
        except (HostKeysNotPublished, *transient_ssh_errors()) as error:
            self.log.info("VM %s does not answer SSH yet: %s", spec.vm_name, error)
            self.last_unreachable = error
            return False
        return status == 0

    def unreachable_reason(self, seconds: float) -> str:
        """Why the VM answered no SSH login for `seconds`, naming what to fix."""
        error = self.last_unreachable
        return unreachable_reason(self.spec, seconds, type(error).__name__ if error else None, str(error or ""))

    def judge_refusal(self, refused: LoginRefused) -> bool:
        """A refused login (this probe's, or a trigger's): raises LoginRefused when OS Login is on
        for a run without it, or past LOGIN_GRACE_SECONDS from the first refusal; else False."""
        spec = self.spec
        os_login = ComputeEngineEndpointHook(gcp_conn_id=self.gcp_conn_id).os_login_enabled(
            resource_id=spec.vm_name, zone=spec.zone, project_id=spec.project_id
        )
        if os_login and not spec.os_login:
            raise LoginRefused(
                f"{refused} OS Login is enabled for VM {spec.vm_name} (metadata enable-oslogin=TRUE, set on "
                "the project or its organisation), so the VM ignores the ssh-keys metadata that holds this "
                "run's key. Set the Param os_login to log in through OS Login as the Google connection's "
                "account (roles/compute.osAdminLogin), or disable OS Login for these VMs."
            ) from None
        now = time.time()
        self.first_refused = self.first_refused or now
        if now - self.first_refused < LOGIN_GRACE_SECONDS:
            self.log.info("VM %s refused the login, maybe before its guest agent made the user: %s", spec.vm_name, refused)
            return False
        if spec.os_login:
            why = (
                "With the Param os_login the VM takes the key imported into the Google connection "
                "account's OS Login profile: that account needs roles/compute.osAdminLogin on the VM."
            )
        else:
            why = (
                "The ssh-keys metadata holds this run's key; a VM ignores it when OS Login is enforced "
                "(the organisation policy constraints/compute.requireOsLogin, or enable-oslogin=TRUE where "
                "this account cannot read it): then set the Param os_login."
            )
        raise LoginRefused(f"{refused} (for {LOGIN_GRACE_SECONDS} s). {why}") from None


def unreachable_reason(spec: RunSpec, seconds: float, error_type: str | None, error: str) -> str:
    """Why `spec`'s VM answered no SSH login for `seconds`, naming what to fix, from the last error
    that said it did not answer (its type's name and text: a trigger's event carries them)."""
    how = (
        "through IAP (a firewall rule must allow tcp:22 from 35.235.240.0/20)" if spec.ssh_via_iap
        else "at its internal IP" if spec.use_internal_ip else "at its external IP"
    )
    head = f"VM {spec.vm_name} answered no SSH login for {seconds:.0f} s (ssh_ready_timeout_seconds), reached {how}"
    if error_type == HostKeysNotPublished.__name__:
        return f"{head}: its guest agent published no host keys (guest attributes): {error}"
    text = (f"{error_type}: {error}" if error else error_type) if error_type else "no answer"
    if "refused" in text.lower() or error_type == ConnectionRefusedError.__name__:
        why = "port 22 refused the connection: nothing listens, or a firewall rejects it"
    else:
        why = "the connection did not complete: a firewall drops it, or there is no route to the VM"
    return (
        f"{head}: {why} ({text}). Check for a VPC firewall rule on network {spec.network} allowing "
        f"tcp:22 from the workers' addresses to the network tag {spec.network_tag}."
    )


def run_vm_step(
    step: str, spec: RunSpec, results: dict, *, gcp_conn_id: str, ssh_conn_id: str, hf_conn_id: str, log: Any
) -> dict[str, str] | None:
    """Upload the scripts and run `step`'s script on the run's VM; return what it reported."""
    vm_step = STEPS[step]
    stdin = (hf_token(hf_conn_id) + "\n").encode() if vm_step.needs_hf_token else None
    hook = vm_ssh_hook(spec, gcp_conn_id, ssh_conn_id)
    command = remote_command(step, spec, results)
    reported: list[str] = []

    def on_line(line: str) -> None:
        log.info("%s", line)
        if line.startswith("MAXTEXT_SFT_RESULT "):
            reported.append(line)

    with hook.get_conn():
        hook.upload_scripts(script_files())
        log.info("Running on %s: %s", spec.vm_name, command)
        status, tail = hook.run_command(command, stdin=stdin, timeout=vm_step.timeout_seconds(spec), on_line=on_line)
    if status != 0:
        raise AirflowException(
            f"{vm_step.script} exited with status {status} on {spec.vm_name}; last lines:\n" + "\n".join(tail)
        )
    return parse_results(reported) or None


def run_vm_steps(
    steps: Sequence[str], spec: RunSpec, results: dict, *, what: str, gcp_conn_id: str, ssh_conn_id: str,
    hf_conn_id: str, log: Any,
) -> tuple[dict, dict[str, float]]:
    """Run `steps` in order on the VM, each given `results` and what the steps before it reported;
    log each one's seconds ("WHAT: STEP took S s"). Returns (those results, each step's seconds)."""
    results, seconds = dict(results), {}
    for step in steps:
        started = time.monotonic()
        results |= run_vm_step(
            step, spec, results, gcp_conn_id=gcp_conn_id, ssh_conn_id=ssh_conn_id, hf_conn_id=hf_conn_id, log=log
        ) or {}
        seconds[step] = round(time.monotonic() - started, 1)
        log.info("%s: %s took %.1f s", what, step, seconds[step])
    return results, seconds


def start_autostop(spec: RunSpec, gcp_conn_id: str, ssh_conn_id: str, log: Any) -> None:
    """Start the VM's own watchdog (include/vm/autostop.sh): from the first login on, the VM stops
    itself after autostop_idle_minutes without a training, a step or a check from the pipeline,
    so a dead Airflow leaves it billing minutes, not the rest of its lifetime."""
    run_vm_step("autostop", spec, {}, gcp_conn_id=gcp_conn_id, ssh_conn_id=ssh_conn_id, hf_conn_id="", log=log)
