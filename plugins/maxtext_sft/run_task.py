"""The base of the operators and sensors that act for one fine-tuning run.

Each takes plan_run's spec as its templated field `spec` (plan_run's XCom, a plain dict once
rendered) and the ids of the connections it uses; `run_spec` is that spec as a RunSpec, read
once per task process.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

from airflow.sdk import BaseOperator
from maxtext_sft.spec import RunSpec


class RunTaskOperator(BaseOperator):
    template_fields: Sequence[str] = ("spec",)

    def __init__(
        self, *, spec, gcp_conn_id: str, ssh_conn_id: str | None = None, hf_conn_id: str | None = None, **kwargs
    ):
        super().__init__(**kwargs)
        self.spec = spec
        self.gcp_conn_id = gcp_conn_id
        self.ssh_conn_id = ssh_conn_id
        self.hf_conn_id = hf_conn_id

    @cached_property
    def run_spec(self) -> RunSpec:
        return RunSpec.from_dict(self.spec)
