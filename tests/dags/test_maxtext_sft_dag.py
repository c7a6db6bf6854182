"""DAG integrity: it parses cleanly, without I/O, and its shape is the one the pipeline promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from maxtext_sft.run.params import defaults
from tests.conftest import REPO

TASK_ORDER = [
    "plan_run",
    "preflight",
    "vm_lease",
    "create_vm",
    "wait_for_ssh",
    "install_maxtext",
    "convert_checkpoint",
    "start_training",
    "wait_for_final_checkpoint",
    "export_to_hf",
    "collect_outputs",
    "delete_vm",
    "summarize_run",
    "check_run_outcome",
]


@pytest.fixture(scope="module")
def dag_bag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(str(REPO / "dags"))
    assert bag.import_errors == {}
    return bag


@pytest.fixture(scope="module")
def dag(dag_bag):
    return dag_bag.dags["maxtext_sft"]


DAG_FILE_TASKS = {
    "maxtext_sft.py": 15,
    "job_ultrachat_gemma3_nightly.py": 15,
    "maxtext_sft_janitor.py": 1,
    "maxtext_sft_sample_generations.py": 1,
    "maxtext_sft_bake_image.py": 10,
}


@pytest.fixture(scope="module")
def guarded_parses() -> dict[str, dict]:
    """Each DAG file imported with every kind of remote or slow access turned into an error: in one
    interpreter (Airflow imported once, ~5 s of CPU), the guards set before the first DAG file, so a
    module that does I/O when first imported fails whichever file imports it first."""
    guard = textwrap.dedent(
        f"""
        import socket, sys, json, traceback
        import sqlalchemy.engine
        from airflow.sdk import BaseHook, Variable  # Airflow itself is imported before the guards
        def refuse(*args, **kwargs):
            raise RuntimeError("I/O at DAG parse time")
        socket.socket.connect = refuse
        socket.create_connection = refuse
        socket.getaddrinfo = refuse
        sqlalchemy.engine.Engine.connect = refuse
        sqlalchemy.engine.Engine.raw_connection = refuse
        BaseHook.get_connection = classmethod(refuse)
        Variable.get = staticmethod(refuse)
        sys.path.insert(0, {str(REPO / "plugins")!r})
        import importlib.util
        for n, dag_file in enumerate({sorted(DAG_FILE_TASKS)!r}):
            try:
                spec = importlib.util.spec_from_file_location(f"dag_file_{{n}}", {str(REPO / "dags")!r} + "/" + dag_file)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                result = {{"tasks": len(module.dag.task_dict)}}
            except BaseException:
                result = {{"error": traceback.format_exc()}}
            print("PARSE", json.dumps({{dag_file: result}}))
        """
    )
    env = {**os.environ, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "sqlite:////nonexistent-dir/airflow.db"}
    done = subprocess.run([sys.executable, "-c", guard], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    parses = {}
    for line in done.stdout.splitlines():
        if line.startswith("PARSE "):
            parses.update(json.loads(line.removeprefix("PARSE ")))
    return parses


@pytest.mark.parametrize(("dag_file", "tasks"), sorted(DAG_FILE_TASKS.items()))
def test_parses_without_network_database_connections_or_variables(guarded_parses, dag_file, tasks):
    assert guarded_parses[dag_file] == {"tasks": tasks}, guarded_parses[dag_file].get("error", "")[-3000:]


def test_tasks_run_in_the_tutorials_order(dag):
    order = [t.task_id for t in dag.topological_sort()]
    assert [task_id for task_id in order if task_id != "publish_to_hub"] == TASK_ORDER
    for upstream, downstream in zip(TASK_ORDER, TASK_ORDER[1:]):
        assert downstream in dag.get_task(upstream).downstream_task_ids


def test_publishing_does_not_hold_the_vm_but_decides_the_run(dag):
    publish = dag.get_task("publish_to_hub")
    assert publish.upstream_task_ids == {"plan_run", "collect_outputs"}  # plan_run: its spec XCom
    assert "delete_vm" not in publish.upstream_task_ids | publish.downstream_task_ids
    assert "check_run_outcome" in publish.downstream_task_ids


def test_delete_runs_in_every_outcome_without_deciding_the_run_state(dag):
    delete = dag.get_task("delete_vm")
    lease = dag.get_task("vm_lease")
    assert delete.is_teardown and lease.is_setup
    assert not dag.get_task("create_vm").is_setup  # a failed create must not skip the delete
    assert delete.trigger_rule == "all_done_setup_success"
    assert "vm_lease" in delete.upstream_task_ids
    # The run's state: a last teardown that counts as a leaf fails the run unless all succeeded.
    check = dag.get_task("check_run_outcome")
    assert check.is_teardown and check.on_failure_fail_dagrun
    assert "delete_vm" in check.upstream_task_ids


def test_tags_retries_and_waiting_modes(dag):
    assert set(dag.tags) >= {"maxtext", "sft", "tpu"}
    assert dag.schedule is None or str(dag.timetable.summary) in ("None",)
    for task in dag.tasks:
        if task.task_id in ("vm_lease", "summarize_run", "check_run_outcome"):
            continue
        assert task.retries >= 1, task.task_id  # plan_run too: the Hub may be briefly unwell
    # Deferred to the triggerer between its checks; reschedule mode with training_wait_deferrable=false.
    assert dag.get_task("wait_for_final_checkpoint").deferrable is True
    assert dag.get_task("wait_for_final_checkpoint").mode == "reschedule"
    # Deferred to the triggerer while the VM does not answer; pokes with ssh_wait_deferrable=false.
    assert dag.get_task("wait_for_ssh").deferrable is True
    assert dag.dagrun_timeout is None  # a run timeout would skip the delete (apache/airflow#30264)


def test_a_slices_waits_are_deferrable_too(dag_bag):
    """Its training wait watches every host from the triggerer; reschedule mode with training_wait_deferrable=false."""
    slice_dag = dag_bag.dags["maxtext_sft_slice"]
    wait = slice_dag.get_task("wait_for_final_checkpoint")
    assert type(wait).__name__ == "SliceTrainingSensor"
    assert wait.deferrable is True and wait.mode == "reschedule"
    assert slice_dag.get_task("wait_for_ssh").deferrable is True


def test_params_cover_the_tutorial_with_its_defaults(dag):
    params = dag.params
    assert set(params.keys()) == set(defaults())
    for name, default in defaults().items():
        assert params[name] == default, name
    assert params["capacity"] == "reservation" and params["reservation"] is None  # plan_run asks for one
    for name in params.keys():
        assert params.get_param(name).description, name
        assert params.get_param(name).schema["title"], name
    assert params["machine_type"] == "ct6e-standard-8t"
    assert params["image_family"] == "ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e"
    assert params["dataset_name"] == "HuggingFaceH4/ultrachat_200k"


def test_the_params_are_serialized_once_held_by_the_dag_not_copied_into_each_task(dag):
    """A task made inside a DAG with Params gets a copy of them all, which Airflow serializes and
    validates per task: most of a parse (bench/dag_parse.py). The DAG holds them alone; a task's
    context gets them from the DAG when it runs (the tests that run the DAG show that)."""
    from airflow.serialization.serialized_objects import DagSerialization

    serialized = DagSerialization.to_dict(dag)["dag"]
    assert {name for name, _ in serialized["params"]} == set(defaults())
    assert [task["__var"]["task_id"] for task in serialized["tasks"] if "params" in task["__var"]] == []


def test_the_summary_reads_the_tasks_the_dag_made_and_lists_phases_in_its_order(dag):
    from maxtext_sft.tasks.summarize import phase_order

    summarize = dag.get_task("summarize_run")
    parts = summarize.op_kwargs["tasks"]
    assert set(parts.values()) <= set(dag.task_ids), parts
    assert parts["create_vm"] == "create_vm" and parts["training"] == "wait_for_final_checkpoint"
    assert dag.get_task("check_run_outcome").op_kwargs["vm_delete_task"] == parts["delete_vm"] == "delete_vm"
    # Every task before the summary, in the DAG's own topological order; what waits for it is left out.
    phases = phase_order(dag, "summarize_run")
    assert [t for t in phases if t != "publish_to_hub"] == TASK_ORDER[: TASK_ORDER.index("summarize_run")]
    assert phases.index("publish_to_hub") > phases.index("collect_outputs")
    assert "check_run_outcome" not in phases
    assert phase_order(dag, "collect_outputs")[-1] == "export_to_hf"


def test_the_graph_groups_the_tasks_by_the_runbooks_phases_keeping_their_ids(dag):
    from maxtext_sft.builders.pipeline import PHASES

    groups = {name: group for name, group in dag.task_group.children.items()}
    assert list(groups) == list(PHASES)  # nothing outside a phase, phases in the runbook's order
    members = {name: list(group.children) for name, group in groups.items()}
    assert members == {
        "plan": ["plan_run", "preflight"],
        "provision": ["vm_lease", "create_vm", "wait_for_ssh", "install_maxtext"],
        "train": ["convert_checkpoint", "start_training", "wait_for_final_checkpoint"],
        "export_and_publish": ["export_to_hf", "collect_outputs", "publish_to_hub"],
        "clean_up": ["delete_vm", "summarize_run", "check_run_outcome"],
    }
    assert sorted(t for ids in members.values() for t in ids) == sorted(dag.task_ids)  # ids unprefixed
    # The teardown semantics are the groups' members' own: the delete still tears down the lease.
    assert dag.get_task("delete_vm").is_teardown and "vm_lease" in dag.get_task("delete_vm").upstream_task_ids
    assert all(group.tooltip for group in groups.values())
