"""The pages under docs/ and the README: every relative link resolves, and what a deployment
recipe copies from this repository matches the repository."""

from __future__ import annotations

import re
import tomllib

from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append((page.relative_to(REPO), target))
    assert broken == []


def test_the_deploy_pages_are_linked_from_the_readme():
    readme = REPO / "README.md"
    linked = set(LINK.findall(readme.read_text()))
    assert {f"docs/{page.name}" for page in (REPO / "docs").glob("deploy-*.md")} <= linked


def test_astros_requirements_are_the_distributions_without_airflow():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    page = (REPO / "docs" / "deploy-astro.md").read_text()
    [block] = re.findall(r"```requirements\n(.*?)```", page, re.S)
    assert block.split() == [line for line in declared if not line.startswith("apache-airflow>")]
