"""The Fine-tunes page's rows from the XComs runs leave (old and new shapes), and the task links' URLs."""

from __future__ import annotations

import dataclasses

from datetime import datetime, timezone
from types import SimpleNamespace

import pytest

from maxtext_sft.ui import task_links
from maxtext_sft.results.fine_tunes import Link, fine_tune_row, loss_plot_series
from maxtext_sft.ui.task_links import HubCommitLink, RunFolderConsoleLink, VmConsoleLink

WHEN = datetime(2026, 12, 3, 4, 5, tzinfo=timezone.utc)
SPEC = {"dataset_name": "HuggingFaceH4/ultrachat_200k", "dataset_revision": "a" * 40, "steps": 20, "hub_repo_id": "t/m"}
RECORD = {
    "dataset": "HuggingFaceH4/ultrachat_200k", "dataset_revision": "0123456789abcdef0123",
    "final_step": 20, "final_loss": "1.234567", "loss_history": [[1, 2.0], [20, 1.234567]],
    "run_record": "gs://models/sft/maxtext_sft/run-1/run-record.json",
    "hf_export": "gs://models/sft/maxtext_sft/run-1/hf-export",
    "model_card": "gs://models/sft/maxtext_sft/run-1/hf-export/README.md",
}
SUMMARY = {"vm": {"vm_hours": 0.0281, "estimated_cost_usd": 0.5623}, "final_loss": "1.234567"}


def row(**xcoms):
    return fine_tune_row(dag_id="maxtext_sft", run_id="manual__1", state="success", logical_date=None,
                         run_after=WHEN, run_page="/dags/maxtext_sft/runs/manual__1", **xcoms)


def test_an_old_run_published_with_the_old_result_shape():
    shown = row(spec=SPEC, record=RECORD, summary=SUMMARY, publish_state="success",
                published={"repo_id": "t/m", "branch": "main", "commit": "f00dfeed" * 5, "url": "x"})
    assert shown.logical_date == "- (triggered 2026-12-03 04:05 UTC)"
    assert shown.dataset == "HuggingFaceH4/ultrachat_200k @ 0123456789ab"
    assert (shown.steps, shown.train_loss, shown.eval_loss) == ("20 of 20", "1.235", "-")
    assert shown.vm == "0.028 h, $0.56"
    assert shown.published == Link("t/m @ f00dfeedf0", f"https://huggingface.co/t/m/commit/{'f00dfeed' * 5}")
    assert shown.outputs == [
        Link("run record", "https://console.cloud.google.com/storage/browser/_details/models/sft/maxtext_sft/run-1/run-record.json"),
        Link("export", "https://console.cloud.google.com/storage/browser/models/sft/maxtext_sft/run-1/hf-export"),
        Link("model card", "https://console.cloud.google.com/storage/browser/_details/models/sft/maxtext_sft/run-1/hf-export/README.md"),
        Link("run in Airflow", "/dags/maxtext_sft/runs/manual__1"),
    ]
    assert shown.has_loss_plot


def test_a_new_run_with_eval_losses_and_a_refusal_to_publish():
    record = {**RECORD, "eval_loss": {"base": 2.5, "tuned": None}, "eval_history": [[10, 2.0]]}
    shown = row(spec=SPEC, record=record, published={"published": False, "reason": "final loss above 1.0"},
                publish_state="success")
    assert shown.eval_loss == "2.5 → -"
    assert shown.published == Link("not published: final loss above 1.0", None)
    assert loss_plot_series(record) == ([[1, 2.0], [20, 1.234567]], [[10, 2.0]])


def test_a_run_that_failed_before_its_outputs_shows_what_it_planned():
    shown = fine_tune_row(dag_id="nightly", run_id="scheduled__x", state="failed", logical_date=WHEN,
                          run_after=WHEN, run_page="/r", spec=SPEC, publish_state="upstream_failed")
    assert shown.logical_date == "2026-12-03 04:05 UTC"
    assert (shown.steps, shown.train_loss, shown.vm) == ("20", "-", "-")
    assert shown.dataset == f"HuggingFaceH4/ultrachat_200k @ {'a' * 12}"
    assert shown.published == Link("not published: publish_to_hub upstream failed", None)
    assert shown.outputs == [Link("run in Airflow", "/r")] and not shown.has_loss_plot


def test_a_failed_run_says_why_in_its_notes_words_and_a_succeeded_one_does_not():
    note = "Failed at preflight: Preflight failed, no VM was created:\nreservation: ...\nAlso failed: delete_vm."
    failed = fine_tune_row(dag_id="nightly", run_id="scheduled__x", state="failed", logical_date=WHEN,
                           run_after=WHEN, run_page="/r", publish_state="upstream_failed", note=note + "\n")
    assert failed.cause == note
    assert row(note="Succeeded: 20 steps").cause == ""
    assert dataclasses.replace(failed, cause="") == fine_tune_row(
        dag_id="nightly", run_id="scheduled__x", state="failed", logical_date=WHEN, run_after=WHEN, run_page="/r",
        publish_state="upstream_failed")  # no note yet: nothing said


