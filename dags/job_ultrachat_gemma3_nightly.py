"""Declared job include/jobs/ultrachat-gemma3-nightly.yaml: the fine-tune of maxtext_sft.pipeline, nightly."""

import airflow.providers.google.cloud.hooks.gcs  # noqa: F401 - the DAG processor imports these once,
import airflow.providers.google.cloud.operators.compute  # noqa: F401 - before it forks each parse
from airflow.sdk import DAG
from maxtext_sft.jobs import declared_job_dag

dag: DAG = declared_job_dag("ultrachat-gemma3-nightly.yaml")
