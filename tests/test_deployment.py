"""The deployment files: docker-compose.yaml, its Dockerfile and .env.example.

No Docker engine is needed: Debian's docker-compose 1.29 (`make system-deps`) resolves the file
with `config`, and the Compose specification's JSON schema (shipped with it) checks the file as
written. The compose file is read from the repository but resolved in a temporary project
folder, so no .env is ever written here.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from airflow.models import Connection
from tests.conftest import REPO

COMPOSE_FILE = REPO / "docker-compose.yaml"
ENV_EXAMPLE = REPO / ".env.example"
COMPOSE_SPEC_SCHEMA = Path("/usr/lib/python3/dist-packages/compose/config/compose_spec.json")
AIRFLOW_SERVICES = {
    "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer",
    "airflow-worker", "airflow-init",
}
# The connection ids the DAGs use by default, and the type each must have.
PIPELINE_CONNECTIONS = {
    "AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT": "google_cloud_platform",
    "AIRFLOW_CONN_MAXTEXT_SFT_VM_SSH": "ssh",
    "AIRFLOW_CONN_HUGGINGFACE_DEFAULT": "generic",
}
# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}; `$${` is an escaped $.
INTERPOLATION = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)(:?[-?])?[^}]*\}")


def run_compose_config(project_dir: Path, env_file: Path) -> subprocess.CompletedProcess:
    docker_compose = shutil.which("docker-compose")
    assert docker_compose, "docker-compose 1.29 is missing: `make system-deps` installs Debian's"
    # A clean environment: variables of the shell would override the env file's.
    return subprocess.run(
        [docker_compose, "-f", str(COMPOSE_FILE), "--project-directory", str(project_dir),
         "--env-file", str(env_file), "config"],
        capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"], "HOME": str(project_dir)},
    )


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict:
    """The compose file as docker-compose resolves it with .env.example: anchors, merges, variables."""
    project_dir = tmp_path_factory.mktemp("compose-project")
    env_file = project_dir / "example.env"
    shutil.copy(ENV_EXAMPLE, env_file)
    done = run_compose_config(project_dir, env_file)
    assert done.returncode == 0, done.stderr
    return {"project_dir": project_dir, "config": yaml.safe_load(done.stdout)}


def env_example_values() -> dict[str, str]:
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values


def test_docker_compose_1_29_resolves_the_file_with_the_example_env(resolved):
    assert set(resolved["config"]["services"]) == AIRFLOW_SERVICES | {"postgres", "redis"}


def test_the_file_as_written_follows_the_compose_specification_schema():
    schema = json.loads(COMPOSE_SPEC_SCHEMA.read_text())
    document = yaml.safe_load(COMPOSE_FILE.read_text())
    # Its $schema names draft 2019-09 by a URI jsonschema does not know; say the draft outright.
    jsonschema.Draft201909Validator(schema).validate(document)
    assert "version" not in document  # obsolete in the specification; 1.29 does without it too


def test_a_missing_secret_stops_compose_naming_it(tmp_path):
    env_file = tmp_path / "example.env"
    env_file.write_text("".join(
        line + "\n" for line in ENV_EXAMPLE.read_text().splitlines() if not line.startswith("AIRFLOW_JWT_SECRET=")
    ))
    done = run_compose_config(tmp_path, env_file)
    assert done.returncode != 0
    assert "set AIRFLOW_JWT_SECRET in .env" in done.stderr


def test_every_airflow_service_mounts_the_project_and_shares_the_celery_setup(resolved):
    services, project_dir = resolved["config"]["services"], resolved["project_dir"]
    for name in AIRFLOW_SERVICES:
        service = services[name]
        mounts = {}
        for volume in service["volumes"]:
            source, target = volume.split(":")[:2]
            mounts[target] = source
        for folder in ("dags", "plugins", "include"):
            assert mounts.get(f"/opt/airflow/{folder}") == str(project_dir / folder), (name, folder)
        env = service["environment"]
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor", name
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://"), name
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].endswith("@postgres/airflow"), name
        assert env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://redis:6379/"), name
        assert env["MAXTEXT_SFT_INCLUDE_DIR"] == "/opt/airflow/include", name
        assert env["AIRFLOW__API_AUTH__JWT_SECRET"], name  # one secret for scheduler and API server
        assert service["depends_on"]["postgres"]["condition"] == "service_healthy", name
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name


def test_postgres_and_redis_have_health_checks(resolved):
    services = resolved["config"]["services"]
    assert services["postgres"]["image"] == "postgres:16"
    for name in ("postgres", "redis"):
        assert services[name]["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name


def test_the_worker_can_be_scaled(resolved):
    worker = resolved["config"]["services"]["airflow-worker"]
    assert "container_name" not in worker
    assert "ports" not in worker
    assert worker["command"] == "celery worker"


def test_the_dockerfile_builds_on_the_locked_airflow_and_python_and_installs_the_lock():
    lock = (REPO / "requirements.lock").read_text()
    [airflow_version] = re.findall(r"^apache-airflow==(\S+)$", lock, re.MULTILINE)
    [python_version] = re.findall(r"--python-version (\d+\.\d+)", lock)
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.findall(r"^FROM (\S+)", dockerfile, re.MULTILINE) == [f"apache/airflow:{airflow_version}-python{python_version}"]
    [install] = [line for line in dockerfile.splitlines() if line.startswith("RUN") and "requirements.lock" in line]
    assert re.search(r"\b(pip|uv pip) install\b.* -r \S*requirements\.lock", install), install
    assert "sync" not in install  # a sync would remove the image's packages the lock does not name
    ignored = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert not [pattern for pattern in ignored if fnmatch.fnmatch("requirements.lock", pattern)]
    assert ".env" in ignored  # the secrets never reach an image


def locked_versions(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", path.read_text(), re.MULTILINE))


def test_the_deployment_lock_carries_the_executor_and_database_and_no_test_tools():
    deployed = locked_versions(REPO / "requirements.lock")
    # What the official image has and installing the lock must keep (CeleryExecutor, PostgreSQL).
    assert {"apache-airflow-providers-celery", "celery", "redis", "apache-airflow-providers-postgres", "psycopg2-binary"} <= set(deployed)
    assert not {"pytest", "pytest-timeout", "hypothesis", "selenium"} & set(deployed)
    # The tests' environment is the deployment's plus the test tools, at the same versions.
    developed = locked_versions(REPO / "requirements-dev.lock")
    assert {name: developed.get(name) for name in deployed} == deployed
    assert {"pytest", "selenium"} <= set(developed)


def test_every_variable_the_compose_file_needs_is_in_the_env_example():
    needed = {name for name, modifier in INTERPOLATION.findall(COMPOSE_FILE.read_text()) if modifier in ("", "?", ":?")}
    assert needed, "the pattern found no variable: it no longer matches the file"
    assert needed - set(env_example_values()) == set()


def test_the_example_connections_are_airflow_connections_of_the_pipelines_types(resolved):
    # As the containers receive them: after docker-compose read the example env file.
    env = resolved["config"]["services"]["airflow-worker"]["environment"]
    for variable, conn_type in PIPELINE_CONNECTIONS.items():
        assert variable in env_example_values()
        conn_id = variable.removeprefix("AIRFLOW_CONN_").lower()
        connection = Connection.from_json(env[variable], conn_id=conn_id)
        assert connection.conn_type == conn_type, variable
    ssh = Connection.from_json(env["AIRFLOW_CONN_MAXTEXT_SFT_VM_SSH"], conn_id="maxtext_sft_vm_ssh")
    assert ssh.login and ssh.extra_dejson["private_key"].startswith("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    hugging_face = Connection.from_json(env["AIRFLOW_CONN_HUGGINGFACE_DEFAULT"], conn_id="huggingface_default")
    assert hugging_face.password