def test_nothing_at_all_and_odd_values_show_dashes():
    shown = row(spec="not a dict", record={"final_loss": "nan", "eval_loss": "odd"}, summary={"vm": None})
    assert (shown.dataset, shown.steps, shown.train_loss, shown.eval_loss, shown.vm) == ("-", "-", "nan", "-", "-")
    assert shown.published == Link("-", None)
    # The old result when hub_repo_id was not set: None, the task succeeded.
    assert row(published=None, publish_state="success").published == Link("not published: no hub_repo_id", None)


def test_the_vm_cell_shows_a_wait_for_capacity_apart_from_the_billed_hours_and_the_preemptions():
    vm = {"vm_hours": 1.0, "estimated_cost_usd": 6.0, "waited_for_capacity_seconds": 1800.0}
    assert row(summary={"vm": vm, "preemptions": 0}).vm == "1.000 h, $6.00; waited 30m 00s for capacity (not billed)"
    assert row(summary={"vm": vm, "preemptions": 1}).vm == (
        "1.000 h, $6.00; waited 30m 00s for capacity (not billed); 1 preemption"
    )
    no_wait = {"vm_hours": 1.0, "estimated_cost_usd": None, "waited_for_capacity_seconds": None}
    assert row(summary={"vm": no_wait, "preemptions": 3}).vm == "1.000 h; 3 preemptions"
    assert row(summary={"vm": no_wait | {"waited_for_capacity_seconds": 0.4}}).vm == "1.000 h"


def test_outputs_on_a_worker_are_shown_as_paths_without_links():
    record = {"run_record": "worker-1:/data/out/run-record.json", "hf_export": "worker-1:/data/out/hf-export"}
    shown = row(record=record)
    assert shown.outputs[:2] == [Link("run record: worker-1:/data/out/run-record.json", None),
                                 Link("export: worker-1:/data/out/hf-export", None)]


@pytest.fixture
def stored_return_value(monkeypatch):
    """get_link reads the task's return value from XCom: here, from this dict."""
    stored = {}
    monkeypatch.setattr(task_links, "_return_value", lambda ti_key: stored.get(ti_key.task_id))
    return stored


def links_of(link, task_id):
    return link.get_link(None, ti_key=SimpleNamespace(dag_id="d", run_id="r", task_id=task_id, map_index=-1))


def test_the_vm_link_is_the_instance_create_vm_returned(stored_return_value):
    assert links_of(VmConsoleLink(), "create_vm") == ""  # no return value (the task failed): no link
    stored_return_value["create_vm"] = {
        "name": "sft-vm-1", "self_link": "https://compute.googleapis.com/compute/v1/projects/p-1/zones/us-east5-b/instances/sft-vm-1",
    }
    assert links_of(VmConsoleLink(), "create_vm") == (
        "https://console.cloud.google.com/compute/instancesDetail/zones/us-east5-b/instances/sft-vm-1?project=p-1"
    )
    stored_return_value["create_vm"] = {"name": "vm-2", "zone": "https://x/compute/v1/projects/p-2/zones/europe-west4-a"}
    assert links_of(VmConsoleLink(), "create_vm").endswith("/zones/europe-west4-a/instances/vm-2?project=p-2")


def test_the_outputs_link_is_the_run_folder_only_in_cloud_storage(stored_return_value):
    stored_return_value["collect_outputs"] = RECORD
    assert links_of(RunFolderConsoleLink(), "collect_outputs") == (
        "https://console.cloud.google.com/storage/browser/models/sft/maxtext_sft/run-1"
    )
    stored_return_value["collect_outputs"] = {"run_record": "worker-1:/data/run-record.json"}
    assert links_of(RunFolderConsoleLink(), "collect_outputs") == ""


@pytest.mark.parametrize("published, url", [
    ({"repo_id": "team/m", "branch": "main", "commit": "abc123"}, "https://huggingface.co/team/m/commit/abc123"),
    ({"published": True, "repo_id": "team/m", "commit": "abc123", "reason": None}, "https://huggingface.co/team/m/commit/abc123"),
    ({"published": False, "reason": "hub_repo_id is not set"}, ""),
    (None, ""),
])
def test_the_hub_link_is_the_commit_publish_to_hub_made(stored_return_value, published, url):
    stored_return_value["publish_to_hub"] = published
    assert links_of(HubCommitLink(), "publish_to_hub") == url


def test_the_operators_carry_their_links():
    from maxtext_sft.tasks.compute import CreateVmOperator
    from maxtext_sft.tasks.outputs import CollectOutputsOperator, PublishToHubOperator

    assert [type(link) for link in CreateVmOperator.operator_extra_links] == [VmConsoleLink]
    assert [type(link) for link in CollectOutputsOperator.operator_extra_links] == [RunFolderConsoleLink]
    assert [type(link) for link in PublishToHubOperator.operator_extra_links] == [HubCommitLink]
