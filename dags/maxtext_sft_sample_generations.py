"""Downstream of every fine-tune: load the new model and generate a few lines from fixed prompts.

Scheduled on the tuned-model Asset (maxtext_sft.results.lineage.TUNED_MODEL), so it starts when any
pipeline DAG (manual or declared job) has produced a model. Each triggering event names the
model's location, base model, dataset revision, steps and final loss. An example of where
evaluation or deployment plugs in; the generation runs in `[maxtext_sft] generation_python`.
"""

from __future__ import annotations

from datetime import timedelta

import airflow.providers.google.cloud.hooks.gcs  # noqa: F401 - the DAG processor imports it once, before it forks each parse
from airflow.sdk import DAG, Param, task
from maxtext_sft.results.lineage import TUNED_MODEL
from maxtext_sft.tasks.samples import sample_generations

GCP_CONN_ID = "google_cloud_default"  # reads models from gs:// (extra storage_api_endpoint: a private endpoint)

with DAG(
    dag_id="maxtext_sft_sample_generations",
    description="Generate sample lines from each newly tuned model",
    schedule=[TUNED_MODEL],
    catchup=False,
    max_active_runs=1,
    params={"max_new_tokens": Param(24, type="integer", minimum=1, maximum=512, description="Tokens per sample.")},
    tags=["maxtext", "sft", "evaluation"],
    default_args={"retries": 1, "retry_delay": timedelta(minutes=1), "owner": "ml-platform"},
    doc_md=__doc__,
) as dag:

    @task
    def generate_samples(**context) -> list[dict]:
        """One set of samples per model that triggered this run (several, if they queued up)."""
        events = context["triggering_asset_events"][TUNED_MODEL]
        if not events:
            raise ValueError("No tuned-model event triggered this run: it runs when a fine-tune emits one")
        return [
            sample_generations(
                event.extra, gcp_conn_id=GCP_CONN_ID, max_new_tokens=context["params"]["max_new_tokens"],
                log=context["task"].log,
            )
            for event in events
        ]

    generate_samples()
