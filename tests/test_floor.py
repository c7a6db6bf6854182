"""Run by `make test-floor` only (MAXTEXT_SFT_FLOOR=1): the environment is the declared floor
(requirements-floor.txt) and the package under test is the installed wheel, so the other tests of
that run (the DAGs' parse, the pipeline under dag.test()) say what they say of the floor."""

from __future__ import annotations

import os
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.conftest import REPO

if os.environ.get("MAXTEXT_SFT_FLOOR") != "1":
    pytest.skip("the floor's own checks: make test-floor", allow_module_level=True)


def test_the_floor_versions_are_installed():
    pinned = {}
    for line in (REPO / "requirements-floor.txt").read_text().splitlines():
        name, _, wanted = line.partition("==")
        if wanted and not line.startswith("#") and not wanted.endswith("*"):
            pinned[name.strip()] = wanted.strip()
    assert pinned["apache-airflow"] == "3.3.1"
    assert {name: version(name) for name in pinned} == pinned


def test_the_package_and_its_plugins_come_from_the_installed_wheel():
    import maxtext_sft
    from airflow import plugins_manager

    assert "site-packages" in Path(maxtext_sft.__file__).parts, maxtext_sft.__file__
    assert version("maxtext-sft-airflow")
    names = sorted(info["name"] for info in plugins_manager.get_plugin_info())
    assert {"maxtext_sft", "maxtext_sft_run_notes"} <= set(names), names


def test_the_run_note_listener_is_registered_from_the_installed_wheel():
    from airflow.listeners.listener import get_listener_manager

    import maxtext_sft.ui.run_notes

    assert "site-packages" in Path(maxtext_sft.ui.run_notes.__file__).parts
    assert maxtext_sft.ui.run_notes in get_listener_manager().pm.get_plugins()


def test_the_floor_meets_every_requirement_the_wheel_declares():
    """What `pip install` of the wheel would check: each declared range (the slack extra's too)
    holds the floor's installed version, so nothing would be upgraded over a managed image's."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    unmet = []
    for line in requires("maxtext-sft-airflow"):
        requirement = Requirement(line)
        if requirement.marker and not requirement.marker.evaluate({"extra": "slack"}):
            continue
        installed = version(requirement.name)
        if not requirement.specifier.contains(installed, prereleases=True):
            unmet.append(f"{requirement} (installed {installed})")
    assert unmet == []
