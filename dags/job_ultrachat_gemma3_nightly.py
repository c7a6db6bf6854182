"""Declared job include/jobs/ultrachat-gemma3-nightly.yaml: the fine-tune of maxtext_sft.pipeline, nightly."""

from airflow.sdk import DAG
from maxtext_sft.jobs import declared_job_dag

dag: DAG = declared_job_dag("ultrachat-gemma3-nightly.yaml")
