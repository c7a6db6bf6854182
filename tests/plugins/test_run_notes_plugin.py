"""The run-notes plugin is found by Airflow's plugins manager and costs little to import: Airflow
imports plugins in every one of its processes (docs/architecture.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO

PROBE = """
import json, sys
import airflow.plugins_manager, airflow.listeners
before = set(sys.modules)
from airflow._shared.module_loading import find_path_from_directory
files = sorted(find_path_from_directory(sys.argv[1], ".airflowignore", "glob"))
import run_notes_plugin
print(json.dumps({"files": files, "imported": sorted(set(sys.modules) - before),
                  "listeners": [m.__name__ for m in run_notes_plugin.RunNotesPlugin.listeners]}))
"""


def test_only_the_plugin_file_is_loaded_and_its_import_is_cheap():
    env = {**os.environ, "PYTHONPATH": str(REPO / "plugins")}
    done = subprocess.run([sys.executable, "-c", PROBE, str(REPO / "plugins")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    # The plugins manager imports every .py file it finds: the package's modules are not plugins.
    # (Its loader takes only .py files of what it walks: compiled bytecode beside them is walked too.)
    assert [os.path.relpath(path, REPO) for path in found["files"] if path.endswith(".py")] == [
        "plugins/fine_tunes_plugin.py", "plugins/run_notes_plugin.py"]
    assert found["listeners"] == ["maxtext_sft.ui.run_notes"]
    ours = sorted(name for name in found["imported"] if name.startswith("maxtext_sft"))
    # The plugins' module (both plugins: Airflow loads them in every process anyway), the listener,
    # the link classes and the pure helpers they use (the Fine-tunes row's text shares the summary's
    # wording of a wait for capacity); the rest is imported when a run ends.
    assert ours == ["maxtext_sft", "maxtext_sft.results", "maxtext_sft.results.fine_tunes",
                    "maxtext_sft.results.summary", "maxtext_sft.run",
                    "maxtext_sft.run.names", "maxtext_sft.ui", "maxtext_sft.ui.airflow_plugins",
                    "maxtext_sft.ui.run_notes", "maxtext_sft.ui.task_links"], ours
    heavy = [name for name in found["imported"] if name.split(".")[0] in ("google", "huggingface_hub", "paramiko", "slack_sdk")]
    assert heavy == []
