"""Run conf that cannot make a valid run is refused, naming the field, before any Compute API request.

Two gates: Airflow checks the conf against the Params' JSON schema (types, ranges, enums,
patterns, a required value left empty) when the run is created; plan_run checks what a schema
cannot (fields that depend on each other, arguments the pipeline owns), and everything again,
and fails without retries.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e

INVALID = [
    ("zone", "us-east5"),  # a region, not a zone
    ("zone", "us-east5-b; reboot"),
    ("reservation", None),  # the default capacity, 'reservation', needs one: refused by plan_run
    ("capacity", "preemptible"),  # not a capacity type
    ("machine_type", "ct5p-hightpu-4t"),
    ("vm_name_prefix", "Bad_Name"),
    ("steps", 0),
    ("steps", "12"),
    ("max_vm_recoveries", 11),
    ("dataset_name", "$(reboot)"),
    ("train_data_columns", []),
    ("train_data_columns", ["messages; reboot"]),
    ("work_dir", "~/x; rm -rf ~"),
    ("maxtext_version", "latest"),
    ("output_location", "s3://bucket/prefix"),
    ("hub_repo_id", "not a repo"),
    ("train_extra_args", ["steps=5"]),  # the pipeline owns steps
    ("dataset_revision", "main"),  # with a dataset folder on the VM: only Hub datasets have revisions
    # Python's `$` matches before a final newline: every pattern must match the whole value.
    ("hub_repo_id", "team/model\n"),
    ("model_name", "gemma3-4b\n"),
    ("zone", "us-east5-b\n"),
    ("output_location", "gs://bucket/" + "x" * 100_000),  # every string has a length limit
    ("step", 3),  # no such Param (a typo of steps): the run would train the default steps
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}"[:60] for f, v in INVALID])
def test_invalid_conf_is_refused_before_any_request(field, value, run_pipeline, local_cloud):
    from airflow.sdk.definitions.param import ParamValidationError

    conf = {field: value}
    if field == "dataset_revision":
        conf["dataset_name"] = "/srv/datasets/ultrachat"
    try:
        run = run_pipeline(conf)
    except ParamValidationError as error:  # the schema: the run is never created
        message = str(error)
    else:
        assert run.state == "failed"
        assert run.task_states["plan_run"] == "failed", run.report()
        message = run.log[run.log.index("Invalid run configuration") :][:2000]
        # The run's own error names the cause too: the outcome runs though no VM was leased.
        assert run.task_states["check_run_outcome"] == "failed", run.report()
        outcome = run.log[run.log.rindex("The fine-tune did not complete") :][:3000]
        assert "plan_run: AirflowFailException: Invalid run configuration" in outcome, outcome
    assert field in message, message[:2000]
    if field == "step":
        assert "did you mean 'steps'?" in message, message
    assert local_cloud.requests() == []


# Values the spec accepts (MaxText arguments are data) that a shell would run if they escaped
# their quoting; the canary is looked for in the VM's /dev/shm, which the local cloud keeps.
CANARY = "/dev/shm/pwned-by-run-conf"
HOSTILE_CONFS = [
    {"train_extra_args": [f"hf_data_dir=$(touch {CANARY})"]},
    {"convert_extra_args": [f"hf_data_dir=`touch {CANARY}`; *"], "export_extra_args": [f"hf_data_dir=x' ; touch {CANARY}; echo '"]},
    {"train_extra_args": [f"hf_data_dir=a\ntouch {CANARY}\n $HOME ~ * | tee {CANARY}"]},
]


@pytest.mark.parametrize("conf", HOSTILE_CONFS, ids=["substitution", "backticks-and-quotes", "newlines-and-pipes"])
def test_a_hostile_but_valid_conf_runs_as_data(conf, run_pipeline, local_cloud):
    run = run_pipeline({**conf, "steps": 4})
    assert run.state == "success", run.report()
    vm_name = run.xcoms["plan_run.vm_name"]
    assert local_cloud.deleted_shm(vm_name).is_dir()  # where the canary would be
    assert not (local_cloud.deleted_shm(vm_name) / CANARY.removeprefix("/dev/shm/")).exists()
