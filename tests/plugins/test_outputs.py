"""The model card, the run record and the publishing gate (pure functions of the spec)."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from huggingface_hub import ModelCard

from maxtext_sft.results.outputs import (
    ExportLayoutError,
    FinalLossError,
    check_export_folder,
    check_export_layout,
    check_final_loss,
    eval_gate,
    hub_commit_title,
    model_card,
    published_eval_loss,
    run_record,
)
from maxtext_sft.results.training_metrics import parse_metrics
from tests.plugins.test_spec import RUN_ID, make_spec


def card_metadata(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_the_card_names_base_model_licence_dataset_revision_steps_loss_and_maxtext():
    spec = make_spec(hub_repo_id="team/gemma-sft", dataset_revision="0123abc", steps=30)
    card = model_card(spec, final_step=30, final_loss="1.2345")
    metadata = card_metadata(card)
    assert metadata["base_model"] == "google/gemma-3-4b-it"
    assert metadata["license"] == "gemma"
    assert metadata["datasets"] == ["HuggingFaceH4/ultrachat_200k"]
    assert metadata["dataset_revision"] == "0123abc"
    body = card.split("---\n", 2)[2]
    assert "30 steps, final training loss 1.2345" in body
    assert "MaxText 0.2.2" in body
    assert RUN_ID in body


def test_a_folder_dataset_is_described_not_listed_as_a_hub_dataset():
    card = model_card(make_spec(dataset_name="/data/chats"), final_step=5, final_loss="2.0")
    assert "datasets" not in card_metadata(card)
    assert "the folder `/data/chats` on the VM" in card


@pytest.mark.parametrize(
    ("loss", "limit", "reason"),
    [
        ("nan", None, "diverged"),
        ("inf", None, "diverged"),
        ("-inf", None, "diverged"),
        (None, None, "no final loss"),
        ("none", None, "no final loss"),
        ("2.5", 2.0, "above hub_max_final_loss=2.0"),
    ],
)
def test_the_gate_refuses_what_must_not_be_published(loss, limit, reason):
    with pytest.raises(FinalLossError, match=reason):
        check_final_loss(loss, limit)


def test_the_gate_passes_a_finite_loss_within_the_limit():
    assert check_final_loss("1.5", 2.0) == 1.5
    assert check_final_loss(1.5, None) == 1.5
    assert not math.isnan(check_final_loss("0", 0.0))


def test_the_commit_title_names_the_dag_run_and_generation():
    assert hub_commit_title(make_spec()) == f"Fine-tune from Airflow DAG run maxtext_sft/{RUN_ID} (generation 0)"
    assert hub_commit_title(make_spec(generation=1)) != hub_commit_title(make_spec())


def test_the_record_says_whether_checkpoints_were_durable():
    durable = make_spec(output_location="gs://bkt/p")
    record = run_record(durable, training={"final_step": 3, "final_loss": "1.0"}, base_checkpoint="gs://c",
                        hf_export=durable.hf_export_uri)
    assert record["checkpoints"] == durable.checkpoints_dir and record["checkpoints_durable"] is True
    assert record["training_log"] == f"{durable.run_output_dir}/training.log"
    assert record["model_card"] == f"{durable.hf_export_uri}/README.md"
    local = make_spec()
    record = run_record(local, training={}, base_checkpoint=None, hf_export="host:/x")
    assert record["checkpoints"] is None and record["checkpoints_durable"] is False
    assert record["training_log"] is None  # no storage: the full log stays on the VM


def test_the_record_keeps_the_losses_the_eval_results_and_where_they_and_the_chart_went():
    spec = make_spec(output_location="gs://bkt/p", steps=3)
    metrics = parse_metrics([
        metrics_line(0, **{"eval/avg_loss": 2.9}),
        metrics_line(1, **{"learning/loss": 2.5}),
        metrics_line(2, **{"learning/loss": math.nan}),
        metrics_line(3, **{"learning/loss": 1.5}),
        metrics_line(3, **{"eval/avg_loss": 2.1}),
    ])
    record = run_record(spec, training={"final_step": 3, "final_loss": "1.5"}, base_checkpoint=None,
                        hf_export=spec.hf_export_uri, location=spec.run_record_uri, metrics=metrics,
                        loss_curve=f"{spec.run_output_dir}/loss-curve.png")
    assert record["run_record"] == f"gs://bkt/p/runs/{spec.run_name}/run-record.json"
    assert record["loss_history"] == [[1, 2.5], [2, None], [3, 1.5]]
    assert record["eval_history"] == [[0, 2.9], [3, 2.1]]
    assert (record["eval_split"], record["eval_loss"]) == ("test_sft", {"base": 2.9, "tuned": 2.1})
    assert record["loss_curve"] == f"gs://bkt/p/runs/{spec.run_name}/loss-curve.png"
    assert json.loads(json.dumps(record, allow_nan=False))["loss_history"] == record["loss_history"]  # strict JSON


def metrics_line(step: int, **scalars) -> str:
    """A line as MaxText 0.2.2's write_metrics_locally writes it."""
    return json.dumps({**scalars, "step": float(step), "run_name": "run"})


