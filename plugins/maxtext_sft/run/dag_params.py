"""The pipeline DAG's Params, made from their declaration (run.params.PARAMS): the tutorial's
values as defaults, grouped for the trigger form.

The JSON schema gives the trigger form its types, titles (the fields' labels), help and required
fields; `spec.build_run_spec` checks the same declaration again in plan_run (it also runs on
scheduled runs and on conf sent through the API).
"""

from __future__ import annotations

from collections.abc import Iterable

from airflow.sdk import Param
from maxtext_sft.run.params import REHEARSAL_DEFAULTS, SLICE_DEFAULTS, Declared, all_params, declared, form_schema


def airflow_params(table: Iterable[Declared] | None = None) -> dict[str, Param]:
    """An Airflow Param for each declared one (the pipeline's, unless `table` names others)."""
    return {
        name: Param(
            param.default,
            description=param.description,
            title=param.title,
            section=param.section,
            **form_schema(param),
        )
        for name, param in declared(table).items()
    }


def pipeline_params(rehearsal: bool = False, tpu_slice: bool = False) -> dict[str, Param]:
    """The fine-tune DAG's Params; with `rehearsal`, its rehearsal's (the CPU VM's, a few steps);
    with `tpu_slice`, the multi-host slice DAG's (its shape, its hosts' machine type)."""
    if tpu_slice:
        return with_defaults(airflow_params(all_params(tpu_slice=True)), SLICE_DEFAULTS)
    if not rehearsal:
        return airflow_params()
    return with_defaults(airflow_params(all_params(rehearsal=True)), REHEARSAL_DEFAULTS)


def with_defaults(params: dict[str, Param], values: dict) -> dict[str, Param]:
    """The same Params with other defaults (a declared job's values); their schemas unchanged."""
    unknown = sorted(set(values) - set(params))
    if unknown:
        raise KeyError(f"no such Param: {', '.join(unknown)}")
    return {
        name: Param(values[name], param.description, schema=param.schema) if name in values else param
        for name, param in params.items()
    }
