"""The tuned model as an Airflow Asset: every successful fine-tune emits an event for it.

One Asset for every DAG that runs the pipeline (the manual DAG and each declared job); the
event's extra says which run made which model from what, so downstream DAGs scheduled on the
Asset (evaluation, deployment) know what to load.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import Asset
from maxtext_sft.run.spec import RunSpec

TUNED_MODEL = Asset(name="maxtext_sft.tuned_model", uri="maxtext-sft://tuned-model", group="model")


def tuned_model_event(spec: RunSpec, record: dict[str, Any]) -> dict[str, Any]:
    """The Asset event's extra: where the model is and what made it (all JSON, no secrets)."""
    return {
        "dag_id": spec.dag_id,
        "run_id": spec.run_id,
        "run_name": spec.run_name,
        "location": record["hf_export"],  # gs://... or WORKER-HOST:/path without an output location
        "run_record": spec.run_record_uri,
        "base_model": spec.base_model_id,
        "model_name": spec.model_name,
        "dataset": spec.dataset_name,
        "dataset_revision": spec.dataset_revision,
        "steps": record.get("final_step"),
        "final_loss": record.get("final_loss"),
    }
