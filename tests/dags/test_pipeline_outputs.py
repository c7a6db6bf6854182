"""Outputs leave the VM: checkpoints and the export in storage, the model published to the Hub.

Whole DAG runs through `dag.test()` against the local cloud (Compute, GCS and Hub emulators) with
the fast MaxText stand-in.
"""

from __future__ import annotations

import copy
import json
import re
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml
from huggingface_hub import HfApi

from airflow.sdk.exceptions import AirflowException, AirflowFailException
from localcloud.connections import LOCAL_BUCKET, LOCAL_HUB_USER
from maxtext_sft.results.outputs import published_eval_loss
from maxtext_sft.run.spec import RunSpec
from tests.conftest import local_bucket
from tests.dags.conftest import parse_pipeline_dag
from tests.plugins.test_loss_curve import png_size

pytestmark = pytest.mark.e2e

BUCKET = LOCAL_BUCKET
HUB_REPO = f"{LOCAL_HUB_USER}/gemma-sft"


@pytest.fixture(scope="module")
def bucket(local_cloud):
    return local_bucket(local_cloud, BUCKET)


@pytest.fixture(scope="module")
def hub(local_cloud, hf_token):
    return HfApi(endpoint=local_cloud.hub.endpoint, token=hf_token)


def names(bucket, prefix: str) -> set[str]:
    return {blob.name[len(prefix) :] for blob in bucket.list_blobs(prefix=prefix)}


@pytest.fixture(scope="module")
def durable_run(run_pipeline, local_cloud, bucket):
    conf = {"output_location": f"gs://{BUCKET}/sft", "hub_repo_id": HUB_REPO, "steps": 12}
    run = run_pipeline(conf)
    return run, local_cloud.requests()


def test_checkpoints_export_card_and_record_are_in_the_bucket(durable_run, bucket, local_cloud):
    run, _ = durable_run
    assert run.state == "success", run.report()
    assert local_cloud.vms() == []
    spec = run.xcoms["plan_run.spec"]
    run_prefix = f"sft/runs/{spec['run_name']}/"
    stored = names(bucket, run_prefix)
    # A checkpoint every 2 steps (a tenth of 12, rounded up), the newest two kept (checkpoints_kept).
    committed = sorted(int(m.group(1)) for n in stored if (m := re.fullmatch(r"checkpoints/(\d+)/commit_success\.txt", n)))
    assert committed == [10, 12], sorted(stored)
    assert not any(n.startswith(("checkpoints/1/", "checkpoints/8/")) for n in stored)
    assert "Deleted checkpoint step 8 " in run.log
    # Sharded, as MaxText exports Gemma 3 4B: the index and every shard it names.
    shards = [f"hf-export/model-0000{n}-of-00004.safetensors" for n in range(1, 5)]
    assert {"hf-export/config.json", "hf-export/model.safetensors.index.json", *shards, "hf-export/README.md",
            "run-record.json"} <= stored
    assert "hf-export/model.safetensors" not in stored
    record = json.loads(bucket.blob(run_prefix + "run-record.json").download_as_bytes())
    assert record["hf_export_layout"] == "sharded"
    assert record["hf_export_weight_files"] == [name.removeprefix("hf-export/") for name in shards]
    assert record["checkpoints_durable"] is True
    assert record["checkpoints"] == f"gs://{BUCKET}/{run_prefix}checkpoints"
    assert record["training_log"] == f"gs://{BUCKET}/{run_prefix}training.log"
    assert record["hf_export"] == f"gs://{BUCKET}/{run_prefix}hf-export"
    assert record["base_checkpoint"].startswith(f"gs://{BUCKET}/sft/base-checkpoints/gemma3-4b/")
    assert record == run.xcoms["collect_outputs.return_value"]
    card = bucket.blob(run_prefix + "hf-export/README.md").download_as_text()
    assert "12 steps, final training loss" in card
    assert "| Weights | 4 safetensors shards, indexed by `model.safetensors.index.json` |" in card


