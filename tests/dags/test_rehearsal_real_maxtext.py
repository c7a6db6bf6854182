"""The rehearsal DAG end to end on the real MaxText 0.2.2 (the local cloud serves the rehearsal's
public Ubuntu family with the real image): its kit is made on the VM, MaxText converts, trains
and exports at toy size, every check passes; and its insert request is the real run's (refused by
the cloud once logged) but for the fields the switch changes."""

from __future__ import annotations

import pytest

from localcloud.connections import LOCAL_REHEARSAL_CONF, REHEARSAL_IMAGE_KEY
from localcloud.images import build_fast_image, build_real_image
from maxtext_sft.results.rehearsal import CHECKS, PASSED
from tests.dags.conftest import REAL_MAXTEXT_DAG_TEST_CONF, REAL_MAXTEXT_TIMEOUT, REAL_RUN_FIRST_BOOT
from tests.plugins.test_rehearsal import differences

pytestmark = [pytest.mark.e2e, pytest.mark.real_maxtext, pytest.mark.timeout(REAL_MAXTEXT_TIMEOUT)]

# The insert body's fields (REST names) in which a rehearsal differs from the real run
# (compute_body.REHEARSAL_FIELDS, as the client library sends them)...
SWITCHED = {"machineType", "disks[0].initializeParams.sourceImage", "reservationAffinity",
            "scheduling.provisioningModel"}
# ...and those that name the DAG run, which differ between any two runs.
RUN_IDENTITY = {"name", "labels", "metadata.items[2].value", "metadata.items[3].value"}


@pytest.fixture(scope="module")
def rehearsal_image(local_cloud):
    local_cloud.add_image(REHEARSAL_IMAGE_KEY, build_real_image())
    yield
    local_cloud.add_image(REHEARSAL_IMAGE_KEY, build_fast_image())


def inserted_body(local_cloud) -> dict:
    [insert] = [r for r in local_cloud.requests()
                if r["method"] == "POST" and r["path"].split("?")[0].endswith("/instances")]
    return insert["body"]


def test_the_rehearsal_runs_maxtext_at_toy_size_and_passes_every_check(
    rehearsal_image, run_pipeline, local_cloud, first_boot
):
    # Without MaxText's held-out evaluation (measured: two passes over the split, 65 s of the
    # training's 236 s here): the pipeline's real run evaluates with the same MaxText arguments
    # (test_pipeline_real_maxtext.py), and the kit's eval split is checked in test_rehearsal_kit.py.
    conf = {**LOCAL_REHEARSAL_CONF, "hub_repo_id": "local-team/gemma3-rehearsal", "eval_split": None}
    watch = first_boot(*REAL_RUN_FIRST_BOOT)  # its VM boots as a fresh Ubuntu image does
    run = run_pipeline({**conf, **REAL_MAXTEXT_DAG_TEST_CONF}, dag_id="maxtext_sft_rehearsal")
    assert run.state == "success", run.report()
    # The first boot was still in force when the install step ended (the image has MaxText: it
    # skipped before apt), and the run went through it.
    assert len(watch.in_force_after(run.end_dates["install_maxtext"])) == 1, watch.samples[:5]
    assert local_cloud.vms() == []
    summary = run.xcoms["summarize_run.return_value"]
    checks = {row["check"]: row for row in summary["rehearsal_checks"]}
    assert [name for name in checks] == [check.name for check in CHECKS]
    assert {name: row["result"] for name, row in checks.items()} == dict.fromkeys(checks, PASSED), checks
    # Its cost, at the cheap machine's price, from the VM's recorded lifetime (a wall-clock bound
    # failed on a loaded machine: 0.05 after 11 minutes): cents.
    vm = summary["vm"]
    assert vm["hourly_price_usd"] == 0.27, vm
    assert vm["estimated_cost_usd"] == round(vm["lifetime_seconds"] / 3600 * 0.27, 2) < 0.5, vm
    assert "Rehearsal checks:" in run.log and "estimated cost $0.0" in run.log
    # MaxText ran on the kit: the toy made on the VM, the training on its dataset.
    assert "Made the rehearsal kit" in run.log
    assert run.xcoms["wait_for_final_checkpoint.return_value"]["final_step"] == 3
    assert "hf_path=rehearsal-kit/datasets/ultrachat_200k" in run.log
    assert run.xcoms["publish_to_hub.return_value"]["branch"] == "rehearsal"  # never the repo's main
    rehearsal_body = inserted_body(local_cloud)

    # The real run with the same conf: only its insert is compared, so the cloud refuses it once
    # logged (a quota, synchronously: no instance) and the run ends there, with nothing to delete.
    real = run_pipeline({**conf, "steps": 5}, cloud_faults={"insert_rejected": {"preset": "quota_exceeded"}})
    assert real.state == "failed" and real.task_states["create_vm"] == "failed", real.report()
    assert local_cloud.vms() == []
    real_body = inserted_body(local_cloud)
    found = set(differences(real_body, rehearsal_body))
    switched = {d for d in found if any(d == f or d.startswith(f + ".") for f in SWITCHED)}
    identity = {d for d in found if any(d == f or d.startswith(f + ".") for f in RUN_IDENTITY)}
    assert found == switched | identity, found - switched - identity
    assert {f for f in SWITCHED if any(d == f or d.startswith(f + ".") for d in switched)} == SWITCHED
    assert rehearsal_body["scheduling"]["provisioningModel"] == "STANDARD"
    assert rehearsal_body["reservationAffinity"] == {"consumeReservationType": "NO_RESERVATION"}
    assert rehearsal_body["machineType"].endswith("/machineTypes/e2-standard-8")
