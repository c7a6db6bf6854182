"""The private PostgreSQL server the scheduler tests run Airflow on (localcloud.postgres)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy

from localcloud.postgres import PostgresError, PostgresServer
from tests.conftest import POSTGRES_ROOT, REPO


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_airflow_db_migrate_works_against_the_session_server(postgres_url):
    assert postgres_url.startswith("postgresql+psycopg2://postgres:")
    result = subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"],
        env={**os.environ, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": postgres_url},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    engine = sqlalchemy.create_engine(postgres_url)
    try:
        with engine.connect() as connection:
            assert connection.execute(sqlalchemy.text("select count(*) from alembic_version")).scalar() == 1
            assert connection.execute(sqlalchemy.text("select count(*) from dag_run")).scalar() == 0
    finally:
        engine.dispose()


# A run that dies without stopping its server (as a killed pytest would).
_DEAD_RUN = """
import json, os, sys
from pathlib import Path
from localcloud.postgres import PostgresServer
server = PostgresServer(Path(sys.argv[1]))
server.start()
print(json.dumps({"pids": server.processes(), "postmaster": server.pgid}), flush=True)
os._exit(0)
"""


def test_a_dead_runs_server_is_replaced_and_a_stopped_server_leaves_no_process():
    root = POSTGRES_ROOT.with_name(f"{POSTGRES_ROOT.name}-lifecycle-{os.getpid()}")
    left = subprocess.run(
        [sys.executable, "-c", _DEAD_RUN, str(root)], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    leftover = json.loads(left.stdout)
    assert leftover["postmaster"] in leftover["pids"]
    assert alive(leftover["postmaster"])

    server = PostgresServer(root)
    try:
        url = server.start()
        assert not any(alive(pid) for pid in leftover["pids"]), "the dead run's server is still running"
        engine = sqlalchemy.create_engine(url)
        try:
            with engine.connect() as connection:
                assert connection.execute(sqlalchemy.text("select 1")).scalar() == 1
        finally:
            engine.dispose()
        # One server per folder: a live one is never taken over.
        with pytest.raises(PostgresError, match="in use"):
            PostgresServer(root).start()
        pids = server.processes()
        assert server.pgid in pids and len(pids) > 1  # the postmaster and its backends
    finally:
        server.stop()
    assert not [pid for pid in pids if alive(pid)]
    assert server.processes() == []
    assert not server.data_dir.exists()
    shutil.rmtree(root)