def test_the_loss_curve_and_the_loss_history_are_beside_the_run_record(durable_run, bucket):
    run, _ = durable_run
    run_prefix = f"sft/runs/{run.xcoms['plan_run.spec']['run_name']}/"
    record = run.xcoms["collect_outputs.return_value"]
    assert record["run_record"] == f"gs://{BUCKET}/{run_prefix}run-record.json"
    assert record["loss_curve"] == f"gs://{BUCKET}/{run_prefix}loss-curve.png"
    history = record["loss_history"]
    assert [step for step, _ in history] == list(range(1, 13))  # every step MaxText's metrics file has
    assert history[-1][1] == pytest.approx(float(record["final_loss"]), abs=5e-4)  # the log prints 3 decimals
    # The held-out evaluation: before the first step (the base model) and after the last.
    assert [step for step, _ in record["eval_history"]] == [0, 12]
    assert record["eval_split"] == "test_sft"
    assert record["eval_loss"]["tuned"] < record["eval_loss"]["base"]
    # The metrics file itself outlives the VM, beside the run record.
    assert bucket.blob(run_prefix + "training-metrics.jsonl").exists()
    assert png_size(bucket.blob(run_prefix + "loss-curve.png").download_as_bytes()) == (640, 400)


def test_the_vm_was_deleted_after_the_upload_finished(durable_run, bucket):
    run, requests = durable_run
    spec = run.xcoms["plan_run.spec"]
    export = list(bucket.list_blobs(prefix=f"sft/runs/{spec['run_name']}/hf-export/"))
    last_upload = max(blob.updated for blob in export if blob.name.endswith(".safetensors"))
    delete = next(r for r in requests if r["method"] == "DELETE" and "/instances/" in r["path"])
    assert last_upload < datetime.fromisoformat(delete["time"].replace("Z", "+00:00"))


def test_the_hub_repo_has_one_commit_with_the_export_and_the_card(durable_run, hub):
    run, _ = durable_run
    commits = hub.list_repo_commits(HUB_REPO)
    ours = [c for c in commits if run.run_id in c.title]
    assert len(ours) == 1 and commits[0].commit_id == ours[0].commit_id
    assert run.xcoms["publish_to_hub.return_value"]["commit"] == ours[0].commit_id
    files = set(hub.list_repo_files(HUB_REPO))
    weights = run.xcoms["collect_outputs.return_value"]["hf_export_weight_files"]
    assert {"config.json", "model.safetensors.index.json", *weights, "tokenizer.json", "README.md"} <= files
    assert len(weights) == 4
    card = hub.hf_hub_download(HUB_REPO, "README.md")
    metadata = yaml.safe_load(open(card).read().split("---\n")[1])
    assert metadata["base_model"] == "google/gemma-3-4b-it"
    assert metadata["license"] == "gemma"
    assert metadata["datasets"] == ["HuggingFaceH4/ultrachat_200k"]
    assert hub.model_info(HUB_REPO).private is True


def test_the_published_config_has_the_activation_gemma_3_was_trained_with_and_says_so(durable_run, hub, bucket):
    # MaxText 0.2.2 exports gemma3-4b's text config with "gelu" (the stand-in too): collect_outputs
    # corrected it in the bucket before publishing, and the card and the record name the fix. The
    # config is the text model's: export_to_hf published the text-only export as Gemma3ForCausalLM.
    run, _ = durable_run
    config = json.loads(Path(hub.hf_hub_download(HUB_REPO, "config.json")).read_text())
    assert (config["architectures"], config["model_type"]) == (["Gemma3ForCausalLM"], "gemma3_text")
    assert config["hidden_activation"] == "gelu_pytorch_tanh"
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 1_000_000.0
    index = json.loads(Path(hub.hf_hub_download(HUB_REPO, "model.safetensors.index.json")).read_text())
    assert sorted(index["weight_map"]) == ["model.embed_tokens.weight", *(
        f"model.layers.{i}.self_attn.q_proj.weight" for i in range(4)), "model.norm.weight"]
    record = run.xcoms["collect_outputs.return_value"]
    assert record["hf_export_architecture"] == "Gemma3ForCausalLM"
    assert [(fix["field"], fix["was"], fix["now"]) for fix in record["export_config_corrections"]] == [
        ("hidden_activation", "gelu", "gelu_pytorch_tanh"), ("rope_theta", 10_000.0, 1_000_000.0)]
    assert record["export_config_corrections"][0]["source"] == "AI-Hypercomputer/maxtext#2867"
    stored = json.loads(bucket.blob(record["run_record"].removeprefix(f"gs://{BUCKET}/")).download_as_text())
    assert stored["export_config_corrections"] == record["export_config_corrections"]
    card = Path(hub.hf_hub_download(HUB_REPO, "README.md")).read_text()
    assert "| config.json corrected | MaxText 0.2.2 exported `hidden_activation` 'gelu' -> 'gelu_pytorch_tanh' " \
           "(AI-Hypercomputer/maxtext#2867);" in card
    assert "| Architecture | `Gemma3ForCausalLM`, Gemma 3's text model" in card


