"""A Param is declared once (run_params.PARAMS): a new row alone reaches the trigger form, the
check of a run conf or job file, the declared-job loader and the run's spec."""

from __future__ import annotations

import re
from datetime import datetime, timezone

import pytest

from maxtext_sft import run_params
from maxtext_sft.jobs import JobConfigError, load_job
from maxtext_sft.params import pipeline_params
from maxtext_sft.pipeline import fine_tune_dag
from maxtext_sft.run_params import MODEL, Declared, SpecError, form_schema
from maxtext_sft.spec import RunSpec, build_run_spec
from tests.dags.test_declared_jobs import GOOD, write_job

WARMUP = Declared("warmup_steps", "integer", 0, "Learning-rate warm-up steps.", MODEL, minimum=0, maximum=1000)


@pytest.fixture
def with_warmup_param(monkeypatch):
    """The pipeline's declaration with one more row, and nothing else changed."""
    monkeypatch.setattr(run_params, "PARAMS", (*run_params.PARAMS, WARMUP))


def spec_with(**params) -> RunSpec:
    return build_run_spec(
        {"reservation": "my-reservation", **params},
        dag_id="maxtext_sft",
        run_id="manual__1",
        generation=0,
        started=datetime(2026, 12, 1, tzinfo=timezone.utc),
        default_project_id="my-project",
        ssh_user="maxtext",
        ssh_public_key="ssh-ed25519 AAAA",
    )


def test_a_new_row_is_in_the_trigger_form_of_the_pipeline_dag(with_warmup_param):
    dag = fine_tune_dag("maxtext_sft_probe", params=pipeline_params())
    param = dag.params.get_param("warmup_steps")
    assert param.value == 0
    assert param.description == "Learning-rate warm-up steps."
    assert param.schema["section"] == MODEL
    assert (param.schema["type"], param.schema["minimum"], param.schema["maximum"]) == ("integer", 0, 1000)
    param.resolve(1000)  # Airflow's own check of a form value takes the bounds
    with pytest.raises(Exception, match="1001"):
        param.resolve(1001)


def test_a_new_row_is_checked_and_typed_in_the_run_spec(with_warmup_param):
    spec = spec_with(warmup_steps=7)
    assert spec.warmup_steps == 7
    assert spec.to_dict()["warmup_steps"] == 7
    assert RunSpec.from_dict(spec.to_dict()) == spec
    assert spec_with().warmup_steps == 0  # the declared default
    for bad in (-1, 1001, "7", True, 7.5):
        with pytest.raises(SpecError, match=re.escape(f"Param 'warmup_steps': {bad!r} is not an integer")) as raised:
            spec_with(warmup_steps=bad)
        assert raised.value.param == "warmup_steps"


def test_a_new_row_is_taken_and_checked_by_the_declared_job_loader(with_warmup_param, tmp_path):
    write_job(tmp_path, "team-job.yaml", {**GOOD, "params": {**GOOD["params"], "warmup_steps": 9}})
    assert load_job(tmp_path / "team-job.yaml")["params"]["warmup_steps"].value == 9
    write_job(tmp_path, "team-job.yaml", {**GOOD, "params": {**GOOD["params"], "warmup_steps": -3}})
    with pytest.raises(JobConfigError, match=r"team-job.yaml: field 'params.warmup_steps': -3 is not an integer"):
        load_job(tmp_path / "team-job.yaml")


def test_without_the_row_the_name_is_refused_everywhere():
    with pytest.raises(SpecError, match="'warmup_steps' is not a Param"):
        spec_with(warmup_steps=7)
    assert "warmup_steps" not in pipeline_params()


@pytest.mark.parametrize("param", run_params.PARAMS, ids=lambda param: param.name)
def test_the_form_and_the_check_agree_on_each_declared_default(param):
    """Each Param's default passes Airflow's check of its schema and the pipeline's own."""
    import jsonschema

    jsonschema.validate(param.default, form_schema(param))
    if not param.required_because:
        assert run_params.check_value(param, param.default) == (
            tuple(param.default) if isinstance(param.default, list) else param.default
        )


@pytest.mark.parametrize(
    ("name", "value"),
    [("zone", "us-east5-b\n"), ("hub_repo_id", "team/model\n"), ("output_location", "gs://b/" + "x" * 2000),
     ("model_name", "gemma3-4B"), ("machine_type", "ct5p-hightpu-4t"), ("train_data_columns", []),
     ("train_extra_args", ["no-equals-sign"]), ("steps", 0), ("vm_hourly_price_usd", -1)],
)
def test_the_form_refuses_what_the_check_refuses(name, value):
    """The form's schema (Airflow's jsonschema check) and check_value refuse the same values."""
    import jsonschema

    param = run_params.declared()[name]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(value, form_schema(param))
    with pytest.raises(SpecError, match=f"'{name}'"):
        run_params.check_value(param, value)
