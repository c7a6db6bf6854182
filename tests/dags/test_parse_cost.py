"""DAG files are cheap to parse (docs/architecture.md, Cheap to parse): the heavy client libraries are imported
by the DAG processor's parent once (the airflow.* modules a DAG file names itself, which it
imports before it forks each parse) or by the tasks that use them, never by each parse.

Nothing is timed here (bench/dag_parse.py measures the seconds): each test reads which modules a
DAG file's parse itself imported, in a fresh process.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

# Client libraries that cost seconds to import (google.cloud.compute_v1 alone: thousands of
# message classes); none may be imported by a parse in the DAG processor's child.
HEAVY = ("google.cloud.compute_v1", "google.cloud.storage", "googleapiclient", "google.cloud.oslogin",
         "huggingface_hub", "paramiko")
# Imported only by the tasks that use them: a task process parses its DAG file without them.
TASK_TIME_ONLY = ("huggingface_hub", "paramiko", "google.cloud.oslogin")
PIPELINE_DAG_FILES = sorted(
    path.name for path in (REPO / "dags").glob("*.py")
    if "declared_job_dag(" in path.read_text() or "fine_tune_dag(" in path.read_text()
)
DAG_FILES = sorted(path.name for path in (REPO / "dags").glob("*.py"))
ASSET_HANDLER = re.compile(r"airflow\.providers\.[a-z_.]+\.(assets(\.[a-z_]+)?|version_compat)$")

# Parses each file in argv[2:] as the DAG processor's child (argv[1] == "processor": after the
# parent's pre-import, Airflow's own function; then it serializes the DAG, as the child does before
# it sends the result) or as a task runner does (only the Task SDK loaded first), and prints the
# modules each parse itself imported. As the DAG processor does, the role's modules are imported
# once and each parse runs in a child forked from there: the parse's own imports are measured
# in a fresh process at the cost of a fork, not of an interpreter start (~5 s of CPU each).
PROBE = """
import json, os, runpy, sys, traceback
import structlog
import airflow.sdk, airflow.sdk.execution_time.task_runner
role, paths = sys.argv[1], sys.argv[2:]
if role == "processor":
    from airflow.dag_processing.processor import _pre_import_airflow_modules
    from airflow.serialization.serialized_objects import DagSerialization
failed = []
for path in paths:
    pid = os.fork()
    if pid == 0:
        try:
            if role == "processor":
                _pre_import_airflow_modules(path, structlog.get_logger())
            before = set(sys.modules)
            namespace = runpy.run_path(path)
            if role == "processor":
                DagSerialization.to_dict(namespace["dag"])
            imported = sorted(set(sys.modules) - before)
            print("PARSED " + json.dumps({"path": path, "dag_id": namespace["dag"].dag_id, "imported": imported}), flush=True)
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
    if os.waitpid(pid, 0)[1] != 0:
        failed.append(path)
sys.exit(f"parse failed: {failed}" if failed else 0)
"""


@functools.cache  # one probe per role parses every DAG file; several tests read each parse
def parses(role: str) -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "plugins"),
           "AIRFLOW__DAG_PROCESSOR__PARSING_PRE_IMPORT_MODULES": "True"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, role, *(str(REPO / "dags" / name) for name in DAG_FILES)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = [json.loads(line.removeprefix("PARSED ")) for line in done.stdout.splitlines() if line.startswith("PARSED ")]
    return {Path(parsed["path"]).name: parsed for parsed in found}


def parse(file_name: str, role: str) -> dict:
    return parses(role)[file_name]


def heavy_among(modules: list[str], packages: tuple[str, ...]) -> list[str]:
    return sorted({package for package in packages for module in modules
                   if module == package or module.startswith(package + ".")})


def airflow_modules_not_pre_imported(modules: list[str]) -> list[str]:
    """The airflow.* modules among `modules`, but the providers' Asset handlers: the providers
    manager imports those (small, one set per installed provider) when the first Asset is made."""
    return [module for module in modules if module.startswith("airflow.") and not ASSET_HANDLER.match(module)]


def test_the_pipeline_dag_files_are_found():
    assert "maxtext_sft.py" in PIPELINE_DAG_FILES
    assert any(name.startswith("job_") for name in PIPELINE_DAG_FILES)


@pytest.mark.parametrize("file_name", DAG_FILES)
def test_a_parse_in_the_dag_processor_imports_no_heavy_client(file_name):
    parsed = parse(file_name, "processor")
    assert parsed["dag_id"]
    assert any(module.startswith("maxtext_sft") for module in parsed["imported"])  # the parse did import the package
    assert heavy_among(parsed["imported"], HEAVY) == []


@pytest.mark.parametrize("file_name", PIPELINE_DAG_FILES)
def test_a_pipeline_dag_file_names_every_airflow_module_its_parse_needs(file_name):
    """@task, EmptyOperator, the Asset handlers' shared modules and what serializing looks up: the
    parent imports them once instead of each parse (about 60 ms a parse)."""
    parsed = parse(file_name, "processor")
    assert airflow_modules_not_pre_imported(parsed["imported"]) == []


def test_without_the_pre_import_the_same_parse_imports_them():
    """The checks above can fail: a parse with nothing pre-imported does import the clients and
    Airflow's modules."""
    parsed = parse("maxtext_sft.py", "task")
    assert "google.cloud.compute_v1" in heavy_among(parsed["imported"], HEAVY)
    assert "airflow.sdk.definitions.decorators" in airflow_modules_not_pre_imported(parsed["imported"])


@pytest.mark.parametrize("file_name", DAG_FILES)
def test_a_task_process_parses_its_dag_file_without_the_hub_ssh_or_os_login_clients(file_name):
    parsed = parse(file_name, "task")
    assert heavy_among(parsed["imported"], TASK_TIME_ONLY) == []
