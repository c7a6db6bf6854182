"""OS Login and the pipeline. A project with OS Login enforced ignores the ssh-keys metadata:
wait_for_ssh fails at once, naming OS Login and the os_login Param, instead of waiting ten minutes
as if the VM were booting. With the Param os_login, a training that outlasts the imported key's
lifetime passes: the training trigger renews the key before it lapses."""

from __future__ import annotations

from datetime import datetime

import pytest

from localcloud.connections import LOCAL_PROJECT
from tests.dags import fault_tally

pytestmark = pytest.mark.e2e


@pytest.fixture
def os_login_enforced(local_cloud, pipeline_connections):
    # What `gcloud compute project-info add-metadata --metadata enable-oslogin=TRUE` does.
    local_cloud.set_project_metadata(LOCAL_PROJECT, {"enable-oslogin": "TRUE"})
    yield
    local_cloud.set_project_metadata(LOCAL_PROJECT, {"enable-oslogin": None})


def test_os_login_enforced_by_the_project_fails_wait_for_ssh_at_once(os_login_enforced, run_pipeline, local_cloud):
    fault_tally.fault_injected()
    run = run_pipeline()
    leaked = local_cloud.vms()
    fault_tally.vms_left(leaked)
    assert leaked == []
    assert run.state == "failed"
    assert run.task_states["create_vm"] == "success", run.report()
    assert run.task_states["wait_for_ssh"] == "failed", run.report()
    assert run.task_states["delete_vm"] == "success", run.report()
    assert run.try_numbers["wait_for_ssh"] == 1  # no retry: a retry would be refused too
    error = run.log[run.log.rindex("refused the SSH login") :][:2000]
    fault_tally.failed_run(error, "OS Login is enabled")
    assert "OS Login is enabled for VM" in error and "Param os_login" in error, error
    assert "does not answer SSH yet" not in run.log  # never taken for a VM still booting


# The OS Login key's lifetime for the run below (the Param's minimum), and a training that outlasts
# it twice over: the stand-in's steps slowed to 2 s (30 steps, about a minute).
SHORT_KEY_LIFETIME = 20
SLOW_STEPS = {"seconds_per_step": 2.0}


def test_a_training_longer_than_the_os_login_key_lifetime_passes_with_the_key_renewed(run_pipeline, local_cloud):
    """With os_login, a VM that takes only unexpired OS Login keys, a key lifetime of 20 s and a
    training of a minute: the run succeeds because the training trigger renews the key before it
    lapses (from the triggerer: its client says so in the OS Login API's log)."""
    local_cloud.clear_oslogin_requests()
    run = run_pipeline({"os_login": True, "os_login_key_lifetime_seconds": SHORT_KEY_LIFETIME, "steps": 30},
                       maxtext_faults=SLOW_STEPS)
    assert run.state == "success", run.report()
    assert local_cloud.vms() == []
    imports = [r for r in local_cloud.oslogin_requests() if r["path"].endswith(":importSshPublicKey")]
    assert imports and all(r["status"] == 200 for r in imports), imports
    callers = [r["api_client"].split()[0] for r in imports]
    assert "maxtext-sft-worker" in callers and "maxtext-sft-triggerer" in callers, callers
    # The training watch renewed the key every half lifetime or so, never letting it lapse: the
    # triggerer's imports are less than a lifetime apart, and span more than one.
    assert "OS Login key of sa_" in run.log and "renewed until" in run.log
    renewals = [datetime.fromisoformat(r["time"].replace("Z", "+00:00")).timestamp()
                for r in imports if r["api_client"].startswith("maxtext-sft-triggerer")]
    assert len(renewals) >= 2, imports
    assert all(later - earlier < SHORT_KEY_LIFETIME for earlier, later in zip(renewals, renewals[1:])), renewals
    assert renewals[-1] - renewals[0] >= SHORT_KEY_LIFETIME / 2