def test_metrics_are_by_step_the_last_write_of_a_step_winning_and_broken_lines_skipped():
    metrics = parse_metrics([
        metrics_line(0, **{"eval/avg_loss": 3.0, "eval/total_loss": 75.0}),
        metrics_line(1, **{"learning/loss": 2.8, "learning/total_weights": 200.0}),
        metrics_line(2, **{"learning/loss": 2.6}),
        metrics_line(2, **{"learning/loss": 2.5}),  # resumed from step 1 on the same VM: step 2 again
        '{"learning/loss": 2.4, "step": 3.0, "run_na',  # cut by a crash
        "not json",
        metrics_line(4, **{"learning/loss": math.inf}),
        metrics_line(4, **{"eval/avg_loss": 2.2}),
    ])
    assert metrics.train == [[1, 2.8], [2, 2.5], [4, None]]
    assert metrics.eval == [[0, 3.0], [4, 2.2]]
    assert metrics.eval_results(4) == {"base": 3.0, "tuned": 2.2}
    assert metrics.eval_results(5) == {"base": 3.0, "tuned": None}  # no evaluation after the final step
    assert parse_metrics([metrics_line(7, **{"eval/avg_loss": 2.0})]).eval_results(7) == {"base": None, "tuned": 2.0}


def test_the_card_reports_the_tuned_eval_loss_as_model_index_the_hub_parser_reads():
    spec = make_spec(hub_repo_id="team/gemma-sft", dataset_revision="0123abc", steps=30)
    card = model_card(spec, final_step=30, final_loss="1.2", eval_loss={"base": 2.5, "tuned": 1.9})
    [result] = ModelCard(card).data.eval_results  # huggingface_hub's own model-index parser
    assert (result.metric_type, result.metric_value, result.task_type) == ("loss", 1.9, "text-generation")
    assert (result.dataset_type, result.dataset_split, result.dataset_revision) == (
        "HuggingFaceH4/ultrachat_200k", "test_sft", "0123abc")
    assert card_metadata(card)["model-index"][0]["name"] == "team/gemma-sft"
    assert "base model 2.5000, tuned 1.9000 (split `test_sft`, 25 batches)" in card
    assert published_eval_loss(card, spec) == 1.9
    # Another split, or no evaluation at all: nothing to compare with.
    assert published_eval_loss(card, make_spec(hub_repo_id="team/gemma-sft", eval_split="other")) is None
    unevaluated = model_card(make_spec(eval_split=None), final_step=30, final_loss="1.2")
    assert ModelCard(unevaluated).data.eval_results is None
    assert "not evaluated (Param eval_split empty)" in unevaluated
    assert published_eval_loss(unevaluated, spec) is None
    assert published_eval_loss("no front matter at all", spec) is None


@pytest.mark.parametrize(
    ("conf", "eval_loss", "last_published", "reason"),
    [
        ({}, {"base": 2.0, "tuned": 2.0}, None, "eval loss 2 is not below the base model's 2 on test_sft"),
        ({}, {"base": 2.0, "tuned": 2.1}, None, "is not below the base model's"),
        ({}, {"base": None, "tuned": 1.5}, None, "base model's eval loss on test_sft was not measured"),
        ({}, {"base": 2.0, "tuned": None}, None, "tuned model's eval loss on test_sft was not measured"),
        ({}, None, None, "tuned model's eval loss on test_sft was not measured"),
        ({}, {"base": 2.0, "tuned": 1.5}, 1.4, "not 0 or more below 1.4, the eval loss of the model last published"),
        ({"hub_min_eval_improvement": 0.1}, {"base": 2.0, "tuned": 1.5}, 1.55, "not 0.1 or more below 1.55"),
    ],
)
def test_the_eval_gate_says_why_a_model_is_not_published(conf, eval_loss, last_published, reason):
    spec = make_spec(hub_repo_id="team/gemma-sft", **conf)
    assert reason in eval_gate(spec, eval_loss, last_published)


