"""What a rehearsal proves, one named check each, from what its tasks left (states, XComs, errors).

The rehearsal (fine_tune_dag(rehearsal=True), DAG maxtext_sft_rehearsal) runs the fine-tune's
tasks on a cheap CPU VM; its run summary lists these checks with their results, so a team sees
in one place what a real run on this project would get through and what it would not. Pure
functions: tests need no Airflow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from maxtext_sft.results.summary import FAILURE_KEY, NOT_RUN_STATES

PASSED, FAILED, NOT_RUN, SKIPPED = "passed", "FAILED", "not run", "skipped"


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    proves: str
    tasks: tuple[str, ...]  # every one must succeed
    results: tuple[str, ...] = ()  # the check_vm_access results it reads ("" to skip)


CHECKS: tuple[Check, ...] = (
    Check("token and inputs (worker)", "the token reads the base model and the dataset snapshot; the "
          "reservation exists (in its owner project, shared with this one) and holds machine_type (read only); "
          "the network takes the VM; output_location is writable", ("plan_run", "preflight")),
    Check("compute insert", "the Compute API accepts this project's insert (IAM, quota, policy)", ("create_vm",)),
    Check("ssh", "SSH as the run logs in (metadata keys, OS Login or IAP), host key verified", ("wait_for_ssh",)),
    Check("bucket from the VM", "the VM's service account writes, reads and deletes in output_location",
          ("check_vm_access",), ("bucket",)),
    Check("hub from the VM", "the VM reaches the Hub; the token reads the gated base model and the dataset revision",
          ("check_vm_access",), ("model", "dataset")),
    Check("maxtext at toy size", "the same MaxText version installs; convert, SFT and export run",
          ("install_maxtext", "prepare_rehearsal", "convert_checkpoint", "start_training",
           "wait_for_final_checkpoint", "export_to_hf", "collect_outputs")),
    Check("hub publish", "the tuned model is committed to hub_repo_id", ("publish_to_hub",)),
    Check("delete", "the delete is accepted and leaves no instance", ("delete_vm",)),
)

def rehearsal_checks(
    *,
    states: Mapping[str, str | None],
    xcom: Callable[[str, str | None], Any],
    spec: Mapping[str, Any] | None,
    instance_left: str | None,
) -> list[dict[str, str]]:
    """[{check, result, detail}] for each of CHECKS, in order.

    `xcom(task_id, key)` reads a task's XCom (key None: its return value; a failed task's error is
    under results.summary.FAILURE_KEY); `instance_left` is the VM's status after the run ("" when it
    is gone, None when it could not be read).
    """
    spec = spec or {}
    rows = []
    for check in CHECKS:
        result, detail = _task_result(check, states, xcom)
        if result == FAILED and check.results:
            result, detail = _vm_check_result(check, xcom(check.tasks[0], FAILURE_KEY) or "", detail)
        if result == PASSED and not detail:
            detail = _detail(check, xcom, spec)
        if check.name == "bucket from the VM" and result == PASSED and not spec.get("output_location"):
            result, detail = SKIPPED, "no output_location: nothing of the run is written to a bucket"
        if check.name == "hub publish" and states.get("publish_to_hub") == "success" and not spec.get("hub_repo_id"):
            result, detail = SKIPPED, "no hub_repo_id: set it to a private repo to check publishing"
        if check.name == "delete" and result == PASSED:
            if instance_left:
                result, detail = FAILED, f"the instance is still there after the delete (status {instance_left})"
            elif instance_left is None:
                detail = "delete_vm succeeded; whether the instance is gone could not be read"
            else:
                detail = f"instance {spec.get('vm_name')} is gone (its boot disk is auto-deleted with it)"
        rows.append({"check": check.name, "result": result, "proves": check.proves, "detail": detail})
    return rows


def _task_result(check: Check, states, xcom) -> tuple[str, str]:
    for task_id in check.tasks:
        state = states.get(task_id)
        if state == "failed":
            error = xcom(task_id, FAILURE_KEY) or "no error recorded"
            return FAILED, f"{task_id}: {_first_lines(error)}"
        if state in NOT_RUN_STATES:
            return NOT_RUN, f"{task_id} did not run ({state or 'no state'})"
        if state != "success":
            return NOT_RUN, f"{task_id} is {state}"
    return PASSED, ""


def _vm_check_result(check: Check, error: str, fallback: str) -> tuple[str, str]:
    """A check of check_vm_access.sh when the script failed: its own error lines (each check's
    start with its name, the client's words indented below), or passed when the error shows only
    its success lines (another check of the script failed)."""
    mine, keep = [], False
    for line in error.splitlines():
        text = line.strip()
        if any(text.startswith(f"{name}: ") for name in check.results):
            keep = True
        elif not line.startswith("  "):
            keep = False
        if keep and text:
            mine.append(text)
    if mine:
        return FAILED, " | ".join(mine)[:1200]
    passed = [line for line in error.splitlines() if any(f"MAXTEXT_SFT_RESULT {n}=ok" in line for n in check.results)]
    if passed:
        return PASSED, "; ".join(line.split("=", 1)[1] for line in passed)
    return FAILED, fallback


def _detail(check: Check, xcom, spec: Mapping[str, Any]) -> str:
    if check.results:
        reported = xcom("check_vm_access", None) or {}
        return "; ".join(reported[name] for name in check.results if reported.get(name))
    if check.name == "token and inputs (worker)":
        return "; ".join(xcom("preflight", None) or ())
    if check.name == "compute insert":
        return f"{spec.get('rehearsal_machine_type')} in {spec.get('zone')}, instance {spec.get('vm_name')}"
    if check.name == "ssh":
        how = "IAP" if spec.get("ssh_via_iap") else "OS Login" if spec.get("os_login") else "ssh-keys metadata"
        return f"logged in as {spec.get('ssh_user')} ({how}), host key checked against the guest attributes"
    if check.name == "hub publish":
        published = xcom("publish_to_hub", None) or {}
        return f"{published.get('repo_id')} at commit {published.get('commit')}"
    return ""


def _first_lines(text: str, lines: int = 3, chars: int = 600) -> str:
    return " | ".join(text.strip().splitlines()[:lines])[:chars]

