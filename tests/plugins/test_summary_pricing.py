"""summarize_run's inputs to the run summary's cost: each capacity's price from the spec's Params
(times a slice's hosts), and the VM's creation and start from create_vm's instance."""

from __future__ import annotations

from maxtext_sft.tasks.summarize import _instance_times, _pricing
from tests.plugins.test_capacity_choice import spec_for
from tests.plugins.test_slice_spec import make_slice_spec
from tests.plugins.test_spec import make_spec


def test_a_spot_run_is_priced_at_the_spot_param_and_compared_with_a_reservation_and_on_demand():
    spec = spec_for("spot", spot_hourly_price_usd=6.0, on_demand_hourly_price_usd=30.0).to_dict()
    assert _pricing(spec) == {"hourly_price_usd": 6.0, "capacity": "spot",
                              "compared_prices_usd": {"reservation": 20.0, "on-demand": 30.0}}


def test_prices_not_given_stay_unknown():
    assert _pricing(spec_for("flex-start").to_dict()) == {
        "hourly_price_usd": None, "capacity": "flex-start",
        "compared_prices_usd": {"reservation": 20.0, "on-demand": None},
    }
    assert _pricing(None) == {"hourly_price_usd": None}  # plan_run failed: no VM, no price needed


def test_a_slice_multiplies_each_price_by_its_hosts():
    spec = make_slice_spec(vm_hourly_price_usd=10.0, on_demand_hourly_price_usd=12.5).to_dict()
    assert _pricing(spec) == {"hourly_price_usd": 40.0, "capacity": "reservation",
                              "compared_prices_usd": {"reservation": 40.0, "on-demand": 50.0}}


def test_a_rehearsal_is_priced_at_its_own_price_with_nothing_to_compare():
    spec = make_spec().to_dict() | {"rehearsal_machine_type": "e2-standard-8", "vm_hourly_price_usd": 0.27}
    assert _pricing(spec) == {"hourly_price_usd": 0.27}


def test_the_instance_gives_its_creation_and_its_last_start():
    instance = {"status": "RUNNING", "creation_timestamp": "2026-12-01T10:00:00.000-08:00",
                "last_start_timestamp": "2026-12-01T10:40:00.000-08:00"}
    assert _instance_times(instance) == {"instance_created_at": "2026-12-01T10:00:00.000-08:00",
                                         "instance_started_at": "2026-12-01T10:40:00.000-08:00"}
    # A slice's create returns its hosts (a list); a failed create, nothing.
    for created in ([{"name": "host-0"}], None):
        assert _instance_times(created) == {"instance_created_at": None, "instance_started_at": None}
