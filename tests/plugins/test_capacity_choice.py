"""The `capacity` Param: which checks a run passes before anything is paid for, and the insert
body each capacity type sends (the gcloud-equality of those bodies is tested against gcloud
528's capture in tests/localcloud)."""

from __future__ import annotations

import json

import pytest

from maxtext_sft.run.maxtext_args import MAX_DERIVED_SPOT_CHECKPOINT_PERIOD
from maxtext_sft.run.params import CAPACITIES, SpecError
from maxtext_sft.run.spec import FLEX_START_MAX_RUN_MINUTES, build_run_spec
from tests.conftest import REPO
from tests.plugins.test_spec import RUN_ID, STARTED, make_spec

IDENTITY = dict(
    dag_id="maxtext_sft", run_id=RUN_ID, generation=0, started=STARTED, default_project_id="my-project",
    ssh_user="maxtext", ssh_public_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample",
)

BUCKET = "gs://team-bucket/sft"
# What each capacity type needs besides itself to pass plan_run's checks.
NEEDS = {
    "reservation": {"reservation": "my-reservation"},
    "flex-start": {"reservation": None},
    "spot": {"reservation": None, "output_location": BUCKET},
    "on-demand": {"reservation": None},
}


def spec_for(capacity: str, **more):
    return make_spec(capacity=capacity, **{**NEEDS[capacity], **more})


def test_the_tutorials_reservation_is_the_default_and_the_reservation_is_needed_only_for_it():
    assert make_spec().capacity == "reservation"
    with pytest.raises(SpecError, match="'reservation': required with TPU capacity 'reservation'") as refused:
        make_spec(reservation=None)
    assert refused.value.param == "reservation"
    for capacity in ("flex-start", "spot", "on-demand"):
        spec = spec_for(capacity)
        assert spec.reservation is None and spec.consumed_reservation is None  # no capacity gate
        with pytest.raises(SpecError, match=f"only TPU capacity 'reservation' runs on one; leave it empty for '{capacity}'"):
            spec_for(capacity, reservation="my-reservation")


def test_an_unknown_capacity_is_refused_naming_the_known_ones():
    with pytest.raises(SpecError, match="'capacity': 'spott' is not a capacity type; did you mean 'spot'"):
        make_spec(capacity="spott")


def test_spot_without_an_output_location_is_refused_nothing_could_resume():
    with pytest.raises(SpecError, match="'output_location': a Spot VM can be preempted") as refused:
        spec_for("spot", output_location=None)
    assert refused.value.param == "output_location"


def test_flex_start_refuses_a_lifetime_over_seven_days():
    assert spec_for("flex-start", max_run_duration_minutes=FLEX_START_MAX_RUN_MINUTES).max_run_duration_minutes == 10080
    with pytest.raises(SpecError, match="a flex-start VM runs 10 minutes to 7 days"):
        spec_for("flex-start", max_run_duration_minutes=FLEX_START_MAX_RUN_MINUTES + 1)
    with pytest.raises(SpecError, match="a flex-start VM runs 10 minutes to 7 days"):
        spec_for("flex-start", max_run_duration_minutes=9)
    # The default lifetime is added up from the step limits: a long training limit exceeds it too.
    with pytest.raises(SpecError, match="change the step time limits"):
        spec_for("flex-start", training_timeout_hours=24 * 7)


def test_a_slice_runs_only_on_a_reservation():
    conf = {"capacity": "spot", "reservation": None, "output_location": BUCKET, "tpu_slice": "v6e-16",
            "machine_type": "ct6e-standard-4t"}
    with pytest.raises(SpecError, match="'capacity': a v6e-16 slice runs only on a reservation here, not 'spot'"):
        build_run_spec(conf, **IDENTITY, tpu_slice=True)