def test_an_export_config_nobody_knows_is_wrong_fails_before_publishing(run_pipeline, hub, local_cloud):
    before = [c.commit_id for c in hub.list_repo_commits(HUB_REPO)]
    run = run_pipeline(
        {"output_location": f"gs://{BUCKET}/sft", "hub_repo_id": HUB_REPO, "steps": 3},
        maxtext_faults={"to_huggingface": {"config_text_fields": {"rms_norm_eps": 1e-5}}},
    )
    assert run.state == "failed"
    assert run.task_states["collect_outputs"] == "failed"
    assert run.task_states["publish_to_hub"] != "success"
    assert run.task_states["delete_vm"] == "success"
    assert "rms_norm_eps: the export has 1e-05, the base model's 1e-06" in run.log
    assert run.try_numbers["collect_outputs"] == 1  # not retried: the export will not change
    assert [c.commit_id for c in hub.list_repo_commits(HUB_REPO)] == before
    assert local_cloud.vms() == []


def test_running_the_publish_task_again_adds_no_commit(durable_run, hub):
    run, _ = durable_run
    before = [c.commit_id for c in hub.list_repo_commits(HUB_REPO)]
    task = copy.copy(parse_pipeline_dag().get_task("publish_to_hub"))
    task.spec, task.record = run.xcoms["plan_run.spec"], run.xcoms["collect_outputs.return_value"]
    result = task.execute(context={})
    assert result["commit"] == before[0]
    assert [c.commit_id for c in hub.list_repo_commits(HUB_REPO)] == before


@pytest.fixture
def export_without_a_shard(durable_run, bucket):
    """The durable run's export copied under another output location without its second shard;
    returns the run's spec pointing there."""
    run, _ = durable_run
    spec = dict(run.xcoms["plan_run.spec"], output_location=f"gs://{BUCKET}/broken-export")
    source = f"sft/runs/{spec['run_name']}/hf-export/"
    for blob in bucket.list_blobs(prefix=source):
        if not blob.name.endswith("model-00002-of-00004.safetensors"):
            bucket.copy_blob(blob, bucket, f"broken-export/runs/{spec['run_name']}/hf-export/{blob.name[len(source):]}")
    return spec


def test_collect_outputs_refuses_an_export_missing_a_shard(durable_run, export_without_a_shard, bucket):
    run, _ = durable_run
    task = copy.copy(parse_pipeline_dag().get_task("collect_outputs"))
    task.spec, task.training = export_without_a_shard, run.xcoms["wait_for_final_checkpoint.return_value"]
    task.base_checkpoint, task.export = None, None
    with pytest.raises(AirflowException, match=(
        r"The export in gs://.*/broken-export/runs/.*/hf-export is incomplete: the shards "
        r"\['model-00002-of-00004.safetensors'\] named by model.safetensors.index.json are missing"
    )):
        task.execute(context={})
    assert not list(bucket.list_blobs(prefix=f"broken-export/runs/{export_without_a_shard['run_name']}/run-record"))


def test_publish_refuses_an_export_missing_a_shard(durable_run, export_without_a_shard, hub):
    run, _ = durable_run
    before = [c.commit_id for c in hub.list_repo_commits(HUB_REPO)]
    task = copy.copy(parse_pipeline_dag().get_task("publish_to_hub"))
    task.spec = dict(export_without_a_shard, run_id="manual__another_run")  # not published yet
    export = RunSpec.from_dict(export_without_a_shard).hf_export_uri
    task.record = dict(run.xcoms["collect_outputs.return_value"], hf_export=export)
    with pytest.raises(AirflowFailException, match=f"Not publishing to {HUB_REPO}: the export at {export} is incomplete"):
        task.execute(context={})
    assert [c.commit_id for c in hub.list_repo_commits(HUB_REPO)] == before


def tree(hub, repo: str) -> dict[str, tuple]:
    """{path: (size, LFS sha256 or git blob id)} of every file on the repo's main branch."""
    return {f.path: (f.size, f.lfs.sha256 if f.lfs else f.blob_id)
            for f in hub.list_repo_tree(repo, recursive=True) if hasattr(f, "blob_id")}


