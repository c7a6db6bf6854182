"""How a task reaches the run's VM: its current address, an SSH hook that trusts only the host
key the VM published, the probe that tells a booting VM from one that refuses the login, and one
step script run on it.

Below the operators and sensors that use it (VmScriptOperator, the sensors, collect_outputs) and
the VM recovery, which runs the same steps on a recreated VM.
"""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from google.api_core.exceptions import NotFound
from googleapiclient.errors import HttpError

from airflow.sdk.exceptions import AirflowException
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.cloud.hub import hf_token
from maxtext_sft.cloud.iap_tunnel import iap_target
from maxtext_sft.vm.ssh_common import HostKeyMismatch, LoginRefused
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
    hook = VmSSHHook(
        ssh_conn_id=ssh_conn_id,
        remote_host=target["host"],
        host_keys=target["host_keys"],
        conn_timeout=spec.ssh_connect_timeout_seconds,
        iap=target["iap"],
        **kwargs,
    )
    if target["username"]:
        hook.username = target["username"]
    hook.published_host_keys = dict(target["host_keys"])  # what the VM published, read for this hook
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


def key_fingerprints(host_keys: dict[str, str]) -> str:
    """The keys' types and the start of their SHA256 fingerprints, as ssh-keygen -l shows them."""
    def fingerprint(blob: str) -> str:
        digest = base64.b64encode(hashlib.sha256(base64.b64decode(blob)).digest()).decode().rstrip("=")
        return f"SHA256:{digest[:12]}..."

    return ", ".join(f"{kind} {fingerprint(blob)}" for kind, blob in sorted(host_keys.items())) or "none"


# What the wait for SSH (tasks/vm_sensors.VmSshReadySensor, the task whose operator has
# `pins_host_keys`) hands on in its XCom: {"host_keys": {vm_name: {type: base64}},
# "instance_ids": {vm_name: id}}. A task of the same run compares what the VM publishes with it.
PINNED_KEYS = "host_keys"


def pinned_host_keys(vm_name: str) -> tuple[dict[str, str], str] | None:
    """(keys, instance id) the run's wait for SSH pinned for VM `vm_name`, read from its XCom when
    this runs in another task of that run; None elsewhere (the wait itself, a trigger, no task)."""
    record = pinned_record()
    keys = (record.get(PINNED_KEYS) or {}).get(vm_name) if record else None
    return (keys, str((record.get("instance_ids") or {}).get(vm_name) or "")) if keys else None


# The wait's XCom, read once per task try: a slice's per-host threads (slice_hosts.on_every_host,
# which reads it first in the task's own thread) cannot reach the task's supervisor themselves on
# every Airflow this package supports (3.3.1's XCom read from a thread fails).
_PINNED_RECORDS: dict[str, dict | None] = {}


def pinned_record() -> dict | None:
    """The run's wait-for-SSH XCom as this task try sees it (see pinned_host_keys); None outside a
    task, in the wait itself, or in a DAG without one."""
    try:
        from airflow.sdk import get_current_context

        context = get_current_context()
    except Exception:  # noqa: BLE001 - not in a task: nothing pinned to compare with
        return None
    ti, dag = context.get("ti"), context.get("dag")
    waits = [task_id for task_id, task in getattr(dag, "task_dict", {}).items() if getattr(task, "pins_host_keys", False)]
    if ti is None or not waits or ti.task_id in waits:
        return None
    key = "/".join(str(getattr(ti, name, "")) for name in ("id", "dag_id", "run_id", "task_id", "try_number"))
    if key not in _PINNED_RECORDS:
        _PINNED_RECORDS[key] = ti.xcom_pull(task_ids=waits[0]) or {}
    return _PINNED_RECORDS[key]


def instance_id(spec: RunSpec, gcp_conn_id: str, hook: ComputeEngineEndpointHook | None = None) -> str:
    """The id of the instance named `spec.vm_name` now (a VM made again under its name has a new
    one); NotFound when it is gone, as vm_address."""
    hook = hook or ComputeEngineEndpointHook(gcp_conn_id=gcp_conn_id)
    try:
        info = hook.get_instance_info(zone=spec.zone, resource_id=spec.vm_name, project_id=spec.project_id)
    except HttpError as error:
        if error.resp.status == 404:
            raise NotFound(f"instance {spec.vm_name} not found") from error
        raise
    return str(info.get("id") or "")


