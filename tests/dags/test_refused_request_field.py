"""The pipeline does not depend on a request field without a public source: with the local cloud
refusing the cloud-enforced lifetime on a reservation-bound VM (Faults `max_run_duration_refused`),
the default run (reservation, cloud_enforced_lifetime on) succeeds on a VM made without it, its
summary names the backstops left, and nothing is left."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e


def test_the_run_succeeds_without_the_refused_lifetime_and_says_which_backstops_hold(run_pipeline, local_cloud):
    run = run_pipeline(cloud_faults={"max_run_duration_refused": {}})
    assert run.state == "success", run.report()
    assert local_cloud.vms() == []
    inserts = [
        r for r in local_cloud.requests() if r["method"] == "POST" and r["path"].split("?")[0].endswith("/instances")
    ]
    assert [(r["status"], "maxRunDuration" in r["body"]["scheduling"]) for r in inserts] == [(400, True), (200, False)]
    assert inserts[1]["body"]["scheduling"]["instanceTerminationAction"] == "DELETE"
    assert inserts[1]["body"]["scheduling"]["provisioningModel"] == "RESERVATION_BOUND"
    assert run.xcoms["create_vm.refused_fields"] == ["scheduling.maxRunDuration"]
    assert "max_run_duration" not in run.xcoms["create_vm.return_value"]["scheduling"]
    assert "Compute Engine refused scheduling.maxRunDuration with provisioning model RESERVATION_BOUND" in run.log
    found = run.xcoms["summarize_run.return_value"]["backstops"]
    assert not found["cloud_lifetime"]["in_force"] and "refused" in found["cloud_lifetime"]["why_not"]
    assert found["autostop"]["in_force"] and found["janitor"]["in_force"]
    assert "Backstops if the teardown never runs: no cloud-enforced lifetime (Compute Engine refused" in run.log
