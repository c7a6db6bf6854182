"""Supervised fine-tuning with MaxText on a multi-host TPU slice (e.g. v6e-16: 4 hosts of
ct6e-standard-4t), triggered by hand; the teardown deletes the slice whatever happens.

The same steps as maxtext_sft (plugins/maxtext_sft/builders/pipeline.py), on a managed instance group
under a workload policy instead of one VM: each step runs on every host or on host 0, and the
checkpoints go to the output location, which a slice requires. docs/multi-host.md.
"""

from __future__ import annotations

# As in maxtext_sft.py: what a parse needs, imported once before the DAG processor forks.
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

dag: DAG = fine_tune_dag(
    "maxtext_sft_slice",
    params=pipeline_params(tpu_slice=True),
    doc_md=__doc__,
    tpu_slice=True,
    description="MaxText SFT on a reservation-bound multi-host TPU slice, deleted whatever happens",
)
