"""The Airflow harness (localcloud.airflow_harness): components in their own process groups on
PostgreSQL, one killable alone, all stopped at the end."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from localcloud.airflow_harness import COMPONENTS, HOME_MARK, Airflow

pytestmark = pytest.mark.e2e


def marked_processes(home: Path) -> list[int]:
    """Live processes started for this Airflow home (they carry the harness's mark)."""
    mark = f"{HOME_MARK}={home}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if mark in Path(f"/proc/{name}/environ").read_bytes().split(b"\0"):
                if Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(name))
        except OSError:
            pass
    return found


def group_alive(pgid: int) -> bool:
    """Whether a process group has a live member (zombies waiting to be reaped do not count)."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                return True
    return False


@pytest.fixture
def database(postgres_server, migrated_database):
    """A copy of the migrated template: the harness's own `airflow db migrate` (about 25 s of CPU)
    runs in the bench's smoke run (tests/bench/test_bench_run.py) and `make run`."""
    name, url = migrated_database("harness")
    yield url
    postgres_server.drop_database(name)


def test_the_scheduler_can_be_killed_alone_and_stop_leaves_nothing(tmp_path, database):
    airflow = Airflow(tmp_path / "airflow-home", dict(os.environ), database_url=database, database_migrated=True)
    try:
        started = time.monotonic()
        airflow.start()
        print(f"harness started in {time.monotonic() - started:.0f} s")
        assert airflow.get("/api/v2/dags/maxtext_sft")["is_paused"] is False
        groups = {name: airflow.processes[name].pid for name in COMPONENTS}
        assert len(set(groups.values())) == 4 and all(os.getpgid(pgid) == pgid for pgid in groups.values())

        airflow.kill_scheduler()
        assert not group_alive(groups["scheduler"])
        assert not airflow.running("scheduler")
        for name in ("api-server", "dag-processor", "triggerer"):
            assert airflow.running(name) and group_alive(groups[name]), name
        assert airflow.health()["metadatabase"]["status"] == "healthy"  # the API still answers

        airflow.start_scheduler()
        assert airflow.running("scheduler")
    finally:
        airflow.stop()
    assert not any(group_alive(pgid) for pgid in groups.values())
    assert marked_processes(airflow.home) == []