def test_publishing_holds_one_file_of_the_export_at_a_time_and_commits_what_upload_folder_did(
    durable_run, hub, monkeypatch, tmp_path
):
    """The worker's scratch folder peaks at the largest file of the export, not at the whole
    export, and the one commit holds the same files as upload_folder of the whole export."""
    from maxtext_sft.cloud.export_files import export_folder
    from maxtext_sft.cloud.storage import StorageEndpointHook

    run, _ = durable_run
    record = run.xcoms["collect_outputs.return_value"]
    sizes = StorageEndpointHook(gcp_conn_id="google_cloud_default").sizes_under(record["hf_export"])
    scratch_root = tmp_path / "worker-tmp"
    scratch_root.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch_root))  # every scratch folder of the task lands here
    peaks = []
    real_download = StorageEndpointHook.download

    def download_and_measure(self, bucket_name, object_name, filename=None, **kwargs):
        result = real_download(self, bucket_name, object_name, filename=filename, **kwargs)
        # Files reach the scratch folder only here: its size just after each download is its peak.
        peaks.append(sum(f.stat().st_size for f in scratch_root.rglob("*") if f.is_file()))
        return result

    monkeypatch.setattr(StorageEndpointHook, "download", download_and_measure)
    repo = f"{LOCAL_HUB_USER}/gemma-sft-one-at-a-time"
    task = copy.copy(parse_pipeline_dag().get_task("publish_to_hub"))
    task.spec = dict(run.xcoms["plan_run.spec"], hub_repo_id=repo)
    task.record = record
    result = task.execute(context={})
    one_at_a_time = max(peaks)

    # Before: the whole export downloaded to the worker, then upload_folder (into another repo).
    peaks.clear()
    folder = export_folder(record["hf_export"], scratch_root / "whole", gcp_conn_id="google_cloud_default")
    whole = max(peaks)
    hub.create_repo(f"{LOCAL_HUB_USER}/gemma-sft-whole-folder", private=True)
    hub.upload_folder(repo_id=f"{LOCAL_HUB_USER}/gemma-sft-whole-folder", folder_path=folder, commit_message="whole")

    print(f"export: {len(sizes)} files, {sum(sizes.values())} bytes, largest {max(sizes.values())}; peak scratch: "
          f"{whole} bytes downloading it whole, {one_at_a_time} bytes one file at a time")
    assert whole == sum(sizes.values())
    assert one_at_a_time == max(sizes.values()) < sum(sizes.values()) / 2
    commits = hub.list_repo_commits(repo)
    assert len(commits) == 2 and run.run_id in commits[0].title and result["commit"] == commits[0].commit_id
    assert tree(hub, repo) == tree(hub, f"{LOCAL_HUB_USER}/gemma-sft-whole-folder") == tree(hub, HUB_REPO)
    assert set(tree(hub, repo)) == {".gitattributes", *sizes}
    assert not list(scratch_root.glob("maxtext-sft-publish-*"))  # the scratch folder is gone


def test_a_second_run_of_the_same_base_model_skips_conversion(durable_run, run_pipeline, local_cloud, bucket):
    first, _ = durable_run
    attempts_before = names(bucket, "sft/base-checkpoints/")
    second = run_pipeline({"output_location": f"gs://{BUCKET}/sft", "steps": 3})
    assert second.state == "success", second.task_states
    assert second.xcoms["convert_checkpoint.return_value"] == first.xcoms["convert_checkpoint.return_value"]
    assert "was converted before" in second.log
    # Skipped, not just fast: the converter never ran on the second VM and nothing was uploaded.
    shm = local_cloud.deleted_manifest(second.xcoms["plan_run.vm_name"])
    assert not [entry for entry in shm if "mt-format" in entry["path"]]
    assert names(bucket, "sft/base-checkpoints/") == attempts_before
    assert len([n for n in attempts_before if n.endswith("COMPLETE.json")]) == 1


def test_a_diverged_run_publishes_nothing_and_fails_saying_why(durable_run, run_pipeline, hub, local_cloud):
    # durable_run published to the repo first: its commits are what must not change.
    before = [c.commit_id for c in hub.list_repo_commits(HUB_REPO)]
    run = run_pipeline(
        {"output_location": f"gs://{BUCKET}/sft", "hub_repo_id": HUB_REPO, "steps": 4},
        maxtext_faults={"train_sft": {"loss_nan_from_step": 3}},
    )
    assert run.state == "failed"
    assert run.task_states["publish_to_hub"] == "failed"
    assert run.task_states["delete_vm"] == "success"
    assert f"Not publishing to {HUB_REPO}: the final loss is nan: the training diverged" in run.log
    assert [c.commit_id for c in hub.list_repo_commits(HUB_REPO)] == before
    assert local_cloud.vms() == []


