"""The published role (include/iam/airflow-role.yaml) is what the DAGs need, no less: every test's
local cloud binds the Google connection's account to exactly that role (localcloud/connections.py
prepare_local_cloud; the Compute and Storage emulators check each call, localcloud/compute/iam.py
and localcloud/storage/iam.py), so the suite runs every DAG under it. Taken one permission away,
a run fails naming it, and leaves no VM."""

from __future__ import annotations

import pytest

from localcloud.connections import LOCAL_SERVICE_ACCOUNT, airflow_role_permissions
from tests.dags import fault_tally

pytestmark = pytest.mark.e2e
MEMBER = f"serviceAccount:{LOCAL_SERVICE_ACCOUNT}"


@pytest.mark.parametrize("removed", ["compute.reservations.get", "compute.instances.getGuestAttributes"])
def test_a_role_without_one_of_its_permissions_fails_the_run_naming_it(removed, run_pipeline, local_cloud):
    role = airflow_role_permissions()
    assert removed in role
    fault_tally.fault_injected()
    local_cloud.bind_role(MEMBER, [permission for permission in role if permission != removed])
    try:
        run = run_pipeline()
    finally:
        local_cloud.bind_role(MEMBER, role)
    leaked = local_cloud.vms()
    fault_tally.vms_left(leaked)
    assert leaked == []
    assert run.state == "failed", run.report()
    refused = [r for r in local_cloud.requests() if r["status"] == 403]
    assert refused, "no call was refused"
    fault_tally.failed_run(run.log, removed)
    assert removed in run.log