def check_pinned_host_keys(
    spec: RunSpec, published: dict[str, str], hook: ComputeEngineEndpointHook, pinned: tuple[dict[str, str], str] | None
) -> None:
    """Fail (HostKeyMismatch, naming the old and the new keys) when the VM publishes other host
    keys than the ones the wait for SSH pinned, unless it is another instance than the one pinned
    (a VM the pipeline made again: its own wait for SSH checks its keys)."""
    if not pinned or not published:
        return
    keys, pinned_id = pinned
    changed = {kind: blob for kind, blob in published.items() if kind in keys and keys[kind] != blob}
    if not changed and set(keys) & set(published):
        return
    if pinned_id and instance_id(spec, "", hook) != pinned_id:
        return  # made again since the wait pinned its keys
    raise HostKeyMismatch(
        f"The SSH host keys of VM {spec.vm_name} changed after the wait for SSH pinned them: it pinned "
        f"{key_fingerprints(keys)}; the VM now publishes {key_fingerprints(published)}. A VM's keys change "
        "only during its first boot; refusing to connect"
    )


def ssh_target(
    spec: RunSpec, gcp_conn_id: str, *, host_keys_required: bool = True, caller: str = "worker"
) -> dict[str, Any]:
    """Where and how to reach the VM now: {host, host_keys (the only ones to accept), username
    (OS Login's, else None: the connection's login), os_login (with the Param os_login, what a
    trigger renews the key from: cloud/os_login.py; else None), iap (with the Param ssh_via_iap, the
    tunnel's target, cloud/iap_tunnel.py: it opens under the Google connection's identity; else None)}.
    With os_login the key is imported anew, valid for its whole lifetime (`caller`: who asks).

    Raises NotFound when the VM is gone, HostKeysNotPublished before its guest agent ran (without
    `host_keys_required`, host_keys is then empty: a trigger reads them when they are published),
    HostKeyMismatch when they are not the ones the run's wait for SSH pinned (`check_pinned_host_keys`).
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
    check_pinned_host_keys(spec, keys, hook, pinned_host_keys(spec.vm_name))
    login = os_login_key(spec, gcp_conn_id, caller=caller) if spec.os_login else {"username": None, "os_login": None}
    return {
        "host": address,
        "host_keys": keys,
        **login,
        "iap": iap_target(gcp_conn_id, spec.project_id, spec.zone, spec.vm_name) if spec.ssh_via_iap else None,
    }


# A new VM's guest agent creates the user from the ssh-keys metadata shortly after sshd starts;
# until then a login is refused. Refused for longer than this, something else refuses it.
LOGIN_GRACE_SECONDS = 90


# How long sshd may show a key other than the ones published, the same ones all along, before the
# wait fails: a first boot's guest agent publishes each new key right after it put it in place
# (google_guest_agent/instance_setup.go, generateSSHKeys), so a longer mismatch is not one.
HOST_KEY_MISMATCH_GRACE_SECONDS = 15


def host_keys_settled(
    previous: dict[str, str] | None, published: dict[str, str], mismatch: BaseException | None,
    mismatched_since: float | None = None,
) -> bool:
    """Whether a wait for SSH pins `published`, the host keys read now: the read before found the
    same ones (`previous`: the keys of the last read whose login met one of them) and the login
    with them worked now (no `mismatch`: sshd showed one of them). A new VM's keys can change
    during its first boot (cloud-init's ssh module makes and publishes keys, then the guest agent's
    first-boot action makes new ones, serves them, and publishes them a moment later:
    localcloud/compute/guest_agent.py names the sources), so keys read once, or a mismatch, are
    read again at the next poll (False). Raises HostKeyMismatch when sshd has shown another key
    since `mismatched_since` (epoch seconds), the same keys published all along, for
    HOST_KEY_MISMATCH_GRACE_SECONDS: something other than the VM answers."""
    if mismatch is None:
        return bool(published) and published == previous
    if mismatched_since is not None and time.time() - mismatched_since >= HOST_KEY_MISMATCH_GRACE_SECONDS:
        raise HostKeyMismatch(
            f"{mismatch} (for {HOST_KEY_MISMATCH_GRACE_SECONDS} s, the same keys published all along)"
        ) from None
    return False


class SshLoginProbe:
    """Whether a new VM accepts an SSH login as the pipeline's (non-root) user yet, with host keys
    that have settled (`host_keys_settled`; then `pinned` holds them).

    Unreachable, no host keys published yet, keys still changing: still booting, False. A refused
    login is not booting: if OS Login is on by metadata and the run does not use it, it fails at
    once (the VM ignores the ssh-keys metadata the run's key is in); otherwise it is given
    LOGIN_GRACE_SECONDS from the first refusal, then fails naming what may refuse it. Keep one
    probe for one wait.
    """

    def __init__(
        self, spec: RunSpec, gcp_conn_id: str, ssh_conn_id: str, log: Any, *, first_refused: float | None = None,
        last_keys: dict[str, str] | None = None,
    ):
        self.spec = spec
        self.gcp_conn_id = gcp_conn_id
        self.ssh_conn_id = ssh_conn_id
        self.log = log
        # When a login was first refused (epoch seconds: a deferred wait's next process goes on from it).
        self.first_refused = first_refused
        self.last_unreachable: BaseException | None = None  # why the VM last did not answer
        # The host keys published at the last read whose login met one of them; the keys published
        # while sshd has shown another key, and since when.
        self.last_keys = dict(last_keys) if last_keys else None
        self.mismatched: tuple[dict[str, str], float] | None = None  # (keys, since when) sshd showed another
        self.pinned: dict[str, str] | None = None
        # The last login worked with keys read for the first time: the next read may pin them.
        self.awaiting_second_read = False

    def __call__(self) -> bool:
        spec = self.spec
        keys: dict[str, str] = {}
        self.awaiting_second_read = False
        try:
            hook = vm_ssh_hook(spec, self.gcp_conn_id, self.ssh_conn_id, conn_retry_attempts=1)
            keys = hook.published_host_keys
            with hook.get_conn():
                status, _ = hook.run_command("true", timeout=60, on_line=self.log.info)
        except LoginRefused as refused:
            self.last_keys, self.mismatched = keys, None  # refused after the host key check: it matched
            return self.judge_refusal(refused)
        except HostKeyMismatch as mismatch:
            return self.judge_keys(keys, mismatch)
        except (HostKeysNotPublished, *transient_ssh_errors()) as error:
            self.log.info("VM %s does not answer SSH yet: %s", spec.vm_name, error)
            self.last_unreachable = error
            return False
        return status == 0 and self.judge_keys(keys, None)

    def judge_keys(self, keys: dict[str, str], mismatch: HostKeyMismatch | None) -> bool:
        """After a login with the `keys` read now (`mismatch`: sshd showed another key): whether
        they settled (pinned), else False (read again at the next poll); raises as host_keys_settled."""
        previous = self.last_keys
        if mismatch is None:
            self.last_keys, self.mismatched = keys, None
        elif not self.mismatched or self.mismatched[0] != keys:
            self.last_keys, self.mismatched = None, (keys, time.time())
        if host_keys_settled(previous, keys, mismatch, self.mismatched[1] if self.mismatched else None):
            self.pinned = keys
            self.log.info("VM %s: SSH host keys pinned (%s)", self.spec.vm_name, key_fingerprints(keys))
            return True
        if mismatch is not None:
            self.last_unreachable = mismatch
            self.log.info("VM %s: its sshd shows a host key it has not published (yet), as during a first "
                          "boot: reading them again (%s)", self.spec.vm_name, mismatch)
        else:
            self.awaiting_second_read = True
            self.log.info("VM %s takes the login with host keys %s: reading them again to see that they "
                          "stay", self.spec.vm_name, key_fingerprints(keys))
        return False

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
    if error_type == HostKeyMismatch.__name__:
        return f"{head}: its host keys did not settle (its sshd showed keys it had not published): {error}"
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
