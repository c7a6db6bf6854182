"""Test-wide setup: an isolated Airflow home (SQLite), configured before anything imports Airflow."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from localcloud.cloud import LocalCloud
from localcloud.connections import (
    airflow_connection_env,
    generate_ssh_private_key,
    new_hf_token,
    prepare_local_cloud,
)
from localcloud.images import TUTORIAL_IMAGE, build_fast_image

REPO = Path(__file__).resolve().parents[1]
_AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="maxtext-sft-airflow-"))

os.environ.update(
    {
        "AIRFLOW_HOME": str(_AIRFLOW_HOME),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "false",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "false",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{_AIRFLOW_HOME}/airflow.db",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        # Retries in seconds, not the production half minute.
        "AIRFLOW__MAXTEXT_SFT__RETRY_DELAY_SECONDS": "1",
        # The local Hub has no Xet storage (see localcloud.connections); huggingface_hub reads this
        # when first imported, so it is set before anything imports it.
        "HF_HUB_DISABLE_XET": "1",
    }
)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_AIRFLOW_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def airflow_db() -> Path:
    """A migrated metadata database in the session's Airflow home."""
    subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"],
        check=True,
        capture_output=True,
        env=os.environ.copy(),
    )
    return _AIRFLOW_HOME


@pytest.fixture(scope="session")
def local_cloud(tmp_path_factory):
    image = build_fast_image()
    state = tmp_path_factory.mktemp("cloud")
    with LocalCloud(state, images={TUTORIAL_IMAGE: image}, keep_deleted_shm=True) as cloud:
        yield cloud


@pytest.fixture(scope="session")
def hf_token() -> str:
    return new_hf_token()


@pytest.fixture(scope="session")
def pipeline_connections(local_cloud, hf_token):
    prepare_local_cloud(local_cloud, hf_token)
    env = airflow_connection_env(local_cloud, generate_ssh_private_key(), hf_token)
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
