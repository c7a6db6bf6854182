"""The fault matrix: whatever fails, no instance is left and the run's error names the cause.

Each case injects one fault into the local cloud or the MaxText stand-in, runs the whole DAG
(`dag.test()`), and asserts: the run ended as expected, no instance is left, and (for a failed
run) check_run_outcome's error names the cause. The session ends with one line: faults injected,
VMs leaked, runs whose error named the cause.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from tests.dags import fault_tally

pytestmark = pytest.mark.e2e


@dataclasses.dataclass(frozen=True)
class Fault:
    name: str
    conf: dict = dataclasses.field(default_factory=dict)
    cloud: dict | None = None
    maxtext: dict | None = None
    outcome: str = "failed"
    failed_task: str | None = None
    cause: str = ""  # text the run's error must contain
    preempt_in_training: bool = False  # the cloud deletes the VM once its training has started


MATRIX = [
    Fault(
        "create rejected: reservation full",
        cloud={"insert_rejected": {"preset": "reservation_no_capacity", "count": 3}},
        failed_task="create_vm",
        cause="does not have sufficient capacity",
    ),
    Fault(
        "create rejected: zone exhausted, then capacity",
        cloud={"insert_rejected": {"preset": "zone_resource_pool_exhausted", "count": 1}},
        outcome="success",
    ),
    Fault(
        "5xx, then success",
        cloud={"http_errors": [{"method": "POST", "path_regex": "/instances$", "status": 503, "count": 1}]},
        outcome="success",
    ),
    Fault("SSH refused, then up", cloud={"ssh_refused": {"seconds": 8}}, outcome="success"),
    Fault("SSH banner hangs, then up", cloud={"ssh_banner_timeout": {"seconds": 8}}, outcome="success"),
    Fault(
        "create fails after acceptance",
        cloud={"insert_fails_after_accept": {"code": "ZONE_RESOURCE_POOL_EXHAUSTED", "leave_instance": True}},
        failed_task="create_vm",
        cause="ZONE_RESOURCE_POOL_EXHAUSTED",
    ),
    Fault(
        "conversion fails",
        maxtext={"to_maxtext": {"fail": "checkpoint shard 3 is corrupt"}},
        failed_task="convert_checkpoint",
        cause="checkpoint shard 3 is corrupt",
    ),
    Fault(
        "training crashes",
        maxtext={"train_sft": {"crash_at_step": 4}},
        failed_task="wait_for_final_checkpoint",
        cause="training exited with code 1 after step 3",
    ),
    Fault(
        "training stalls",
        conf={"stall_timeout_seconds": 10},
        maxtext={"train_sft": {"stall_at_step": 4}},
        failed_task="wait_for_final_checkpoint",
        cause="stalled: no new step for",
    ),
    Fault(
        "insert operation hangs a while",
        cloud={"operation_hangs": {"operation": "insert", "seconds": 8}},
        outcome="success",
    ),
    Fault(
        "delete operation fails once",
        cloud={"operation_errors": {"operation": "delete", "count": 1}},
        outcome="success",
    ),
    Fault(
        # Recovery (recreate and resume) is not built yet: the run fails at once, saying why.
        "VM deleted by the cloud mid-training",
        maxtext={"train_sft": {"stall_at_step": 5}},
        preempt_in_training=True,
        failed_task="wait_for_final_checkpoint",
        cause="no longer exists",
    ),
    Fault(
        "export fails",
        maxtext={"to_huggingface": {"fail": "no space left on device"}},
        failed_task="export_to_hf",
        cause="no space left on device",
    ),
]


@pytest.mark.parametrize("fault", MATRIX, ids=[f.name for f in MATRIX])
def test_fault(fault, run_pipeline, local_cloud):
    fault_tally.fault_injected()
    preempter = None
    if fault.preempt_in_training:
        preempter = threading.Thread(target=preempt_when_training, args=(local_cloud,), daemon=True)
        preempter.start()
    run = run_pipeline({"steps": 12, **fault.conf}, maxtext_faults=fault.maxtext, cloud_faults=fault.cloud)
    if preempter:
        preempter.join(timeout=5)
    leaked = local_cloud.vms()
    fault_tally.vms_left(leaked)
    assert leaked == []
    assert run.state == fault.outcome, run.task_states
    if fault.outcome == "failed":
        error = run.log[run.log.rindex("The fine-tune did not complete") :]
        fault_tally.failed_run(error, fault.cause)
        assert run.task_states[fault.failed_task] == "failed", run.task_states
        assert run.task_states["delete_vm"] in ("success", "skipped"), run.task_states
        assert fault.cause in error, error[:3000]


def preempt_when_training(cloud, timeout: float = 300) -> None:
    """Delete the run's VM the way the cloud does, once its training process has started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for vm in cloud.vms():
            homes = cloud.state_dir / "vms" / vm["name"] / "home"
            if any(homes.glob("*/maxtext-sft-runs/*/pid")):
                cloud.terminate_vm(vm["name"], "DELETE")
                return
        time.sleep(0.2)  # polling interval; the VM's files are re-read each time

