"""The fault matrix: whatever fails, no instance is left and the run's error names the cause.

Each case injects one fault into the local cloud or the MaxText stand-in, runs the whole DAG
(`dag.test()`), and asserts: the run ended as expected, no instance is left, and (for a failed
run) check_run_outcome's error names the cause. The session ends with one line: faults injected,
VMs leaked, runs whose error named the cause.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time

import pytest

from bench.run import compute_operations
from tests.dags import fault_tally

# Every row is an independent whole-DAG run: parallel workers may split them.
pytestmark = [pytest.mark.e2e, pytest.mark.spread]


@dataclasses.dataclass(frozen=True)
class Fault:
    name: str
    conf: dict = dataclasses.field(default_factory=dict)
    cloud: dict | None = None
    maxtext: dict | None = None
    outcome: str = "failed"
    failed_task: str | None = None
    cause: str = ""  # text the run's error must contain
    log: str = ""  # text the run's task logs must contain
    tries: int | None = None  # create_vm's tries, when the case is about them
    # The cloud deletes the VM (as a preemption does) once its training log has this text, up to
    # `preemptions` times; the MaxText faults are lifted after the last one.
    preempt_after: str | None = None
    preemptions: int = 1
    # How the VM goes: deleted as the cloud deletes one (terminate_vm), or a Spot preemption
    # (preempt_vm: the compute.instances.preempted operation, a soft off, then deleted).
    spot_preemption: bool = False
    cloud_after_preempt: dict | None = None  # cloud faults set for the (last) preemption, as it happens
    # The VM's sshd is frozen (no SSH banner: the VM is up but unreachable) once its training
    # log has this text; the MaxText faults are lifted once that VM is gone.
    freeze_sshd_after: str | None = None
    recoveries: int = 1  # entries in the recovery ledger of a run that resumed
    durable: bool = False  # checkpoints in the local bucket (output_location)


DURABLE_CONF = {"output_location": "gs://fault-matrix/outputs", "checkpoint_period": 3}
# A Spot VM instead of the reservation's; a stockout is asked again every 2 s (capacity_poll_seconds).
SPOT_CONF = {"capacity": "spot", "reservation": None}
FLEX_START_CONF = {"capacity": "flex-start", "reservation": None, "flex_start_valid_minutes": 2}
# Holds the training after step 4 (checkpoints 1 and 3 committed) until the VM is deleted.
HELD_AT_STEP_5 = {"train_sft": {"stall_at_step": 5}}
# A frozen sshd answers no banner: each poke waits 3 s, and 10 s of that make the VM lost.
UNREACHABLE_CONF = {"unreachable_timeout_seconds": 10, "ssh_connect_timeout_seconds": 3}


MATRIX = [
    # Instance-creation errors, one row per class of maxtext_sft.cloud.errors, each in the shape and
    # place Compute Engine reports it (the emulator's INSTANCE_ERRORS presets name their sources).
    Fault(
        "reservation full (on the operation), no wait allowed",
        conf={"max_capacity_wait_minutes": 0},
        cloud={"operation_errors": {"operation": "insert", "preset": "reservation_full", "count": 3}},
        failed_task="create_vm",
        cause="no free capacity in reservation local-reservation",
        tries=1,
    ),
    Fault(
        "reservation full (on the operation): back to the capacity gate, then created",
        cloud={"operation_errors": {"operation": "insert", "preset": "reservation_full", "count": 1}},
        outcome="success",
        tries=1,
    ),
    Fault(
        "zone stockout once (on the operation): retried, then created",
        cloud={"insert_fails_after_accept": {"code": "ZONE_RESOURCE_POOL_EXHAUSTED", "count": 1}},
        outcome="success",
        tries=2,
    ),
    *(
        Fault(
            f"create refused for good: {name}",
            cloud={kind: {**({"operation": "insert"} if kind == "operation_errors" else {}), "preset": preset}},
            failed_task="create_vm",
            cause=cause,
            tries=1,
        )
        for name, kind, preset, cause in (
            ("quota (on the operation)", "operation_errors", "quota_exceeded",
             "quota exceeded (QUOTA_EXCEEDED: Quota 'CPUS' exceeded."),
            ("permission (synchronous 403)", "insert_rejected", "permission_denied",
             "permission denied (forbidden: Required 'compute.instances.create' permission for"),
            ("organisation policy (on the operation)", "operation_errors", "org_policy",
             "organisation policy (CONDITION_NOT_MET: Instance 'maxtext-sft-"),
            ("missing reservation (on the operation)", "operation_errors", "reservation_not_found",
             "reservation not found (CONDITION_NOT_MET: Specified reservation 'local-reservation' does not exist.)"),
            ("incompatible reservation (on the operation)", "operation_errors", "reservation_incompatible",
             "reservation incompatible (CONDITION_NOT_MET: No available resources in specified reservations "
             "'local-reservation')"),
            ("unsupported TPU configuration (on the operation)", "operation_errors", "unsupported_tpu_configuration",
             "unsupported TPU configuration (CONDITION_NOT_MET: Unsupported TPU configuration)"),
        )
    ),
    Fault(
        "5xx, then success",
        cloud={"http_errors": [{"method": "POST", "path_regex": "/instances$", "status": 503, "count": 1}]},
        outcome="success",
    ),
    Fault("SSH refused, then up", cloud={"ssh_refused": {"seconds": 8}}, outcome="success"),
    Fault("SSH banner hangs, then up", cloud={"ssh_banner_timeout": {"seconds": 8}}, outcome="success"),
    Fault(
        "host keys change during the first boot (the guest agent's new keys served before they are published)",
        cloud={"first_boot_host_keys": {"seconds": 3, "publish_after": 1}},
        outcome="success",
        log="SSH host keys pinned",
    ),
    Fault(
        "VM's sshd shows a host key other than the one it published",
        cloud={"host_key_mismatch": {}},
        failed_task="wait_for_ssh",
        cause="not the ssh-ed25519 key the VM published in its guest attributes",
    ),
    Fault(
        "create fails after acceptance, every time (a stockout leaving a TERMINATED instance)",
        cloud={"insert_fails_after_accept": {"code": "ZONE_RESOURCE_POOL_EXHAUSTED", "leave_instance": True}},
        failed_task="create_vm",
        cause="ZONE_RESOURCE_POOL_EXHAUSTED",
        tries=3,  # retried with backoff, each retry deleting the instance the last one left
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
        "training dies in native code (SIGSEGV)",
        maxtext={"train_sft": {"segfault_at_step": 4}},
        failed_task="wait_for_final_checkpoint",
        # The signal is named, and the fault handler's stack of the crashed step is in the log.
        cause="training exited with code 139 (killed by SIGSEGV) after step 3",
        log="Fatal Python error: Segmentation fault",
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
        "VM deleted mid-training: recreated, resumes from the last checkpoint",
        maxtext=HELD_AT_STEP_5,
        preempt_after="completed step: 4,",
        durable=True,
        outcome="success",
    ),
    Fault(
        # A recovery counts once its insert made the VM: the stockout's operation made none.
        "VM deleted mid-training, its recreation fails once: the sensor's retry recovers, counted once",
        maxtext=HELD_AT_STEP_5,
        preempt_after="completed step: 4,",
        cloud_after_preempt={"insert_fails_after_accept": {"code": "ZONE_RESOURCE_POOL_EXHAUSTED", "count": 1}},
        durable=True,
        outcome="success",
    ),
    Fault(
        # Another run took the freed machine: the recreation waits at the capacity gate.
        "VM deleted mid-training, its recreation refused for capacity once: waits, then resumes, counted once",
        maxtext=HELD_AT_STEP_5,
        preempt_after="completed step: 4,",
        cloud_after_preempt={"operation_errors": {"operation": "insert", "preset": "reservation_full", "count": 1}},
        durable=True,
        outcome="success",
    ),
    Fault(
        "VM deleted mid-training, checkpoints only on the VM",
        maxtext=HELD_AT_STEP_5,
        preempt_after="completed step: 4,",
        failed_task="wait_for_final_checkpoint",
        cause="lived only on that VM (no output_location)",
    ),
    Fault(
        "VM deleted mid-training more often than max_vm_recoveries",
        conf={"max_vm_recoveries": 1},
        maxtext=HELD_AT_STEP_5,
        preempt_after="completed step: 4,",
        preemptions=2,
        durable=True,
        failed_task="wait_for_final_checkpoint",
        cause="already recreated its VM 1 time(s) (max_vm_recoveries=1)",
    ),
    # Capacity without a reservation (issue 31).
    # (A Spot run preempted twice that succeeds, and a flex-start request that waits in the queue
    # and then trains: through the real scheduler, test_pipeline_capacity.py.)
    Fault(
        "Spot VM preempted more often than max_preemptions",
        conf={**SPOT_CONF, "max_preemptions": 1},
        maxtext=HELD_AT_STEP_5,
        preempt_after="completed step: 4,",
        preemptions=2,
        spot_preemption=True,
        durable=True,
        failed_task="wait_for_final_checkpoint",
        cause="already been preempted 1 time(s) (max_preemptions=1)",
    ),
    Fault(
        "Spot stockout twice (on the operation): waited out deferred, then created",
        conf=SPOT_CONF,
        cloud={"insert_fails_after_accept": {"preset": "zone_resource_pool_exhausted", "count": 2}},
        durable=True,
        outcome="success",
        log="Asking for the VM again after the zone's stockout",
        tries=1,
    ),
    Fault(
        "Spot stockout past max_capacity_wait_minutes: fails naming the zone",
        conf={**SPOT_CONF, "max_capacity_wait_minutes": 0},
        cloud={"insert_fails_after_accept": {"preset": "zone_resource_pool_exhausted"}},
        durable=True,
        failed_task="create_vm",
        cause="had no machine for it",
    ),
    Fault(
        "flex-start request expires without a machine: fails naming the expiry, nothing left",
        conf=FLEX_START_CONF,
        cloud={"flex_start_wait": {"seconds": 6, "expires": True}},
        failed_task="create_vm",
        cause="expired after",
    ),
    Fault(
        "VM unreachable mid-training (sshd frozen): lost after the bound, replaced, resumes",
        conf=UNREACHABLE_CONF,
        maxtext=HELD_AT_STEP_5,
        freeze_sshd_after="completed step: 4,",
        durable=True,
        outcome="success",
    ),
    Fault(
        "VM unreachable mid-training, checkpoints only on the VM",
        conf=UNREACHABLE_CONF,
        maxtext=HELD_AT_STEP_5,
        freeze_sshd_after="completed step: 4,",
        failed_task="wait_for_final_checkpoint",
        cause="has answered no SSH for",
    ),
    Fault(
        # The fast image ships MaxText 0.2.2 only; installing another version needs the network
        # and root, which a local VM has neither of.
        "install fails",
        conf={"maxtext_version": "0.2.1"},
        failed_task="install_maxtext",
        cause="install_maxtext.sh exited with status",
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
    # The thread that plays the cloud's part ends with this test, whatever happens: left running,
    # it would preempt or freeze the next test's VM (it knows VMs by their training log alone).
    test_over = threading.Event()
    saboteur = None
    if fault.preempt_after:
        saboteur = threading.Thread(
            target=preempt_when_logged,
            args=(local_cloud, fault.preempt_after, fault.preemptions, fault.cloud_after_preempt, test_over,
                  fault.spot_preemption),
            daemon=True,
        )
    elif fault.freeze_sshd_after:
        saboteur = threading.Thread(
            target=freeze_sshd_when_logged, args=(local_cloud, fault.freeze_sshd_after, test_over), daemon=True
        )
    conf = {"steps": 12, **(DURABLE_CONF if fault.durable else {}), **fault.conf}
    if fault.durable:
        local_cloud.create_bucket("fault-matrix", exist_ok=True)
    try:
        if saboteur:
            saboteur.start()
        run = run_pipeline(conf, maxtext_faults=fault.maxtext, cloud_faults=fault.cloud)
        if saboteur:
            saboteur.join(timeout=5)
            assert not saboteur.is_alive(), "the VM was not preempted (or frozen and replaced) as the case says"
    finally:
        test_over.set()
        if saboteur:
            saboteur.join(timeout=30)
    leaked = local_cloud.vms()
    fault_tally.vms_left(leaked)
    assert leaked == []
    assert run.state == fault.outcome, run.report()
    if fault.tries is not None:
        assert run.try_numbers["create_vm"] == fault.tries, run.try_numbers
    if (fault.preempt_after or fault.freeze_sshd_after) and fault.outcome == "success":
        assert_resumed_after_last_checkpoint(
            run, local_cloud, checkpoint=3, steps=conf["steps"], recoveries=fault.recoveries
        )
    if fault.outcome == "failed":
        error = run.log[run.log.rindex("The fine-tune did not complete") :]
        fault_tally.failed_run(error, fault.cause)
        assert run.task_states[fault.failed_task] == "failed", run.report()
        assert run.task_states["delete_vm"] in ("success", "skipped"), run.report()
        assert fault.cause in error, error[:3000]
        assert fault.log in run.log, run.log[-3000:]


def assert_resumed_after_last_checkpoint(run, cloud, *, checkpoint: int, steps: int, recoveries: int) -> None:
    """A VM made per recovery (an insert whose operation made none is no recovery), MaxText
    restored `checkpoint`, and trained only the steps after it."""
    vm_name = run.xcoms["plan_run.spec"]["vm_name"]
    made = [
        op for op in compute_operations(cloud)
        if op.get("operationType") == "insert" and op.get("targetLink", "").endswith(f"/instances/{vm_name}")
        and op.get("status") == "DONE" and "error" not in op
    ]
    assert len(made) == 1 + recoveries, made
    restored = run.log.index(f"Restored params from step: {checkpoint} ")
    trained_after = {int(step) for step in re.findall(r"completed step: (\d+),", run.log[restored:])}
    assert trained_after == set(range(checkpoint + 1, steps + 1))
    assert run.xcoms["wait_for_final_checkpoint.return_value"]["final_step"] == steps
    assert run.xcoms["wait_for_final_checkpoint.return_value"]["vm_recoveries"] == recoveries
    assert run.xcoms["collect_outputs.return_value"]["vm_recoveries"] == recoveries
    # The run summary lists each: resumed after the checkpoint of step 3; the VM held at step 5 had
    # trained 4 steps, so a poke saw at most one step lost (none, when the cloud was quicker than
    # the first poke: then the summary says "unknown").
    rows = run.xcoms["summarize_run.return_value"]["recoveries"]
    assert [row["recovery"] for row in rows] == list(range(1, recoveries + 1)), rows
    assert all(row["resumes_after_step"] == checkpoint and row["steps_lost"] in (None, 0, 1) for row in rows), rows
    assert all(row["vm_minutes_to_resume"] > 0 and set(row["step_seconds"]) == {
        "wait_for_ssh", "autostop", "install", "convert", "start_training"} for row in rows), rows


def training_logged(cloud, vm: dict, text: str) -> bool:
    homes = cloud.state_dir / "vms" / vm["name"] / "home"
    return any(text in log.read_text(errors="replace") for log in homes.glob("*/maxtext-sft-runs/*/train.log"))


def freeze_sshd_when_logged(cloud, text: str, test_over: threading.Event, timeout: float = 300) -> None:
    """Freeze the sshd of the VM whose training log shows `text` (the VM runs on, unreachable);
    once the run has deleted that VM, lift the MaxText faults so the resumed training finishes
    (lifted earlier, the frozen VM's own training would go on to its end)."""
    deadline = time.monotonic() + timeout
    frozen = None
    while frozen is None and time.monotonic() < deadline and not test_over.is_set():
        frozen = next((vm for vm in cloud.vms() if training_logged(cloud, vm, text)), None)
        test_over.wait(0.2)  # polling interval; the VM's files are re-read each time
    if frozen is None:
        return
    cloud.set_sshd_paused(frozen["name"], True)
    while time.monotonic() < deadline and not test_over.is_set():
        if not any(vm["name"] == frozen["name"] and vm["pid"] == frozen["pid"] for vm in cloud.vms()):
            cloud.set_vm_file("maxtext-faults.json", "{}")
            return
        test_over.wait(0.2)  # polling interval; the VMs are listed again each time


def preempt_when_logged(
    cloud, text: str, times: int, cloud_faults: dict | None, test_over: threading.Event, spot: bool = False,
    timeout: float = 300,
) -> None:
    """Delete the run's VM the way the cloud does once its training log shows `text`, `times`
    times (each recreated VM anew), with `cloud_faults` set just before the last deletion (the
    recovery may insert as soon as the VM is gone); then lift the MaxText faults, so a resumed
    training finishes. `spot`: preempt it instead (a second of soft off, then deleted)."""
    deadline = time.monotonic() + timeout
    while times and time.monotonic() < deadline and not test_over.is_set():
        for vm in cloud.vms():
            if not vm.get("preempted") and training_logged(cloud, vm, text):
                if times == 1 and cloud_faults:
                    cloud.set_faults(cloud_faults)
                if spot:
                    cloud.preempt_vm(vm["name"], soft_off_seconds=1)
                else:
                    cloud.terminate_vm(vm["name"], "DELETE")
                times -= 1
                break
        test_over.wait(0.2)  # polling interval; the VM's files are re-read each time
    if not times:
        cloud.set_vm_file("maxtext-faults.json", "{}")

