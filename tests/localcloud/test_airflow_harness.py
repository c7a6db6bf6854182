"""The environment the harness gives Airflow's components (localcloud.airflow_harness)."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading

import pytest

from localcloud.airflow_harness import Airflow
from tests.conftest import GC_THRESHOLDS, REPO
from tests.dags.conftest import AIRFLOW_SITE, AIRFLOW_TEST_SETTINGS


def test_site_folders_come_first_on_the_path_and_the_tests_one_sets_the_gc_thresholds(tmp_path):
    python_defaults = started_thresholds(None)  # isolated: this session's own are the tests'
    assert GC_THRESHOLDS != python_defaults

    env = Airflow(tmp_path / "home", AIRFLOW_TEST_SETTINGS, site_dirs=(AIRFLOW_SITE,))._component_env()
    assert env["PYTHONPATH"].split(os.pathsep) == [str(AIRFLOW_SITE), str(REPO / "plugins")]
    # Each component is `python -m airflow` in this environment: its interpreter starts with them.
    assert started_thresholds(env) == GC_THRESHOLDS

    wheel = tmp_path / "site-packages"
    plain = Airflow(tmp_path / "home", AIRFLOW_TEST_SETTINGS, installed_package=wheel)._component_env()
    assert plain["PYTHONPATH"] == str(wheel)  # no site folder: nothing but the package
    assert started_thresholds(plain) == python_defaults


def started_thresholds(env: dict[str, str] | None) -> tuple[int, ...]:
    """The GC thresholds of an interpreter started in `env` (None: isolated from this one's)."""
    isolated = ["-I"] if env is None else []
    probe = subprocess.run([sys.executable, *isolated, "-c", "import gc; print(*gc.get_threshold())"],
                           env=env, capture_output=True, text=True, timeout=60, check=True)
    return tuple(int(n) for n in probe.stdout.split())


class StallingApi(http.server.BaseHTTPRequestHandler):
    """An api-server that leaves its first `stalls` requests unanswered past the client's timeout."""

    stalls = 1
    seen: list[str] = []

    def do_GET(self):
        self._answer()

    def do_POST(self):
        self._answer()

    def _answer(self):
        type(self).seen.append(self.command)
        if len(self.seen) <= self.stalls:
            self.server.release.wait(10)  # answers nothing until the test is done with it
            return
        body = b'{"state": "running"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def stalling_api(tmp_path):
    StallingApi.seen, StallingApi.stalls = [], 1
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StallingApi)
    server.release = threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    airflow = Airflow(tmp_path / "home", AIRFLOW_TEST_SETTINGS)
    airflow.port = server.server_address[1]
    airflow.request_timeout = 0.5
    yield airflow
    server.release.set()
    server.shutdown()
    server.server_close()


def test_a_read_that_times_out_is_asked_again_once(stalling_api):
    assert stalling_api.request("GET", "/api/v2/x", auth=False) == {"state": "running"}
    assert StallingApi.seen == ["GET", "GET"]

    StallingApi.seen, StallingApi.stalls = [], 2  # a second timeout is the caller's to see
    with pytest.raises(TimeoutError):
        stalling_api.request("GET", "/api/v2/x", auth=False)
    assert StallingApi.seen == ["GET", "GET"]


def test_a_write_that_times_out_is_not_sent_again(stalling_api):
    # It may have been done (a run triggered): sending it again could do it twice.
    with pytest.raises(TimeoutError):
        stalling_api.request("POST", "/api/v2/x", body={}, auth=False)
    assert StallingApi.seen == ["POST"]
