"""The whole pipeline through `dag.test()` against the local cloud (fast MaxText stand-in)."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import pytest

from tests.plugins.test_loss_curve import png_size

REFERENCE = Path(__file__).resolve().parents[1] / "fixtures" / "gcloud-tutorial-requests.json"
TUTORIAL_VALUES = {"project_id": "my-project", "zone": "us-east5-b", "reservation": "my-reservation"}

# Fields of the insert body that may differ from gcloud's, and why (see RunSpec.instance_body).
EXPLAINED_DIFFERENCES = {
    "name": "unique per DAG run instead of the fixed NAME",
    "labels": "identify the package, DAG and run",
    "tags": "a stable network tag Param instead of the per-run name",
    "metadata": "the pipeline's SSH key, guest attributes on (host keys to verify), the run's full identity",
    "serviceAccounts": "gcloud attaches the default service account; the capture endpoint had none",
    "scheduling": "the tutorial's, plus maxRunDuration: a hard lifetime even if Airflow is gone",
}

pytestmark = pytest.mark.e2e


def instance_requests(cloud, method: str) -> list[dict]:
    return [r for r in cloud.requests() if r["method"] == method and "/instances" in r["path"].split("?")[0]]


@pytest.fixture(scope="module")
def happy_run(run_pipeline, local_cloud):
    # The tutorial's reservation: one v6e-8 in its project and zone.
    local_cloud.add_reservation(
        TUTORIAL_VALUES["reservation"], 1, zone=TUTORIAL_VALUES["zone"], project=TUTORIAL_VALUES["project_id"]
    )
    run = run_pipeline(TUTORIAL_VALUES)
    return run, local_cloud.requests()


def test_every_task_succeeds_and_the_vm_is_gone(happy_run, local_cloud):
    run, _ = happy_run
    assert run.state == "success", run.report()
    assert set(run.task_states.values()) == {"success"}, run.report()
    assert local_cloud.vms() == []
    assert run.xcoms["wait_for_final_checkpoint.return_value"]["final_step"] == 30


def test_the_run_summary_times_every_phase_and_prices_the_vm(happy_run):
    run, _ = happy_run
    summary = run.xcoms["summarize_run.return_value"]
    assert summary["outcome"] == "success" and summary["warnings"] == []
    phases = {row["task_id"]: row for row in summary["phases"]}
    assert set(phases) == set(run.task_states) - {"summarize_run", "check_run_outcome"}
    assert all(row["duration_seconds"] > 0 for task_id, row in phases.items() if task_id != "vm_lease")
    vm = summary["vm"]
    assert vm["existed"] and vm["deleted"] and vm["hourly_price_usd"] == 20.0
    # Billed from the instance's own start (RUNNING), after its creation; the reservation's VM waited for nothing.
    instance = run.xcoms["create_vm.return_value"]
    assert vm["started"] == instance["last_start_timestamp"] >= instance["creation_timestamp"]
    assert vm["capacity"] == "reservation" and vm["waited_for_capacity_seconds"] is None
    when = {key: datetime.fromisoformat(phases["create_vm"][key]) for key in ("started", "ended")}
    assert when["started"] <= datetime.fromisoformat(vm["started"]) <= when["ended"]
    assert vm["ended"] == phases["delete_vm"]["ended"]
    assert vm["estimated_cost_usd"] == round(vm["lifetime_seconds"] / 3600 * 20.0, 2)
    assert (summary["final_step"], summary["outputs"]["hf_export"]) == (30, run.xcoms["collect_outputs.return_value"]["hf_export"])


def test_the_same_vm_was_inserted_then_deleted(happy_run):
    run, requests = happy_run
    inserts = [r for r in requests if r["method"] == "POST" and r["path"].split("?")[0].endswith("/instances")]
    deletes = [r for r in requests if r["method"] == "DELETE" and "/instances/" in r["path"]]
    assert len(inserts) == 1 and len(deletes) == 1
    name = inserts[0]["body"]["name"]
    assert deletes[0]["path"].split("?")[0].endswith(f"/instances/{name}")
    assert requests.index(inserts[0]) < requests.index(deletes[0])
    assert name == run.xcoms["plan_run.vm_name"]


def test_no_ssh_keys_pile_up_and_no_step_output_goes_to_xcom(happy_run, hf_token):
    run, requests = happy_run
    # The key travels in the insert body; no check pushes another one into the metadata.
    assert not [r for r in requests if "setMetadata" in r["path"]]
    # Step output stays in the task logs; only the paths the steps report reach XCom.
    step_tasks = {"install_maxtext", "start_training", "wait_for_ssh"}
    assert not [key for key in run.xcoms if key.split(".")[0] in step_tasks and not key.endswith(".phase")
                and key != "wait_for_ssh.return_value"]
    # wait_for_ssh's: the VM's public host keys it pinned (later tasks compare with them), its instance id.
    pinned = run.xcoms["wait_for_ssh.return_value"]
    vm_name = run.xcoms["plan_run.vm_name"]
    assert set(pinned) == {"host_keys", "instance_ids"} and set(pinned["host_keys"]) == {vm_name}
    assert "ssh-ed25519" in pinned["host_keys"][vm_name] and pinned["instance_ids"][vm_name]
    assert set(run.xcoms["convert_checkpoint.return_value"]) == {"base_checkpoint"}
    assert set(run.xcoms["export_to_hf.return_value"]) == {"hf_export"}
    training = run.xcoms["wait_for_final_checkpoint.return_value"]
    assert set(training) == {"final_step", "final_loss", "final_checkpoint", "vm_recoveries"}
    assert training["vm_recoveries"] == 0
    # The token is nowhere in what went to the Compute API or into XCom.
    assert hf_token not in json.dumps(requests)
    assert hf_token not in json.dumps(run.xcoms, default=str)


def test_the_exported_model_existed_on_the_vm(happy_run, local_cloud):
    run, _ = happy_run
    manifest = local_cloud.deleted_manifest(run.xcoms["plan_run.vm_name"])
    files = {entry["path"] for entry in manifest}
    for name in ("config.json", "model.safetensors.index.json", "model-00001-of-00004.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        assert any(path.endswith(f"gemma3-4b/hf-trained/{name}") for path in files), name


def test_without_an_output_location_the_export_is_copied_off_the_vm(happy_run):
    run, _ = happy_run
    record = run.xcoms["collect_outputs.return_value"]
    assert record["checkpoints_durable"] is False and record["checkpoints"] is None
    export = Path(record["hf_export"].split(":", 1)[1])
    # Sharded as MaxText exports Gemma 3 4B: the index and every shard it names were copied.
    assert (record["hf_export_layout"], len(record["hf_export_weight_files"])) == ("sharded", 4)
    assert {"config.json", "model.safetensors.index.json", *record["hf_export_weight_files"], "README.md"} <= {
        p.name for p in export.iterdir()}
    assert "final training loss" in (export / "README.md").read_text()
    assert json.loads((export.parent / "run-record.json").read_text())["run_id"] == run.run_id
    # The worker's copy of MaxText's config.json was corrected where it lies (no bucket here).
    config = json.loads((export / "config.json").read_text())
    assert (config["architectures"], config["hidden_activation"]) == (["Gemma3ForCausalLM"], "gelu_pytorch_tanh")
    assert [fix["field"] for fix in record["export_config_corrections"]] == ["hidden_activation", "rope_theta"]
    assert "the checkpoints were not durable" in run.log
    assert run.task_states["publish_to_hub"] == "success"  # nothing to publish: no hub_repo_id


def test_without_an_output_location_the_loss_curve_is_beside_the_run_record_on_the_worker(happy_run):
    run, _ = happy_run
    record = run.xcoms["collect_outputs.return_value"]
    curve = Path(record["loss_curve"].split(":", 1)[1])
    assert curve.name == "loss-curve.png" and curve.parent == Path(record["run_record"].split(":", 1)[1]).parent
    assert png_size(curve.read_bytes()) == (640, 400)
    assert record["loss_history"][-1][0] == 30
    assert record["loss_history"][-1][1] == pytest.approx(float(record["final_loss"]), abs=5e-4)  # the log's 3 decimals


def _strip(value, endpoint_prefixes, project):
    """Resource URLs without the endpoint prefix and without the project's own prefix."""
    if isinstance(value, dict):
        return {k: _strip(v, endpoint_prefixes, project) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip(v, endpoint_prefixes, project) for v in value]
    if isinstance(value, str):
        for prefix in endpoint_prefixes:
            if value.startswith(prefix):
                value = value[len(prefix) :]
        return value.removeprefix(f"projects/{project}/")
    return value


