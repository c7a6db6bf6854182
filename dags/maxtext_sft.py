"""Supervised fine-tuning with MaxText on a Cloud TPU VM (a reservation's, flex-start, Spot or on demand), triggered by hand.

Trigger with run conf to override any Param; the trigger form documents each one. The steps
(the tutorial's runbook) are in plugins/maxtext_sft/builders/pipeline.py, shared with the declared jobs
(include/jobs/*.yaml), which run the same steps on a schedule.
"""

from __future__ import annotations

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
from airflow.sdk import DAG  # also what Airflow's safe-mode scan looks for in a DAG file
from maxtext_sft.run.dag_params import pipeline_params
from maxtext_sft.builders.pipeline import fine_tune_dag

dag: DAG = fine_tune_dag("maxtext_sft", params=pipeline_params(), doc_md=__doc__)