@pytest.mark.parametrize("steps, period", [(1000, MAX_DERIVED_SPOT_CHECKPOINT_PERIOD), (20_000, 100), (10, 1), (500, 50)])
def test_a_spot_run_checkpoints_at_most_every_hundred_steps(steps, period):
    assert spec_for("spot", steps=steps).checkpoint_period == period
    assert spec_for("on-demand", steps=steps, output_location=BUCKET).checkpoint_period == min(-(-steps // 10), 1000)


def test_the_reservation_body_is_unchanged():
    body = make_spec().instance_body()
    assert body["reservation_affinity"] == {
        "consume_reservation_type": "SPECIFIC_RESERVATION",
        "key": "compute.googleapis.com/reservation-name",
        "values": ["my-reservation"],
    }
    assert body["scheduling"] == {
        "automatic_restart": True,
        "instance_termination_action": "DELETE",
        "on_host_maintenance": "TERMINATE",
        "provisioning_model": "RESERVATION_BOUND",
        "max_run_duration": {"seconds": make_spec().max_run_duration_minutes * 60},
    }
    assert "params" not in body


@pytest.mark.parametrize("capacity", CAPACITIES[1:])
def test_no_other_capacity_touches_a_reservation_and_every_one_terminates_on_maintenance(capacity):
    body = spec_for(capacity).instance_body()
    assert body["reservation_affinity"] == {"consume_reservation_type": "NO_RESERVATION"}
    assert body["scheduling"]["on_host_maintenance"] == "TERMINATE"  # a TPU VM cannot live-migrate


def test_flex_start_asks_for_a_run_duration_and_a_request_validity():
    spec = spec_for("flex-start", flex_start_valid_minutes=45, cloud_enforced_lifetime=False)
    body = spec.instance_body()
    # The duration is required of flex-start: sent even when the Param would leave it to Airflow.
    assert body["scheduling"] == {
        "automatic_restart": False,
        "on_host_maintenance": "TERMINATE",
        "provisioning_model": "FLEX_START",
        "instance_termination_action": "DELETE",
        "max_run_duration": {"seconds": spec.max_run_duration_minutes * 60},
    }
    assert body["params"] == {"request_valid_for_duration": {"seconds": 45 * 60}}


@pytest.mark.parametrize("enforced", [True, False])
def test_spot_is_deleted_when_preempted_and_never_restarted(enforced):
    spec = spec_for("spot", cloud_enforced_lifetime=enforced)
    scheduling = spec.instance_body()["scheduling"]
    assert scheduling["provisioning_model"] == "SPOT" and scheduling["automatic_restart"] is False
    assert scheduling["instance_termination_action"] == "DELETE"
    assert ("max_run_duration" in scheduling) is enforced


@pytest.mark.parametrize("enforced", [True, False])
def test_on_demand_takes_a_termination_action_only_with_a_time_limit(enforced):
    scheduling = spec_for("on-demand", cloud_enforced_lifetime=enforced).instance_body()["scheduling"]
    assert scheduling["provisioning_model"] == "STANDARD"
    assert ("instance_termination_action" in scheduling) is enforced
    assert ("max_run_duration" in scheduling) is enforced


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_the_rehearsal_of_any_capacity_is_an_on_demand_vm(capacity):
    spec = build_run_spec({"capacity": capacity, **NEEDS[capacity]}, **IDENTITY, rehearsal=True)
    body = spec.instance_body()
    assert body["scheduling"]["provisioning_model"] == "STANDARD" and "params" not in body
    assert body["reservation_affinity"] == {"consume_reservation_type": "NO_RESERVATION"}
    assert spec.consumed_reservation is None


# Where each capacity's insert body may differ from gcloud 528's for the same flags, and why:
# {field: (gcloud's, ours)}.
GCLOUD_DIFFERENCES = {
    # gcloud sends its default, automaticRestart true; a failed flex-start VM is better TERMINATED
    # and replaced by the training sensor than restarted with no training on it.
    "flex-start": {"scheduling.automaticRestart": (True, False)},
    # gcloud sends no affinity without --reservation-affinity; a Spot VM cannot consume one anyway.
    "spot": {"reservationAffinity": (None, {"consumeReservationType": "NO_RESERVATION"})},
}
GCLOUD_CAPTURE = REPO / "tests" / "fixtures" / "gcloud-capacity-requests.json"


def _without_empty(value):
    """The REST JSON without the empty lists and objects the client library writes for unset fields."""
    if isinstance(value, dict):
        kept = {key: _without_empty(item) for key, item in value.items()}
        return {key: item for key, item in kept.items() if item not in ([], {})}
    return value


@pytest.mark.parametrize("capacity", ["spot", "on-demand", "flex-start"])
def test_each_body_sends_what_gcloud_528_sends_for_the_same_flags(capacity):
    """The captured commands ask for a 24 h lifetime (the Spot one for none): so does the spec."""
    from google.cloud.compute_v1 import Instance

    [step] = [s for s in json.loads(GCLOUD_CAPTURE.read_text())["steps"] if s["capacity"] == capacity]
    [inserted] = [r["body"] for r in step["requests"] if r["method"] == "POST" and r["path"].split("?")[0].endswith("/instances")]
    spec = spec_for(capacity, max_run_duration_minutes=24 * 60, cloud_enforced_lifetime=capacity != "spot")
    ours = _without_empty(json.loads(Instance.to_json(Instance(spec.instance_body()))))
    fields = {
        f"scheduling.{key}" for key in {*inserted["scheduling"], *ours["scheduling"]}
    } | {"reservationAffinity"}

    def at(body, path):
        for part in path.split("."):
            body = (body or {}).get(part)
        return body

    found = {path: (at(inserted, path), at(ours, path)) for path in fields if at(inserted, path) != at(ours, path)}
    assert found == GCLOUD_DIFFERENCES.get(capacity, {})
    if capacity == "flex-start":  # gcloud 528 cannot send the request's validity
        assert "params" not in inserted and ours["params"] == {"requestValidForDuration": {"seconds": "7200"}}
