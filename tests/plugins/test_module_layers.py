"""The package's rooms import downward only, and the picture of them in the docs is the code's.

plugins/maxtext_sft is cut into subpackages ("rooms") by concern, lowest first in ROOMS. A module
may import from its own room and the rooms below it; a task (tasks/) imports no other task, only
tasks.base: what two tasks share lives a room down. Imports inside functions count too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "plugins" / "maxtext_sft"
PICTURE_PAGE = REPO / "docs" / "modules.md"

# Lowest first. A new room gets a row here, a docstring in its __init__.py, and a block in the picture.
ROOMS = ["run", "results", "ui", "cloud", "vm", "tasks", "builders"]
SHARED_BY_TASKS = {"tasks.base"}


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    return name.removesuffix(".__init__").removesuffix("__init__")


def imports_of(path: Path) -> set[str]:
    """The maxtext_sft modules `path` imports, anywhere in it (`from maxtext_sft.room import mod`
    counts as importing room.mod)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("maxtext_sft"):
            base = node.module.removeprefix("maxtext_sft").removeprefix(".")
            for alias in node.names:
                candidate = f"{base}.{alias.name}" if base else alias.name
                found.add(candidate if (PACKAGE / (candidate.replace(".", "/") + ".py")).exists() else base)
        elif isinstance(node, ast.Import):
            found |= {alias.name.removeprefix("maxtext_sft.") for alias in node.names if alias.name.startswith("maxtext_sft.")}
    return found - {""}


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if module_name(p)}


def room_of(name: str) -> str:
    return name.split(".")[0]


def test_every_module_is_in_a_room_and_every_room_says_what_it_owns():
    assert {room_of(name) for name in modules()} == set(ROOMS)
    assert not [p for p in PACKAGE.glob("*.py") if p.name != "__init__.py"], "a module outside every room"
    for room in ROOMS:
        assert ast.get_docstring(ast.parse((PACKAGE / room / "__init__.py").read_text())), room


def test_modules_import_only_from_their_room_or_below_and_tasks_never_from_each_other():
    wrong = []
    for name, path in modules().items():
        mine = ROOMS.index(room_of(name))
        for imported in sorted(imports_of(path)):
            theirs = ROOMS.index(room_of(imported))
            sideways = room_of(name) == "tasks" == room_of(imported) and imported not in SHARED_BY_TASKS | {name}
            if theirs > mine or sideways:
                wrong.append(f"{name} imports {imported}")
    assert wrong == []


def test_the_check_sees_an_upward_and_a_sideways_import(tmp_path):
    """The rule above is not vacuous: both forms of import are read."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from maxtext_sft.tasks.vm_sensors import VmSshReadySensor\n"
                     "from maxtext_sft.tasks import plan\n")
    assert imports_of(probe) == {"tasks.vm_sensors", "tasks.plan"}


def picture() -> str:
    """The fenced block under the modules page's `## The modules` heading."""
    text = PICTURE_PAGE.read_text()
    section = text.split("\n## The modules\n", 1)[1]
    return section.split("```", 2)[1]


def test_the_module_picture_names_every_module_in_its_room_lowest_last():
    block = picture()
    named = {f"{room}.{module}" for room, module in re.findall(r"\b([a-z_]+)/([a-z_]+)\.py", block) if room in ROOMS}
    assert named == {name for name in modules() if "." in name}
    # Rooms appear top to bottom highest first, as the picture says imports go downward.
    order = [room for room in re.findall(r"^([a-z_]+)/ ", block, re.M) if room in ROOMS]
    assert order == list(reversed(ROOMS))
