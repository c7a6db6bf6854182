"""The emulator's switch that refuses a time limit with a provisioning model (Faults
`max_run_duration_refused`), driven by the real gcloud: the tutorial's reservation-bound create with
--max-run-duration is refused in the shape a public capture shows (error_catalog.RUN_DURATION_NOT_SUPPORTED);
the tutorial's own create, without it, passes."""

from __future__ import annotations

import pytest

from localcloud.cloud import LocalCloudError
from tests.localcloud.test_compute_capacity import PROJECT, ZONE, gcloud  # noqa: F401 - gcloud: the fixture
from tests.localcloud.test_compute_emulator import gcloud_create

TUTORIAL = (
    "--machine-type=ct6e-standard-8t --maintenance-policy=TERMINATE --instance-termination-action=DELETE "
    "--provisioning-model=RESERVATION_BOUND --reservation-affinity=specific --reservation=lc-rd-resv"
)


def test_gcloud_reservation_bound_time_limit_refused_on_switch_the_tutorials_create_passes(compute_cloud, gcloud):
    compute_cloud.add_reservation("lc-rd-resv", 1, zone=ZONE, project=PROJECT)
    try:
        assert compute_cloud.set_faults({"max_run_duration_refused": {}}) == {"max_run_duration_refused": {}}
        compute_cloud.clear_requests()
        out = gcloud(gcloud_create("lc-rd-0", f"{TUTORIAL} --max-run-duration=2h"), fails=True).stderr
        assert (
            "Invalid value for field 'resource.scheduling.maxRunDuration': '{ \"seconds\": \"7200\"}'. "
            "max-run-duration for given provisioning model is not supported"
        ) in " ".join(out.split()), out
        [insert] = [r for r in compute_cloud.requests() if r["method"] == "POST" and r["path"].split("?")[0].endswith("/instances")]
        assert insert["status"] == 400 and insert["body"]["scheduling"]["maxRunDuration"] == {"seconds": "7200"}
        # The switch stays on (an API rule, not a passing fault); the tutorial's create has no time limit.
        assert compute_cloud.get_faults() == {"max_run_duration_refused": {}}
        gcloud(gcloud_create("lc-rd-0", TUTORIAL))
        assert [v["name"] for v in compute_cloud.vms() if v["name"] == "lc-rd-0"] == ["lc-rd-0"]
    finally:
        compute_cloud.set_faults({})
        gcloud(f"gcloud compute instances delete lc-rd-0 --zone={ZONE} --project={PROJECT} --quiet")
    assert not [v for v in compute_cloud.vms() if v["name"] == "lc-rd-0"]


def test_the_switch_is_validated(compute_cloud):
    for bad in ({"provisioning_models": []}, {"provisioning_models": ["PREEMPTIBLE"]}, {"seconds": 1}):
        with pytest.raises(LocalCloudError):
            compute_cloud.set_faults({"max_run_duration_refused": bad})
    assert compute_cloud.set_faults({"max_run_duration_refused": {"provisioning_models": ["SPOT"], "count": 2}}) == {
        "max_run_duration_refused": {"provisioning_models": ["SPOT"], "count": 2}
    }
    compute_cloud.set_faults({})
