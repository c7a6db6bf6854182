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


def rows(url: str, query: str) -> list[tuple]:
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.connect() as connection:
            return [tuple(row) for row in connection.execute(sqlalchemy.text(query))]
    finally:
        engine.dispose()


def test_a_copy_of_the_migrated_template_holds_airflows_schema(postgres_server, migrated_database):
    """Every test Airflow starts on such a copy: of the template this worker migrated with
    `airflow db migrate`, or that it loaded from the SQL of the one another worker migrated."""
    name, url = migrated_database("schema_check")
    try:
        assert url.startswith("postgresql+psycopg2://postgres:")
        assert len(rows(url, "select version_num from alembic_version")) == 1
        assert rows(url, "select pool, slots from slot_pool") == [("default_pool", 128)]  # what migrate adds
        assert rows(url, "select count(*) from dag_run") == [(0,)]
    finally:
        postgres_server.drop_database(name)


def test_a_dumped_database_loads_into_a_new_one_and_a_load_stops_at_its_first_error(postgres_server, tmp_path):
    source = postgres_server.create_database("dump_source")
    engine = sqlalchemy.create_engine(source)
    with engine.begin() as connection:
        connection.execute(sqlalchemy.text("create table kept (id int primary key, word text)"))
        connection.execute(sqlalchemy.text("insert into kept values (1, 'one'), (2, 'two')"))
    engine.dispose()
    dump = tmp_path / "source.sql"
    try:
        postgres_server.dump_database("dump_source", dump)
        copy = postgres_server.create_database("dump_copy")
        postgres_server.load_database("dump_copy", dump)
        assert rows(copy, "select id, word from kept order by id") == [(1, "one"), (2, "two")]
        with pytest.raises(PostgresError, match='psql exited 3: .*relation "kept" already exists'):
            postgres_server.load_database("dump_copy", dump)  # the table is there: the load stops
    finally:
        postgres_server.drop_database("dump_source")
        postgres_server.drop_database("dump_copy")


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
