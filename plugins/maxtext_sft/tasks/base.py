"""The base of the operators and sensors that act for one fine-tuning run.

Each takes plan_run's spec as its templated field `spec` (plan_run's XCom, a plain dict once
rendered) and the ids of the connections it uses; `run_spec` is that spec as a RunSpec, read
once per task process.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

from airflow.sdk import BaseOperator
from maxtext_sft.run.spec import RunSpec


class RunTaskOperator(BaseOperator):
    """On a multi-host slice, `hosts` is create_slice's XCom (the hosts in worker order): then
    `run_spec` is host 0's spec (where a one-host step runs, whose output the others share), and
    `host_specs` every host's."""

    template_fields: Sequence[str] = ("spec", "hosts")

    def __init__(
        self,
        *,
        spec,
        gcp_conn_id: str,
        ssh_conn_id: str | None = None,
        hf_conn_id: str | None = None,
        hosts=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.spec = spec
        self.gcp_conn_id = gcp_conn_id
        self.ssh_conn_id = ssh_conn_id
        self.hf_conn_id = hf_conn_id
        self.hosts = hosts

    @cached_property
    def host_specs(self) -> list[RunSpec]:
        spec = RunSpec.from_dict(self.spec)
        return spec.on_hosts(self.hosts) if self.hosts else [spec]

    @cached_property
    def run_spec(self) -> RunSpec:
        return self.host_specs[0]