def test_insert_body_on_the_wire_equals_the_tutorials_gcloud_request(happy_run, local_cloud):
    _, requests = happy_run
    reference = json.loads(REFERENCE.read_text())
    gcloud_body = next(r["body"] for r in reference["requests"] if r["method"] == "POST")
    ours = next(
        r["body"] for r in requests if r["method"] == "POST" and r["path"].split("?")[0].endswith("/instances")
    )
    prefixes = ["http://127.0.0.1:8999/compute/v1/", local_cloud.compute_endpoint]
    gcloud_body = _strip(gcloud_body, prefixes, "my-project")
    ours = _strip(ours, prefixes, "my-project")

    for field in sorted(set(gcloud_body) | set(ours)):
        if field in EXPLAINED_DIFFERENCES:
            continue
        assert ours.get(field) == gcloud_body.get(field), f"field {field!r} differs from gcloud's request"
    assert set(ours) - set(gcloud_body) <= set(EXPLAINED_DIFFERENCES), set(ours) - set(gcloud_body)
    # The explained differences are what they claim to be.
    assert ours["tags"] == {"items": ["maxtext-sft"]}
    assert ours["labels"]["managed-by"] == "airflow-maxtext-sft"
    assert int(ours["labels"]["expires-at"]) > 0
    lifetime = ours["scheduling"].pop("maxRunDuration")
    assert ours["scheduling"] == gcloud_body["scheduling"]
    assert int(lifetime["seconds"]) == (60 + 60 + 12 * 60 + 60 + 30) * 60  # the steps' limits, plus 30 min
    assert ours["serviceAccounts"][0]["scopes"] == ["https://www.googleapis.com/auth/cloud-platform"]
    metadata = {item["key"]: item["value"] for item in ours["metadata"]["items"]}
    assert set(metadata) == {"ssh-keys", "enable-guest-attributes", "airflow-dag-id", "airflow-run-id"}
    assert metadata["enable-guest-attributes"] == "TRUE"


