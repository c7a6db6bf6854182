"""The model card, the run record and the publishing gate (pure functions of the spec)."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from maxtext_sft.outputs import FinalLossError, check_final_loss, hub_commit_title, model_card, run_record
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
    assert record["model_card"] == f"{durable.hf_export_uri}/README.md"
    local = make_spec()
    record = run_record(local, training={}, base_checkpoint=None, hf_export="host:/x")
    assert record["checkpoints"] is None and record["checkpoints_durable"] is False


def test_the_record_keeps_the_loss_history_and_where_it_and_the_chart_went():
    spec = make_spec(output_location="gs://bkt/p")
    history = [[1, 2.5], [2, None], [3, 1.5]]
    record = run_record(spec, training={"final_step": 3, "final_loss": "1.5"}, base_checkpoint=None,
                        hf_export=spec.hf_export_uri, location=spec.run_record_uri, loss_history=history,
                        loss_curve=f"{spec.run_output_dir}/loss-curve.png")
    assert record["run_record"] == f"gs://bkt/p/runs/{spec.run_name}/run-record.json"
    assert record["loss_history"] == history
    assert record["loss_curve"] == f"gs://bkt/p/runs/{spec.run_name}/loss-curve.png"
    assert json.loads(json.dumps(record, allow_nan=False))["loss_history"] == history  # strict JSON: no NaN
