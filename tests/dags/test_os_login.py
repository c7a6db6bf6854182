"""A project with OS Login enforced ignores the ssh-keys metadata: wait_for_ssh fails at once,
naming OS Login and the os_login Param, instead of waiting ten minutes as if the VM were booting."""

from __future__ import annotations

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