def test_training_crash_fails_the_sensor_at_once_and_still_deletes_the_vm(run_pipeline, local_cloud, hf_token):
    run = run_pipeline(
        {"training_timeout_hours": 1, "steps": 40},
        maxtext_faults={"train_sft": {"crash_at_step": 7}},
    )
    log = run.log
    # The first check that saw the dead process failed the sensor (an hour before its timeout) ...
    assert len(re.findall(r"Training \S+: state failed, last step 6,", log)) == 1
    assert "Training " not in log.split("state failed, last step 6,")[1].split("Task failed with exception")[0]
    # ... with the reason and the training log's tail (MaxText's traceback) in its error.
    error = log[log.index("ended without its final checkpoint") - 300 :]
    assert "training exited with code 1 after step 6" in error
    assert "Traceback (most recent call last)" in error
    assert "AirflowSensorTimeout" not in log
    assert hf_token not in log  # the task logs never show the token
    assert run.state == "failed", run.report()
    assert run.task_states["wait_for_final_checkpoint"] == "failed"
    assert run.task_states["export_to_hf"] == "upstream_failed"
    assert run.task_states["delete_vm"] == "success"
    assert run.task_states["check_run_outcome"] == "failed"
    assert local_cloud.vms() == []
    assert len(instance_requests(local_cloud, "DELETE")) == 1


def test_a_create_that_fails_after_the_insert_was_accepted_is_still_deleted(run_pipeline, local_cloud):
    fault = {"insert_fails_after_accept": {"code": "ZONE_RESOURCE_POOL_EXHAUSTED", "leave_instance": True}}
    run = run_pipeline(cloud_faults=fault)
    assert run.state == "failed", run.report()
    assert run.task_states["create_vm"] == "failed"
    assert run.task_states["wait_for_ssh"] == "upstream_failed"
    assert run.task_states["delete_vm"] == "success"
    assert run.task_states["check_run_outcome"] == "failed"
    name = run.xcoms["plan_run.vm_name"]
    deletes = [r for r in instance_requests(local_cloud, "DELETE") if r["path"].split("?")[0].endswith(name)]
    assert deletes and deletes[-1]["status"] == 200  # the teardown deleted the instance the failed create left
    assert local_cloud.vms() == []


def test_a_retried_create_replaces_the_instance_a_failed_insert_left(run_pipeline, local_cloud):
    fault = {"insert_fails_after_accept": {"code": "ZONE_RESOURCE_POOL_EXHAUSTED", "leave_instance": True, "count": 1}}
    run = run_pipeline(cloud_faults=fault)
    assert run.state == "success", run.report()
    inserts = instance_requests(local_cloud, "POST")
    inserts = [r for r in inserts if r["path"].split("?")[0].endswith("/instances")]
    assert len(inserts) == 2  # the failed one, then the retry after deleting its leftover
    assert len({r["body"]["name"] for r in inserts}) == 1
    assert local_cloud.vms() == []


def test_training_that_stops_early_with_exit_code_0_fails_the_run_naming_why(run_pipeline, local_cloud):
    run = run_pipeline({"steps": 40}, maxtext_faults={"train_sft": {"out_of_data_at_step": 9}})
    log = run.log
    assert run.state == "failed", run.report()
    assert run.task_states["wait_for_final_checkpoint"] == "failed"
    assert run.task_states["export_to_hf"] == "upstream_failed"
    assert "training exited 0 after step 8 of 40: the dataset ran out of training data" in log
    assert (
        "The fine-tune did not complete (collect_outputs=upstream_failed, export_to_hf=upstream_failed, "
        "publish_to_hub=upstream_failed, wait_for_final_checkpoint=failed)"
    ) in log
    assert local_cloud.vms() == []


def test_an_invalid_conf_fails_before_any_compute_request(run_pipeline, local_cloud):
    # A value only plan_run refuses (the schema takes any key=value): a missing reservation is
    # refused earlier now, when the run is created (test_invalid_conf).
    run = run_pipeline({"train_extra_args": ["run_name=mine"]})
    assert run.state == "failed", run.report()
    assert run.task_states["plan_run"] == "failed"
    assert run.task_states["create_vm"] == "upstream_failed"
    # No VM can exist, so the teardowns do not run; the run's state comes from the work tasks.
    assert run.task_states["delete_vm"] in ("skipped", "upstream_failed")
    assert "Invalid run configuration: Param 'train_extra_args': 'run_name' is set by the pipeline" in run.log
    assert local_cloud.requests() == []
