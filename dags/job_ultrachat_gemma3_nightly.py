"""Declared job include/jobs/ultrachat-gemma3-nightly.yaml: the fine-tune of maxtext_sft.builders.pipeline, nightly."""

# The Airflow modules a parse needs, named so that the DAG processor imports them once, before it
# forks each parse (docs/architecture.md: cheap to parse): the operators' clients, @task and
# EmptyOperator, the providers' Asset handlers, and what serializing the DAG looks up.
import airflow.providers.common.compat.assets  # noqa: F401
import airflow.providers.google.cloud.hooks.gcs  # noqa: F401
import airflow.providers.google.cloud.operators.compute  # noqa: F401
import airflow.providers.standard.operators.empty  # noqa: F401
import airflow.providers.standard.operators.trigger_dagrun  # noqa: F401
import airflow.providers.standard.sensors.external_task  # noqa: F401
import airflow.sdk.definitions.decorators  # noqa: F401
import airflow.timetables.trigger  # noqa: F401 - the schedule's timetable, serialized
from airflow.sdk import DAG
from maxtext_sft.builders.jobs import declared_job_dag

dag: DAG = declared_job_dag("ultrachat-gemma3-nightly.yaml")
