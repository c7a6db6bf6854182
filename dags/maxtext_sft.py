"""Supervised fine-tuning with MaxText on a reservation-bound Cloud TPU VM, triggered by hand.

Trigger with run conf to override any Param; the trigger form documents each one. The steps
(the tutorial's runbook) are in plugins/maxtext_sft/pipeline.py, shared with the declared jobs
(include/jobs/*.yaml), which run the same steps on a schedule.
"""

from __future__ import annotations

from airflow.sdk import DAG  # also what Airflow's safe-mode scan looks for in a DAG file
from maxtext_sft.params import pipeline_params
from maxtext_sft.pipeline import fine_tune_dag

dag: DAG = fine_tune_dag("maxtext_sft", params=pipeline_params(), doc_md=__doc__)
