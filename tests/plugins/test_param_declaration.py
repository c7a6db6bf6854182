"""A Param is declared once (run_params.PARAMS): a new row alone reaches the trigger form, the
check of a run conf or job file, the declared-job loader and the run's spec."""

from __future__ import annotations

import re
from datetime import datetime, timezone

import pytest

from maxtext_sft.run import params as run_params
from maxtext_sft.run.bake import BAKE_PARAMS
from maxtext_sft.builders.jobs import JobConfigError, load_job
from maxtext_sft.run.dag_params import pipeline_params
from maxtext_sft.builders.pipeline import fine_tune_dag
from maxtext_sft.run.params import MODEL, Declared, SpecError, form_schema
from maxtext_sft.run.spec import RunSpec, build_run_spec
from tests.dags.test_declared_jobs import GOOD, write_job

WARMUP = Declared("warmup_steps", "integer", 0, "Steps over which the learning rate rises to its peak.", MODEL,
                  title="Warm-up steps", minimum=0, maximum=1000)


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
    assert param.description == "Steps over which the learning rate rises to its peak."
    assert param.schema["title"] == "Warm-up steps"  # the form's label
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
    assert run_params.check_value(param, param.default) == (
        tuple(param.default) if isinstance(param.default, list) else param.default
    )


def test_a_field_may_be_left_empty_exactly_when_its_param_may_be():
    """Airflow 3.3's form marks a field required, and disables Trigger while it is empty, when its
    schema's type does not allow null (FlexibleForm's isRequired). The reservation may be empty:
    it is needed only with the capacity 'reservation', which plan_run checks (test_spec)."""
    for param in run_params.all_params(rehearsal=True) + BAKE_PARAMS:
        schema_type = form_schema(param)["type"]
        allows_empty = isinstance(schema_type, list) and "null" in schema_type
        assert allows_empty == param.nullable, param.name
    assert pipeline_params()["reservation"].schema["type"] == ["null", "string"]
    assert pipeline_params()["capacity"].schema["enum"] == list(run_params.CAPACITIES)


# Param tables whose rows reach a trigger form: the pipeline's (with its rehearsal's) and the bake's.
FORM_TABLES = {"pipeline": lambda: run_params.all_params(rehearsal=True), "bake": lambda: BAKE_PARAMS}
# A tutorial shell variable (PER_DEVICE_BATCH_SIZE, MODEL_NAME): capitals joined by underscores.
SHELL_VARIABLE = re.compile(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b")


@pytest.mark.parametrize("table", FORM_TABLES)
def test_every_param_has_a_title_distinct_within_its_section(table):
    """The form's label is the title: in a user's words, never the Param's snake_case name, and
    no two fields of a section look alike. Read from the table itself, so a row added later is
    checked the same way."""
    params = FORM_TABLES[table]()
    titles_by_section: dict[str, dict[str, str]] = {}
    for param in params:
        assert param.title.strip(), f"{param.name}: no title"
        # Capitalized words, not snake_case ("Zone" may still be its Param's name capitalized).
        assert param.title == param.title.strip() and param.title[0].isupper(), f"{param.name}: {param.title!r}"
        assert "_" not in param.title, f"{param.name}: {param.title!r}"
        seen = titles_by_section.setdefault(param.section, {})
        other = seen.setdefault(param.title.casefold(), param.name)
        assert other == param.name, f"{param.name} and {other} share the title {param.title!r} in {param.section!r}"


@pytest.mark.parametrize("table", FORM_TABLES)
def test_help_text_is_in_a_users_words(table):
    """Help text says what a field does, not the tutorial's shell variable (RESERVATION,
    PER_DEVICE_BATCH_SIZE) nor another field's Param name (the form shows titles)."""
    params = FORM_TABLES[table]()
    names = {param.name for param in params}
    for param in params:
        help_text = param.description
        assert len(help_text.split()) >= 3 and help_text != param.title, f"{param.name}: {help_text!r}"
        assert not SHELL_VARIABLE.search(help_text), f"{param.name}: {help_text!r}"
        capitalized_names = {word for word in re.findall(r"\b[A-Z]{2,}\b", help_text) if word.lower() in names}
        assert not capitalized_names, f"{param.name}: {help_text!r} names {capitalized_names}"
        mentioned = {name for name in names if "_" in name and re.search(rf"\b{name}\b", help_text)}
        assert not mentioned, f"{param.name}: {help_text!r} names the Param(s) {mentioned}; use their titles"


def test_the_help_text_checks_catch_the_old_wording():
    """The checks above would refuse the texts the data team saw."""
    assert SHELL_VARIABLE.search("Per-device batch size (PER_DEVICE_BATCH_SIZE).")
    assert not SHELL_VARIABLE.search("Size of the VM's boot disk, in GB (a v6e-8 on a VPC network).")
    assert re.findall(r"\b[A-Z]{2,}\b", "Capacity reservation (RESERVATION).") == ["RESERVATION"]


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


def test_a_new_row_is_on_the_params_page(with_warmup_param):
    from maxtext_sft.run import params_page

    [row] = [line for line in params_page.render().splitlines() if line.startswith(f"| `{WARMUP.name}` |")]
    assert WARMUP.title in row and WARMUP.description in row and "maxtext_sft, maxtext_sft_rehearsal" in row