def test_a_model_worse_on_held_out_data_is_not_published_and_the_run_succeeds_saying_why(
    durable_run, run_pipeline, hub, local_cloud
):
    before = [c.commit_id for c in hub.list_repo_commits(HUB_REPO)]
    run = run_pipeline(
        {"output_location": f"gs://{BUCKET}/sft", "hub_repo_id": HUB_REPO, "steps": 4},
        maxtext_faults={"train_sft": {"eval_loss_rises": True}},
    )
    assert run.state == "success", run.report()
    published = run.xcoms["publish_to_hub.return_value"]
    assert published["published"] is False
    assert "the tuned model's eval loss" in published["reason"] and "is not below the base model's" in published["reason"]
    assert [c.commit_id for c in hub.list_repo_commits(HUB_REPO)] == before
    assert f"Not published: {published['reason']}" in run.log  # the run summary says why


def test_a_model_not_better_than_the_last_published_one_by_the_margin_is_not_published(
    durable_run, run_pipeline, hub, local_cloud
):
    # The durable run published 12 steps; 4 steps leave the stand-in's eval loss higher than that.
    last = published_eval_loss(
        Path(hub.hf_hub_download(HUB_REPO, "README.md")).read_text(), RunSpec.from_dict(durable_run[0].xcoms["plan_run.spec"])
    )
    assert last is not None
    before = [c.commit_id for c in hub.list_repo_commits(HUB_REPO)]
    run = run_pipeline({"output_location": f"gs://{BUCKET}/sft", "hub_repo_id": HUB_REPO, "steps": 4,
                        "hub_min_eval_improvement": 0.001})
    assert run.state == "success", run.report()
    reason = run.xcoms["publish_to_hub.return_value"]["reason"]
    assert f"is not 0.001 or more below {last:.4g}, the eval loss of the model last published to {HUB_REPO}@main" in reason
    assert [c.commit_id for c in hub.list_repo_commits(HUB_REPO)] == before


def test_a_half_written_final_step_is_not_taken_as_done(run_pipeline, local_cloud):
    run = run_pipeline(
        {"output_location": f"gs://{BUCKET}/sft", "steps": 5},
        maxtext_faults={"train_sft": {"partial_checkpoint_exit_at_step": 5}},
    )
    assert run.state == "failed"
    assert run.task_states["wait_for_final_checkpoint"] == "failed"
    assert run.task_states["export_to_hf"] == "upstream_failed"
    assert "step 5 has no commit_success.txt in storage" in run.log
    assert local_cloud.vms() == []


def test_a_dataset_in_a_bucket_is_the_folder_of_the_runs_date_and_its_files_are_recorded(
    run_pipeline, bucket, local_cloud
):
    # dag.test() runs at "now": {{ ds }} is today's date. Yesterday's folder must not be read.
    today = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    for day in (today, "2020-01-01"):
        bucket.blob(f"chats/{day}/data/train_sft-00000-of-00001.parquet").upload_from_string(f"chats of {day}")
    bucket.blob(f"chats/{today}/data/test_sft-00000-of-00001.parquet").upload_from_string("not trained on")
    run = run_pipeline({"dataset_name": f"gs://{BUCKET}/chats/{{{{ ds }}}}", "steps": 3})
    assert run.state == "success", run.report()
    spec = run.xcoms["plan_run.spec"]
    assert spec["dataset_name"] == f"gs://{BUCKET}/chats/{today}"
    assert run.xcoms["collect_outputs.return_value"]["dataset_files"] == ["data/train_sft-00000-of-00001.parquet"]
    args = RunSpec.from_dict(spec).train_args()
    assert f"hf_train_files=gs://{BUCKET}/chats/{today}/data/train_sft-*.parquet" in args and "hf_path=parquet" in args

    # A date with no folder: preflight names it, before any VM.
    local_cloud.clear_requests()
    empty = run_pipeline({"dataset_name": f"gs://{BUCKET}/chats/{{{{ ds_nodash }}}}", "steps": 3})
    assert empty.state == "failed" and empty.task_states["preflight"] == "failed"
    assert f"dataset folder gs://{BUCKET}/chats/{today.replace('-', '')} has no files data/train_sft-*.parquet" in empty.log
    assert [r for r in local_cloud.requests() if r["method"] == "POST"] == []
