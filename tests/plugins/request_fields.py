"""The fields each insert body of the pipeline sends that gcloud's capture of the same request does
not (the tutorial's, each capacity's, the slice's): the list docs/request-fields.md must give."""

from __future__ import annotations

import json
from typing import Any

from tests.conftest import REPO

FIXTURES = REPO / "tests" / "fixtures"
DOC = REPO / "docs" / "request-fields.md"


def field_paths(value: Any, prefix: str = "") -> set[str]:
    """Every leaf field of a REST JSON body as a dotted path; a list's items under `[]`, a
    metadata item under `[key=NAME]`, a label under its key (their keys are what is sent). Empty
    lists and objects count as unsent: the client library writes them for every unset field."""
    if isinstance(value, dict):
        if not value:
            return set()
        paths: set[str] = set()
        for key, item in value.items():
            paths |= field_paths(item, f"{prefix}.{key}" if prefix else key)
        return paths
    if isinstance(value, list):
        paths = set()
        for item in value:
            if prefix.endswith("metadata.items") and isinstance(item, dict) and "key" in item:
                paths.add(f"{prefix}[key={item['key']}]")
            else:
                paths |= field_paths(item, f"{prefix}[]")
        return paths
    return {prefix}


def _posts(requests: list[dict], suffix: str) -> dict:
    [body] = [r["body"] for r in requests if r["method"] == "POST" and r["path"].split("?")[0].endswith(suffix)]
    return body


def gcloud_bodies() -> dict[str, dict]:
    """gcloud 528's bodies: the tutorial's create (reservation-bound), each capacity's, the slice's."""
    tutorial = json.loads((FIXTURES / "gcloud-tutorial-requests.json").read_text())
    capacity = json.loads((FIXTURES / "gcloud-capacity-requests.json").read_text())["steps"]
    slices = json.loads((FIXTURES / "gcloud-slice-requests.json").read_text())["steps"]
    bodies = {"reservation": _posts(tutorial["requests"], "/instances")}
    for step in capacity:
        bodies[step["capacity"]] = _posts(step["requests"], "/instances")
    [template] = [s for s in slices if "instance-templates create" in s["command"]]
    [group] = [s for s in slices if "instance-groups managed create" in s["command"]]
    bodies["slice template"] = _posts(template["requests"], "/instanceTemplates")
    bodies["slice group"] = _posts(group["requests"], "/instanceGroupManagers")
    return bodies


def documented_fields() -> dict[str, set[str]]:
    """The doc's lists: under each `### BODY` heading, the first backticked path of each table row."""
    found: dict[str, set[str]] = {}
    section = None
    for line in DOC.read_text().splitlines():
        if line.startswith("### "):
            section = line[4:].strip()
            found[section] = set()
        elif section and line.startswith("| `"):
            found[section].add(line.split("`")[1])
    return found
