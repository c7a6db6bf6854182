"""What the package's DAG builders share (builders/pipeline.py, builders/bake_pipeline.py): the ids of the
connections their tasks use, the task defaults, and the `[maxtext_sft]` Airflow config values
they read when a DAG file is parsed (Airflow's config file and environment: no database, no
network).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from airflow.sdk import conf
from maxtext_sft.cloud.capacity import CAPACITY_FIRST_READ_SECONDS, CAPACITY_POLL_SECONDS

GCP_CONN_ID = "google_cloud_default"  # Compute API (extra compute_api_endpoint for a private endpoint)
SSH_CONN_ID = "maxtext_sft_vm_ssh"  # login = VM user, extra private_key = the key put on each VM
HF_CONN_ID = "huggingface_default"  # password = Hugging Face token (extra endpoint: a private Hub)


def retry_delay() -> timedelta:
    """Airflow config [maxtext_sft] retry_delay_seconds: how long a failed task waits to retry."""
    return timedelta(seconds=conf.getint("maxtext_sft", "retry_delay_seconds", fallback=30))


def task_defaults(*, owner: str, **callbacks: Callable | list[Callable]) -> dict[str, Any]:
    """default_args of a DAG's tasks: two retries after retry_delay(), the owner, the callbacks."""
    return {"retries": 2, "retry_delay": retry_delay(), "owner": owner, **callbacks}


def give_params_after_tasks(dag, params: dict) -> None:
    """Give the DAG its Params once its tasks exist. A task made inside a DAG that has Params gets
    its own deep copy of them, and Airflow serializes (and validates) every task's copy: 15 copies
    of ~50 Params were most of a pipeline DAG's parse (bench/dag_parse.py). Held by the DAG alone,
    they are serialized once, and a task's context still has them all: Airflow merges the DAG's
    Params into it at run time (airflow.sdk.definitions.param.process_params)."""
    dag.params = params  # converted and validated as the DAG's constructor would


def capacity_reads() -> dict[str, float]:
    """Airflow config [maxtext_sft] capacity_first_read_seconds (default 60) and
    capacity_poll_seconds (default 15): when the capacity gate's trigger reads a full reservation,
    first after the deferral, then. Keep the first well above the executor's report of a deferred
    try (CreateVmOperator, apache/airflow#72716)."""
    return {
        "capacity_first_read_seconds": conf.getfloat(
            "maxtext_sft", "capacity_first_read_seconds", fallback=CAPACITY_FIRST_READ_SECONDS
        ),
        "capacity_poll_seconds": conf.getfloat("maxtext_sft", "capacity_poll_seconds", fallback=CAPACITY_POLL_SECONDS),
    }


def training_wait_deferrable() -> bool:
    """Airflow config [maxtext_sft] training_wait_deferrable (default true): whether
    wait_for_final_checkpoint defers to the triggerer between its checks, or pokes in reschedule
    mode (a task process per check)."""
    return conf.getboolean("maxtext_sft", "training_wait_deferrable", fallback=True)


def ssh_wait_deferrable() -> bool:
    """Airflow config [maxtext_sft] ssh_wait_deferrable (default true): whether wait_for_ssh
    defers to the triggerer while the VM (a slice's host) does not answer, or pokes, holding its
    worker slot."""
    return conf.getboolean("maxtext_sft", "ssh_wait_deferrable", fallback=True)
