"""Every insert-body field beyond gcloud's capture is listed in docs/request-fields.md, and a field
without a public source (cloud.instances.UNSOURCED_FIELDS) cannot fail the run: an insert refused
naming it is made once more without it, and the run summary names the backstops left."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from google.api_core.exceptions import BadRequest, Forbidden

from maxtext_sft.cloud.errors import OperationFailed
from maxtext_sft.cloud.instances import CLOUD_LIFETIME, insert_with_fallback, with_expiry_label
from maxtext_sft.results.summary import backstops, backstops_text
from maxtext_sft.run.spec import build_run_spec
from tests.plugins.request_fields import documented_fields, field_paths, gcloud_bodies
from tests.plugins.test_capacity_choice import IDENTITY, NEEDS, spec_for
from tests.plugins.test_slice_spec import make_slice_spec

# The refusal as a public Cloud Batch runbook quotes it (there for a template: resource.properties.).
REFUSAL = (
    "Invalid value for field 'resource.scheduling.maxRunDuration': '{ \"seconds\": \"7200\"}'. "
    "max-run-duration for given provisioning model is not supported"
)


def rest(kind: str, body: dict) -> dict:
    from google.cloud.compute_v1 import Instance, InstanceGroupManager, InstanceTemplate

    cls = {"instance": Instance, "template": InstanceTemplate, "group": InstanceGroupManager}[kind]
    return json.loads(cls.to_json(cls(body)))


def sent_bodies(**params) -> dict[str, dict]:
    """Each body as the pipeline sends it (REST JSON, the expiry label added at insert)."""
    bodies = {
        capacity: rest("instance", with_expiry_label(spec_for(capacity, **params).instance_body(), 60))
        for capacity in ("reservation", "spot", "flex-start", "on-demand")
    }
    rehearsal = build_run_spec({"capacity": "reservation", **NEEDS["reservation"], **params}, **IDENTITY, rehearsal=True)
    bodies["rehearsal"] = rest("instance", with_expiry_label(rehearsal.instance_body(), 60))
    spec = make_slice_spec(**params)
    template = spec.instance_template_body()
    template["properties"] = with_expiry_label(template["properties"], 60)
    bodies["slice template"] = rest("template", template)
    bodies["slice group"] = rest("group", spec.group_body())
    return bodies


def test_every_field_beyond_gclouds_capture_is_listed_in_the_doc_and_nothing_else():
    captured = gcloud_bodies()
    captured["rehearsal"] = captured["reservation"]  # the tutorial's request, made an on-demand CPU VM
    extra: dict[str, set[str]] = {}
    for variant in ({}, {"os_login": True}, {"subnetwork": "tpu-subnet", "network_project": "vpc-host"}):
        for kind, body in sent_bodies(**variant).items():
            extra.setdefault(kind, set()).update(field_paths(body) - field_paths(captured[kind]))
    assert documented_fields() == extra
    # The unsourced field is where the doc says: the reservation's and Spot's lifetime.
    assert "scheduling.maxRunDuration.seconds" in extra["reservation"] & extra["spot"]


def test_field_paths_name_metadata_items_and_labels_by_key_and_skip_empty_values():
    body = {"metadata": {"items": [{"key": "ssh-keys", "value": "x"}]}, "labels": {"a": "b"}, "disks": [{"licenses": []}]}
    assert field_paths(body) == {"metadata.items[key=ssh-keys]", "labels.a"}


class Log:
    def __init__(self):
        self.warnings = []

    def warning(self, message, *args):
        self.warnings.append(message % args)


def reservation_body() -> dict:
    return spec_for("reservation", max_run_duration_minutes=120).instance_body()


def recording(*errors):
    """An insert that raises `errors` in turn, then succeeds; the calls it got."""
    calls, pending = [], list(errors)

    def insert(body, request_id):
        calls.append((body, request_id))
        if pending:
            raise pending.pop(0)
        return "made"

    return insert, calls


@pytest.mark.parametrize(
    "refusal",
    [
        BadRequest(REFUSAL, errors=[{"message": REFUSAL, "domain": "global", "reason": "invalid"}]),
        OperationFailed({"httpErrorStatusCode": 400, "error": {"errors": [{"code": "INVALID_FIELD_VALUE", "message": REFUSAL}]}}),
    ],
    ids=["synchronous", "on the operation"],
)
def test_a_refused_lifetime_on_a_reservation_bound_vm_is_dropped_once_keeping_the_delete_action(refusal):
    insert, calls = recording(refusal)
    log, cleaned = Log(), []
    result, dropped = insert_with_fallback(insert, reservation_body(), "req-1", log, before_again=lambda: cleaned.append(1))
    assert (result, dropped, cleaned) == ("made", [CLOUD_LIFETIME], [1])
    (first, first_id), (second, second_id) = calls
    assert first["scheduling"]["max_run_duration"] == {"seconds": 7200}
    assert "max_run_duration" not in second["scheduling"]
    assert second["scheduling"] == {k: v for k, v in first["scheduling"].items() if k != "max_run_duration"}
    assert second["scheduling"]["instance_termination_action"] == "DELETE"  # the tutorial's, as gcloud sends it
    assert first_id == "req-1" and second_id not in (None, "req-1")  # the API answers a seen id with its outcome
    [said] = log.warnings
    assert "refused scheduling.maxRunDuration with provisioning model RESERVATION_BOUND" in said
    assert "the VM's autostop, the janitor's expiry label, the teardown" in said


def test_a_spot_vm_falls_back_the_same_way_keeping_its_delete_action():
    insert, calls = recording(BadRequest(REFUSAL, errors=[{"message": REFUSAL, "reason": "invalid"}]))
    body = spec_for("spot", max_run_duration_minutes=120).instance_body()
    assert insert_with_fallback(insert, body, "r", Log())[1] == [CLOUD_LIFETIME]
    assert calls[1][0]["scheduling"] == {
        "automatic_restart": False, "instance_termination_action": "DELETE", "on_host_maintenance": "TERMINATE",
        "preemptible": True, "provisioning_model": "SPOT",
    }  # what gcloud 528 sends for the Spot create (tests/fixtures/gcloud-capacity-requests.json)


def test_other_refusals_and_other_models_are_not_second_guessed():
    other = BadRequest("x", errors=[{"message": "Invalid value for field 'resource.machineType': 'x'. y", "reason": "invalid"}])
    insert, calls = recording(other)
    with pytest.raises(BadRequest):
        insert_with_fallback(insert, reservation_body(), "r", Log())
    assert len(calls) == 1
    # Flex-start requires its run duration: a refusal naming it is raised as it came.
    flex = spec_for("flex-start").instance_body()
    insert, calls = recording(BadRequest(REFUSAL, errors=[{"message": REFUSAL, "reason": "invalid"}]))
    with pytest.raises(BadRequest):
        insert_with_fallback(insert, flex, "r", Log())
    assert len(calls) == 1
    # A 403 naming the field is no refusal of it.
    insert, calls = recording(Forbidden(REFUSAL, errors=[{"message": REFUSAL, "reason": "forbidden"}]))
    with pytest.raises(Forbidden):
        insert_with_fallback(insert, reservation_body(), "r", Log())
    # Refused again without it: raised, no third insert.
    again = BadRequest("again", errors=[{"message": "Invalid value for field 'resource.name': 'x'. z", "reason": "invalid"}])
    insert, calls = recording(BadRequest(REFUSAL, errors=[{"message": REFUSAL, "reason": "invalid"}]), again)
    with pytest.raises(BadRequest, match="again"):
        insert_with_fallback(insert, reservation_body(), None, Log())
    assert len(calls) == 2 and calls[1][1] is None


def test_the_summary_names_the_backstops_in_force():
    spec = spec_for("reservation").to_dict()
    expires = "1796000000"
    made = {"scheduling": {"max_run_duration": {"seconds": "7200"}, "instance_termination_action": "DELETE"},
            "labels": {"expires-at": expires}}
    found = backstops(spec, made, [])
    assert found["cloud_lifetime"] == {
        "in_force": True, "max_run_duration_seconds": 7200, "termination_action": "DELETE", "why_not": None,
    }
    assert found["autostop"] == {"in_force": True, "idle_minutes": 30}
    assert found["janitor"]["in_force"] and found["janitor"]["expires_at"].startswith("2026-")
    assert backstops_text(found).startswith("Backstops if the teardown never runs: cloud-enforced lifetime 2h 00m 00s (DELETE)")

    refused = backstops(spec, {"scheduling": {"instance_termination_action": "DELETE"}, "labels": {"expires-at": expires}},
                        ["scheduling.maxRunDuration"])
    assert not refused["cloud_lifetime"]["in_force"]
    text = backstops_text(refused)
    assert "no cloud-enforced lifetime (Compute Engine refused scheduling.maxRunDuration" in text
    assert "the VM's autostop after 30 idle minutes" in text and "the janitor DAG after 2026-" in text
    off = spec_for("reservation", cloud_enforced_lifetime=False).to_dict()
    assert backstops(off, {"scheduling": {}}, [])["cloud_lifetime"]["why_not"] == "cloud_enforced_lifetime is off"
    hosts = [{"name": "h-0"}]  # a slice's create returns its hosts
    assert "slice" in backstops(make_slice_spec().to_dict(), hosts, None)["cloud_lifetime"]["why_not"]
    assert backstops(None, made, []) is None


def test_create_vm_pushes_the_refused_fields(monkeypatch):
    """CreateVmOperator's create goes through the one fallback and records what it dropped."""
    from maxtext_sft.tasks import compute as tasks_compute

    pushed = {}
    ti = SimpleNamespace(xcom_push=lambda key, value: pushed.update({key: value}))
    operator = SimpleNamespace(
        body=reservation_body(), request_id="base", resource_id="vm", project_id="p", zone="z", log=Log(),
    )
    bodies = []

    def create(hook, context):
        bodies.append(operator.body)
        if len(bodies) == 1:
            raise BadRequest(REFUSAL, errors=[{"message": REFUSAL, "reason": "invalid"}])
        return {"name": "vm"}

    operator._create_instance = create
    monkeypatch.setattr(tasks_compute, "adoptable_instance", lambda hook, where, log: None)
    made = tasks_compute.CreateVmOperator._create_without_refused_fields(operator, hook=None, context={"ti": ti})
    assert made == {"name": "vm"} and pushed == {"refused_fields": ["scheduling.maxRunDuration"]}
    assert "max_run_duration" in bodies[0]["scheduling"] and "max_run_duration" not in bodies[1]["scheduling"]


def test_a_remade_vm_goes_through_the_same_fallback(monkeypatch):
    """The training sensor's recovery and the VM steps make the VM again through VmRemake.insert:
    the same fallback, so a recovery on a reservation is not refused where create_vm was not."""
    from maxtext_sft.vm import remake

    inserted = []

    class Hook:
        def __init__(self, **_):
            pass

        def insert_instance(self, body, zone, project_id, request_id):
            inserted.append(body)
            if len(inserted) == 1:
                raise BadRequest(REFUSAL, errors=[{"message": REFUSAL, "reason": "invalid"}])

    monkeypatch.setattr(remake, "ComputeEngineEndpointHook", Hook)
    monkeypatch.setattr(remake, "adoptable_instance", lambda hook, where, log: None)
    log = Log()
    log.info = lambda *args: None
    spec = spec_for("reservation", max_run_duration_minutes=120)
    assert remake.VmRemake(spec, gcp_conn_id="c", ssh_conn_id=None, log=log).insert("the VM was lost") is True
    assert [("max_run_duration" in body["scheduling"]) for body in inserted] == [True, False]
    assert inserted[1]["labels"]["expires-at"]  # the rest of the remade body stays
