"""The rehearsal DAG (maxtext_sft_rehearsal) against the failure classes it exists to catch, each
injected in the local cloud as the real cloud shows it: the run fails early, before any TPU VM,
its error names what to fix, its summary's checks say which passed, and no VM is left."""

from __future__ import annotations

import dataclasses
import json

import pytest

from localcloud.connections import LOCAL_BUCKET, LOCAL_HUB_MODEL, LOCAL_OUTPUTS_CONF, LOCAL_PROJECT, new_hf_token
from maxtext_sft.results.rehearsal import FAILED, NOT_RUN, PASSED
from tests.dags import fault_tally

pytestmark = [pytest.mark.e2e, pytest.mark.spread]
DAG_ID = "maxtext_sft_rehearsal"


@dataclasses.dataclass(frozen=True)
class Refusal:
    name: str
    failed_task: str
    cause: str  # what the run's error must say
    check: str  # the rehearsal check that fails
    conf: dict = dataclasses.field(default_factory=dict)
    cloud: dict | None = None


REFUSALS = [
    Refusal("missing permission (the API's 403 on insert)", "create_vm",
            "Required 'compute.instances.create' permission for", "compute insert",
            cloud={"insert_rejected": {"preset": "permission_denied"}}),
    Refusal("OS Login enforced on the project", "wait_for_ssh",
            "OS Login is enabled for VM", "ssh"),
    Refusal("firewall: the SSH port refuses connections", "wait_for_ssh",
            "allowing tcp:22 from the workers' addresses to the network tag maxtext-sft", "ssh",
            conf={"ssh_ready_timeout_seconds": 15}, cloud={"ssh_refused": {"seconds": 3600}}),
    Refusal("bucket not writable by the VM's service account", "check_vm_access",
            "does not have storage.objects.create access", "bucket from the VM"),
    Refusal("shared reservation not shared with the run's project", "preflight",
            f"reservation rehearsal-private in rehearsal-owner/us-east5-b is not shared with project {LOCAL_PROJECT}",
            "token and inputs (worker)", conf={"reservation": "projects/rehearsal-owner/reservations/rehearsal-private"}),
    Refusal("gated model refused to the token", "preflight",
            f"has no access to the gated model {LOCAL_HUB_MODEL}", "token and inputs (worker)"),
]


def test_a_rehearsal_announces_no_model_and_publishes_on_a_branch_of_its_own():
    from maxtext_sft.results.lineage import TUNED_MODEL
    from tests.dags.conftest import parse_pipeline_dag

    rehearsal, real = parse_pipeline_dag(DAG_ID), parse_pipeline_dag("maxtext_sft")
    # Its toy is no tuned model: the DAGs scheduled on the Asset (evaluations, deployments) must not start.
    assert rehearsal.get_task("collect_outputs").outlets == []
    assert real.get_task("collect_outputs").outlets == [TUNED_MODEL]
    assert rehearsal.params["hub_branch"] == "rehearsal" and real.params["hub_branch"] == "main"
    assert {t.task_id for t in rehearsal.tasks} - {t.task_id for t in real.tasks} == {
        "check_vm_access", "prepare_rehearsal"}


@pytest.fixture
def refusal_injected(request, local_cloud, pipeline_connections, monkeypatch):
    refusal: Refusal = request.param
    if refusal.name.startswith("OS Login"):
        # What `gcloud compute project-info add-metadata --metadata enable-oslogin=TRUE` does.
        local_cloud.set_project_metadata(LOCAL_PROJECT, {"enable-oslogin": "TRUE"})
    if refusal.name.startswith("bucket"):
        local_cloud.deny_vm_writes(LOCAL_BUCKET)
    if refusal.name.startswith("shared reservation"):
        # Another project's reservation, shared with no other project.
        local_cloud.add_reservation("rehearsal-private", 1, zone="us-east5-b", project="rehearsal-owner")
    if refusal.name.startswith("gated"):
        # A token of an account whose access request to the gated model was never accepted.
        token = new_hf_token()
        local_cloud.hub.add_user("no-licence", token, role="write")
        hub = json.loads(pipeline_connections["AIRFLOW_CONN_HUGGINGFACE_DEFAULT"])
        monkeypatch.setenv("AIRFLOW_CONN_HUGGINGFACE_DEFAULT", json.dumps({**hub, "password": token}))
    yield refusal
    if refusal.name.startswith("OS Login"):
        local_cloud.set_project_metadata(LOCAL_PROJECT, {"enable-oslogin": None})
    if refusal.name.startswith("bucket"):
        local_cloud.allow_vm_writes()


@pytest.mark.parametrize("refusal_injected", REFUSALS, ids=[r.name for r in REFUSALS], indirect=True)
def test_the_rehearsal_names_what_a_real_run_would_be_refused(refusal_injected, run_pipeline, local_cloud):
    refusal = refusal_injected
    fault_tally.fault_injected()
    run = run_pipeline({**LOCAL_OUTPUTS_CONF, **refusal.conf}, cloud_faults=refusal.cloud, dag_id=DAG_ID)
    leaked = local_cloud.vms()
    fault_tally.vms_left(leaked)
    assert leaked == []
    assert run.state == "failed"
    assert run.task_states[refusal.failed_task] == "failed", run.report()
    # (A run refused before its VM lease never reaches the delete.)
    assert run.task_states["delete_vm"] in ("success", "skipped", "upstream_failed"), run.report()
    assert run.task_states["create_vm"] != "success" or run.task_states["delete_vm"] == "success", run.report()
    # The run's error is check_run_outcome's, also when preflight stopped it before the VM lease.
    assert run.task_states["check_run_outcome"] == "failed", run.report()
    error = run.log[run.log.rindex("The fine-tune did not complete") :]
    fault_tally.failed_run(error, refusal.cause)
    assert refusal.cause in error, error[:3000]
    # The summary's checks: the failed one with the cause, those before it passed, none after ran.
    checks = {row["check"]: row for row in run.xcoms["summarize_run.return_value"]["rehearsal_checks"]}
    assert checks[refusal.check]["result"] == FAILED and refusal.cause in checks[refusal.check]["detail"], checks
    names = list(checks)
    assert all(checks[name]["result"] == PASSED for name in names[: names.index(refusal.check)]), checks
    assert checks["maxtext at toy size"]["result"] == NOT_RUN
    assert checks["delete"]["result"] in (PASSED, NOT_RUN)
    assert "Rehearsal checks:" in run.log
