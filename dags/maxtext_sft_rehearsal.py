"""A dress rehearsal of `maxtext_sft` on this project, for a few cents, before the first TPU VM.

The same tasks as `maxtext_sft`, with the same Params and connections, run on a cheap on-demand
CPU VM (rehearsal_machine_type, default e2-standard-8; a public Ubuntu image; no reservation:
the reservation is only read) at toy size: the VM makes a tiny gemma3-4b-shaped model and
dataset (include/rehearsal), so nothing downloads the 8 GB base model. What it proves, one line
each in the run summary: the Compute API accepts this project's insert and delete; the
reservation exists and holds machine_type; SSH works as the run logs in, host key verified; the
VM's service account writes to output_location; the VM reaches the Hub and the token reads the
gated base model and the dataset revision; the same MaxText version installs and converts,
trains and exports; publishing to hub_repo_id works (use a private repo); nothing is left. The
summary also prints the VM-hours and their cost at vm_hourly_price_usd. Trigger it with the run
conf you would give `maxtext_sft`; the task graph is in plugins/maxtext_sft/builders/pipeline.py.
"""

from __future__ import annotations

# The Airflow modules a parse needs, named so that the DAG processor imports them once, before it
# forks each parse (docs/architecture.md: cheap to parse): the same as maxtext_sft.py's.
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
    "maxtext_sft_rehearsal",
    params=pipeline_params(rehearsal=True),
    description="A few cents' rehearsal of maxtext_sft on a CPU VM: what a real run would get through",
    tags=["maxtext", "sft", "rehearsal"],
    doc_md=__doc__,
    rehearsal=True,
)