@pytest.mark.parametrize(
    ("conf", "eval_loss", "last_published"),
    [
        ({}, {"base": 2.0, "tuned": 1.5}, None),  # the first publication: beats the base model
        ({}, {"base": 2.0, "tuned": 1.5}, 1.5),  # as good as the last one, no margin asked
        ({"hub_min_eval_improvement": 0.1}, {"base": 2.0, "tuned": 1.4}, 1.5),
        ({"eval_split": None}, None, 1.0),  # not evaluated: not gated
    ],
)
def test_the_eval_gate_lets_a_better_model_through(conf, eval_loss, last_published):
    assert eval_gate(make_spec(hub_repo_id="team/gemma-sft", **conf), eval_loss, last_published) is None


# ----- the export's layout: one model.safetensors, or the index and its shards ----------------

SHARDS = ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]


def sharded_index(shards: list[str]) -> str:
    """An index as MaxText writes it: each tensor named with its shard."""
    weight_map = {f"layers.{i}.weight": shard for i, shard in enumerate(shards)}
    return json.dumps({"metadata": {"total_size": 8 * len(shards)}, "weight_map": weight_map})


def write_export(folder, layout: str = "sharded", shards: list[str] = SHARDS) -> None:
    """An export folder as to_huggingface leaves it (tokenizer files included), in either layout."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "gemma3"}')
    (folder / "tokenizer.json").write_text("{}")
    if layout == "single":
        (folder / "model.safetensors").write_bytes(b"weights")
        return
    (folder / "model.safetensors.index.json").write_text(sharded_index(shards))
    for shard in shards:
        (folder / shard).write_bytes(b"weights")


def layout_of(files: dict[str, int], index: str | None = None):
    return check_export_layout({**files, **({"model.safetensors.index.json": len(index)} if index else {})},
                               lambda name: {"model.safetensors.index.json": index}[name])


def test_a_single_file_export_is_its_model_safetensors():
    export = layout_of({"config.json": 20, "model.safetensors": 100, "tokenizer.json": 5})
    assert (export.layout, export.weight_files) == ("single", ("model.safetensors",))


def test_a_sharded_export_is_its_index_and_every_shard_it_names():
    export = layout_of({"config.json": 20, **dict.fromkeys(reversed(SHARDS), 100)}, sharded_index(SHARDS))
    assert (export.layout, export.weight_files) == ("sharded", tuple(SHARDS))
    assert export.describe() == "3 safetensors shards, indexed by `model.safetensors.index.json`"


def test_a_local_folder_is_checked_the_same_way(tmp_path):
    write_export(tmp_path / "sharded")
    assert check_export_folder(tmp_path / "sharded").weight_files == tuple(SHARDS)
    write_export(tmp_path / "single", "single")
    assert check_export_folder(tmp_path / "single").layout == "single"
    (tmp_path / "sharded" / SHARDS[1]).unlink()
    with pytest.raises(ExportLayoutError, match="model-00002-of-00003.safetensors"):
        check_export_folder(tmp_path / "sharded")


@pytest.mark.parametrize(
    ("files", "index", "error"),
    [
        ({"config.json": 2, SHARDS[0]: 9, SHARDS[2]: 9}, sharded_index(SHARDS),
         r"the shards \['model-00002-of-00003.safetensors'\] named by model.safetensors.index.json are missing"),
        ({"config.json": 2, SHARDS[0]: 9, SHARDS[1]: 0, SHARDS[2]: 9}, sharded_index(SHARDS),
         r"the shards \['model-00002-of-00003.safetensors'\] named by model.safetensors.index.json are empty"),
        ({"config.json": 2, **dict.fromkeys(SHARDS, 9)}, sharded_index(SHARDS + ["model-00004-of-00003.safetensors"]),
         r"the shards \['model-00004-of-00003.safetensors'\] named by .* are missing"),
        ({"config.json": 2}, json.dumps({"metadata": {}, "weight_map": {}}), "names no shard"),
        ({"config.json": 2}, json.dumps({"metadata": {}}), "names no shard"),
        ({"config.json": 2}, "{not json", "model.safetensors.index.json is not JSON"),
        ({"config.json": 2, "x.safetensors": 9}, sharded_index(["../x.safetensors"]), "names a shard outside the export"),
        ({"config.json": 2, **dict.fromkeys(SHARDS, 9), "model-00001-of-00002.safetensors": 9}, sharded_index(SHARDS),
         r"the shards \['model-00001-of-00002.safetensors'\] are not named by model.safetensors.index.json"),
        ({"config.json": 2, "model.safetensors": 9, SHARDS[0]: 9}, None, "beside model.safetensors, with no index"),
        ({"config.json": 2, "model.safetensors": 9}, sharded_index(SHARDS), "both model.safetensors and"),
        ({"config.json": 2, "model.safetensors": 0}, None, "model.safetensors is empty"),
        ({"config.json": 2, **dict.fromkeys(SHARDS, 9)}, None,
         r"no weights: neither model.safetensors nor model.safetensors.index.json \(found \['model-00001"),
        ({"config.json": 2, "tokenizer.json": 9}, None, "no weights"),
        ({"model.safetensors": 9}, None, "config.json is missing"),
        ({"config.json": 0, "model.safetensors": 9}, None, "config.json is empty"),
    ],
    ids=["missing-shard", "empty-shard", "index-names-an-absent-file", "empty-weight-map", "no-weight-map",
         "index-not-json", "shard-outside-the-folder", "stray-shard", "shards-beside-the-single-file",
         "both-layouts", "empty-single-file", "shards-without-index", "no-weights", "no-config", "empty-config"],
)
def test_an_incomplete_or_ambiguous_export_is_refused_naming_what_is_wrong(files, index, error):
    with pytest.raises(ExportLayoutError, match=error):
        layout_of(files, index)


def test_the_card_and_the_record_name_the_architecture_and_why_a_gemma_3_fine_tune_is_text_only():
    spec = make_spec(output_location="gs://bkt/p")
    card = model_card(spec, final_step=3, final_loss="1.0", architecture="Gemma3ForCausalLM")
    [row] = [line for line in card.splitlines() if line.startswith("| Architecture |")]
    assert "`Gemma3ForCausalLM`, Gemma 3's text model" in row
    assert "`use_multimodal=False`" in row and "`model.language_model.*` renamed `model.*`" in row
    record = run_record(spec, training={}, base_checkpoint=None, hf_export=spec.hf_export_uri,
                        architecture="Gemma3ForCausalLM")
    assert record["hf_export_architecture"] == "Gemma3ForCausalLM"
    other = model_card(spec, final_step=3, final_loss="1.0", architecture="Qwen3ForCausalLM")
    assert "| Architecture | `Qwen3ForCausalLM` |" in other
    assert "Architecture" not in model_card(spec, final_step=3, final_loss="1.0")


def test_the_card_and_the_record_name_the_layout_and_the_weight_files():
    spec = make_spec(output_location="gs://bkt/p")
    sharded = layout_of({"config.json": 2, **dict.fromkeys(SHARDS, 9)}, sharded_index(SHARDS))
    card = model_card(spec, final_step=3, final_loss="1.0", export=sharded)
    assert "| Weights | 3 safetensors shards, indexed by `model.safetensors.index.json` |" in card
    record = run_record(spec, training={}, base_checkpoint=None, hf_export=spec.hf_export_uri, export=sharded)
    assert (record["hf_export_layout"], record["hf_export_weight_files"]) == ("sharded", SHARDS)
    single = layout_of({"config.json": 2, "model.safetensors": 9})
    assert "| Weights | `model.safetensors` |" in model_card(spec, final_step=3, final_loss="1.0", export=single)
    record = run_record(spec, training={}, base_checkpoint=None, hf_export=spec.hf_export_uri, export=single)
    assert (record["hf_export_layout"], record["hf_export_weight_files"]) == ("single", ["model.safetensors"])
