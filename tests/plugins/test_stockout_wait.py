"""The pause before a stockout's insert is asked again (cloud/capacity.py stockout_pause): each ask
is a deferral a worker made, so its event waits out the executor's report of that deferral
(apache/airflow#72716), whatever the poll."""

from __future__ import annotations

import time

import pytest

from maxtext_sft.cloud.capacity import StockoutWaitTrigger, stockout_pause


@pytest.mark.parametrize(("poll", "first_read", "pause"), [(2, 10, 10), (15, 60, 60), (90, 60, 90)])
def test_the_pause_is_the_poll_but_no_shorter_than_the_first_read(poll, first_read, pause):
    assert stockout_pause(poll, first_read) == pause


def test_create_vm_defers_through_a_stockout_for_the_pause():
    from airflow.sdk.exceptions import TaskDeferred
    from maxtext_sft.tasks.compute import CreateVmOperator

    create = CreateVmOperator(task_id="create_vm", gcp_conn_id="gcp", project_id="my-project", zone="us-east5-b",
                              resource_id="vm", body={}, waits_out_stockouts=True,
                              capacity_poll_seconds=2, capacity_first_read_seconds=10)
    with pytest.raises(TaskDeferred) as deferred:
        create._wait_out_stockout(time.time() + 600, "ZONE_RESOURCE_POOL_EXHAUSTED")
    trigger = deferred.value.trigger
    assert isinstance(trigger, StockoutWaitTrigger) and trigger.wait_seconds == 10
    assert deferred.value.method_name == "resume_after_capacity_wait"


def test_a_vm_made_again_through_a_stockout_waits_the_same_pause():
    from types import SimpleNamespace

    from maxtext_sft.vm.remake import VmRemake

    spot = SimpleNamespace(consumed_reservation=None, waits_out_stockouts=True)
    remake = VmRemake(spot, gcp_conn_id="gcp", ssh_conn_id="ssh", log=None)
    trigger = remake.capacity_wait_trigger(time.time() + 600, poll_seconds=2, first_read_seconds=10)
    assert isinstance(trigger, StockoutWaitTrigger) and trigger.wait_seconds == 10
