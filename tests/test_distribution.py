"""The installable distribution (pyproject.toml): its wheel holds the whole package and the files
the tasks read at run time, declares ranges rather than pins, and registers the Airflow plugins by
the `airflow.plugins` entry point, so that an Airflow with nothing from plugins/ (Cloud Composer's
scheduler and triggerer) loads them from the installed wheel, and one with both registers each once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "plugins" / "maxtext_sft"
PACKAGE_DATA = ("vm", "eval", "rehearsal", "jobs")  # include/ folders read at run time (jobs: the example)


def test_the_wheel_holds_every_module_and_the_run_time_files(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {f"maxtext_sft/{path.relative_to(PACKAGE).as_posix()}" for path in PACKAGE.rglob("*.py")}
    assert modules <= names
    for folder in PACKAGE_DATA:
        files = {f"maxtext_sft/include/{folder}/{path.name}" for path in (REPO / "include" / folder).iterdir() if path.is_file()}
        assert files and files <= names, folder
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]
    assert not [name for name in names if name.startswith(("tests/", "localcloud/", "dags/", "bench/"))]


def test_it_declares_ranges_and_registers_its_plugins_by_entry_point(wheel):
    archive = zipfile.ZipFile(wheel)
    [metadata] = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
    requires = [line.split(":", 1)[1].strip() for line in archive.read(metadata).decode().splitlines()
                if line.startswith("Requires-Dist:")]
    assert requires and not [r for r in requires if "==" in r.split(";")[0]], requires  # no pins (markers aside)
    assert any(r.startswith("apache-airflow<3.4,>=3.3.1") for r in requires), requires
    [points] = [name for name in archive.namelist() if name.endswith(".dist-info/entry_points.txt")]
    text = archive.read(points).decode()
    assert "[airflow.plugins]" in text
    assert "maxtext_sft = maxtext_sft.ui.airflow_plugins:MaxTextSftPlugin" in text
    assert "maxtext_sft_run_notes = maxtext_sft.ui.airflow_plugins:RunNotesPlugin" in text


PROBE = """
import json, sys
from airflow import plugins_manager
import maxtext_sft, maxtext_sft.run.paths, maxtext_sft.cloud.capacity, maxtext_sft.vm.steps
info = plugins_manager.get_plugin_info()
print(json.dumps({
    "plugins": sorted((p["name"], str(p.get("source"))) for p in info),
    "errors": plugins_manager.get_import_errors(),
    "package": maxtext_sft.__file__,
    "include": str(maxtext_sft.run.paths.include_dir()),
    "scripts": sorted(p.name for p in maxtext_sft.vm.steps.vm_scripts_dir().iterdir()),
}))
"""


def probe(site: Path, plugins_folder: Path, home: Path) -> dict:
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        "PYTHONPATH": str(site),
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(plugins_folder),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    }
    env.pop("MAXTEXT_SFT_INCLUDE_DIR", None)
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=home, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_with_an_empty_plugins_folder_the_plugins_load_from_the_installed_wheel(wheel_site, tmp_path):
    """Cloud Composer 3's scheduler and triggerer load no plugins folder: the wheel alone."""
    empty = tmp_path / "plugins"
    empty.mkdir()
    found = probe(wheel_site, empty, tmp_path)

    assert Path(found["package"]).is_relative_to(wheel_site)
    assert [name for name, _ in found["plugins"]] == ["maxtext_sft", "maxtext_sft_run_notes"]
    assert all("maxtext-sft-airflow" in source for _, source in found["plugins"]), found["plugins"]
    assert found["errors"] == {}
    # The VM scripts come from the package's data, not from a checkout.
    assert Path(found["include"]) == wheel_site / "maxtext_sft" / "include"
    assert sorted(path.name for path in (REPO / "include" / "vm").iterdir()) == found["scripts"]


def test_with_the_wheel_installed_the_plugins_folder_does_not_register_them_again(wheel_site, tmp_path):
    """The compose file and Astro mount plugins/ too: each plugin is registered once, by the wheel."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    for plugin_file in (REPO / "plugins").glob("*_plugin.py"):
        shutil.copy(plugin_file, folder)
    found = probe(wheel_site, folder, tmp_path)

    assert [name for name, _ in found["plugins"]] == ["maxtext_sft", "maxtext_sft_run_notes"]
    assert found["errors"] == {}
