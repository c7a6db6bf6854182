"""A multi-host slice's spec: its Params checked before anything is paid for, its names, the
bodies of its policy, template and group, and the hosts' specs every step runs with."""

from __future__ import annotations

import pytest

from maxtext_sft.run.catalog import TPU_SLICES
from maxtext_sft.run.params import SpecError
from maxtext_sft.run.spec import RunSpec, build_run_spec
from maxtext_sft.cloud.slice_group import hosts_state
from tests.plugins.test_spec import RUN_ID, STARTED

SLICE_CONF = {
    "reservation": "my-slice-reservation",
    "tpu_slice": "v6e-16",
    "machine_type": "ct6e-standard-4t",
    "output_location": "gs://my-bucket/sft",
}


def make_slice_spec(**params) -> RunSpec:
    return build_run_spec(
        {**SLICE_CONF, **params},
        dag_id="maxtext_sft_slice",
        run_id=RUN_ID,
        generation=0,
        started=STARTED,
        default_project_id="my-project",
        ssh_user="maxtext",
        ssh_public_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample",
        tpu_slice=True,
    )


def test_every_documented_v6e_slice_is_four_chip_hosts_whose_bounds_multiply_to_the_chips():
    for name, shape in TPU_SLICES.items():
        chips = int(name.split("-")[1])
        x, y = (int(n) for n in shape["topology"].split("x"))
        hx, hy, _ = (int(n) for n in shape["host_bounds"].split(","))
        assert x * y == chips and hx * hy == shape["hosts"] == chips // 4
        assert (x // hx, y // hy) == (2, 2) and shape["machine_type"] == "ct6e-standard-4t"


def test_a_v6e_16_spec_names_its_policy_template_and_group_after_the_run():
    spec = make_slice_spec()
    assert spec.is_slice and spec.hosts == 4 and spec.region == "us-east5"
    assert spec.tpu == TPU_SLICES["v6e-16"]
    assert spec.group_name == spec.vm_name
    assert spec.template_name == f"{spec.vm_name}-tmpl" and spec.policy_name == f"{spec.vm_name}-policy"
    assert spec.workload_policy_body()["workloadPolicy"] == {"type": "HIGH_THROUGHPUT", "acceleratorTopology": "4x4"}
    group = spec.group_body()
    assert group["target_size"] == 4
    assert group["instance_template"].endswith(f"/global/instanceTemplates/{spec.template_name}")
    assert group["resource_policies"]["workload_policy"].endswith(f"/regions/us-east5/resourcePolicies/{spec.policy_name}")
    properties = spec.instance_template_body()["properties"]
    assert properties["machine_type"] == "ct6e-standard-4t"
    # The single VM's request otherwise: reservation-bound, deleted on termination, the run's labels.
    assert properties["scheduling"]["provisioning_model"] == "RESERVATION_BOUND"
    assert properties["scheduling"]["instance_termination_action"] == "DELETE"
    assert "max_run_duration" not in properties["scheduling"]  # a MIG would re-create the host
    assert properties["reservation_affinity"]["values"] == ["my-slice-reservation"]
    assert properties["labels"] == spec.labels


def test_a_spec_round_trips_as_a_slice():
    spec = make_slice_spec()
    again = RunSpec.from_dict(spec.to_dict())
    assert again.is_slice and again.group_body() == spec.group_body()


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"output_location": None}, "output_location", "needs one"),
        ({"machine_type": "ct6e-standard-8t"}, "machine_type", "made of ct6e-standard-4t hosts"),
        ({"tpu_slice": "v6e-8"}, "tpu_slice", None),
    ],
)
def test_a_slice_that_cannot_work_is_refused_before_anything_is_paid_for(change, param, words):
    with pytest.raises(SpecError) as refused:
        make_slice_spec(**change)
    assert refused.value.param == param
    if words:
        assert words in str(refused.value)


def test_each_host_gets_its_worker_id_and_every_hosts_address_and_keeps_the_runs_names():
    spec = make_slice_spec()
    hosts = [{"name": f"{spec.group_name}-{s}", "ip": f"10.0.0.{i}", "id": str(100 + i)} for i, s in enumerate("abcd")]
    specs = spec.on_hosts(hosts)
    assert [s.vm_name for s in specs] == [h["name"] for h in hosts]
    assert [s.host_index for s in specs] == [0, 1, 2, 3]
    assert {s.worker_hostnames for s in specs} == {("10.0.0.0", "10.0.0.1", "10.0.0.2", "10.0.0.3")}
    assert [s.host_id for s in specs] == ["100", "101", "102", "103"]
    assert {s.group_name for s in specs} == {spec.group_name}  # a host's spec still names the run's group


def _member(name: str, status: str = "RUNNING", action: str = "NONE", errors=None) -> dict:
    member = {"instance": f"projects/p/zones/z/instances/{name}", "instanceStatus": status, "currentAction": action}
    if errors:
        member["lastAttempt"] = {"errors": {"errors": errors}}
    return member


def test_the_hosts_wait_is_ready_only_when_every_host_runs_in_name_order():
    assert hosts_state([_member("g-b"), _member("g-a")], 2) == ("ready", ["g-a", "g-b"])
    assert hosts_state([_member("g-b"), _member("g-a", "STAGING", "CREATING")], 2) == ("waiting", "1 of 2 hosts RUNNING")


def test_a_host_the_cloud_refuses_fails_the_wait_naming_it_but_a_passing_error_waits():
    quota = [{"code": "QUOTA_EXCEEDED", "message": "Quota 'TPUS' exceeded."}]
    state, why = hosts_state([_member("g-a"), _member("g-b", "", "CREATING", quota)], 2)
    assert state == "failed" and "g-b" in why and "QUOTA_EXCEEDED" in why
    # An error the table does not know fails too: the hosts already up are paid for meanwhile.
    unknown = [{"code": "SOMETHING_NEW", "message": "Something new."}]
    assert hosts_state([_member("g-a"), _member("g-b", "", "CREATING", unknown)], 2)[0] == "failed"
    # What the table retries (a zone's stockout) is waited for, up to the wait's deadline.
    stockout = [{"code": "ZONE_RESOURCE_POOL_EXHAUSTED", "message": "The zone does not have enough resources."}]
    assert hosts_state([_member("g-a"), _member("g-b", "", "CREATING", stockout)], 2) == ("waiting", "1 of 2 hosts RUNNING")
