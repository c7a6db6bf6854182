"""No module of the repository's own code imports itself again through other modules.

The graph is read from the source (ast), not from an import: every `import` and `from ... import`
anywhere in a file counts (top level, inside functions, under `if TYPE_CHECKING:`, in `try`), and
so does `importlib.import_module("literal")`. `from x import y` is an import of x.y when x.y is a
module here, else of x; relative imports are resolved against the importing module's package;
`import a.b.c` is an import of the longest of a.b.c, a.b, a that is a module here. The packages a
module's own name lies in (which Python initialises first) are not counted: a package whose
__init__ re-exports its modules would otherwise be a circle with each of them. Modules outside the
repository are left out.

The same graph keeps true the module lists that localcloud/compute and localcloud/hub give in
their docstrings (ORDERED_PACKAGES): each module imports only those listed below it.
"""

from __future__ import annotations

import ast
import functools
import re
from collections import deque
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Where each tree's modules are imported from: (the folder on sys.path, the tree in it). The
# repository's root and plugins/ are on sys.path (pytest.ini; plugins/ as in an Airflow
# deployment); the MaxText stand-in is the `maxtext` package on the VMs.
PACKAGES = [
    (".", "localcloud"),
    (".", "bench"),
    (".", "tests"),
    ("plugins", "."),
    ("localcloud/maxtext_standin", "maxtext"),
]
# Files loaded by their path (Airflow's DAG processor; the VM scripts), never imported by name:
# their imports count, nothing imports them.
SCRIPTS = ["dags", "include"]

# Top-level folders whose modules may still take part in a circle: a folder being restructured
# may wait here, e.g. ("plugins",). Its modules stay in the graph, but circles through them go
# unreported. Every other folder (bench, dags, include, localcloud, plugins, tests) is checked.
NOT_YET_CHECKED: tuple[str, ...] = ()


def module_table(repo: Path = REPO) -> dict[str, Path]:
    """Module name → file, for every .py file of PACKAGES and SCRIPTS (a script's name is its
    path, e.g. "dags/maxtext_sft.py", which no import statement can name)."""
    entries = sorted({(repo / entry).resolve() for entry, _ in PACKAGES}, key=lambda p: len(p.parts))
    table: dict[str, Path] = {}
    for entry, tree in PACKAGES:
        base = (repo / entry).resolve()
        for path in sorted((base / tree).rglob("*.py")):
            path = path.resolve()
            # A file belongs to the deepest sys.path entry above it (the stand-in is not
            # localcloud.maxtext_standin.maxtext).
            owner = max((e for e in entries if path.is_relative_to(e)), key=lambda p: len(p.parts))
            if owner != base or "__pycache__" in path.parts or not path.is_relative_to(repo.resolve()):
                continue
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts and all(part.isidentifier() for part in parts):
                table[".".join(parts)] = path
    for folder in SCRIPTS:
        for path in sorted((repo / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                table[path.relative_to(repo).as_posix()] = path.resolve()
    return table


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _known(target: str, table: dict[str, Path]) -> str | None:
    """The longest of target, its parents that is a module here."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in table:
            return candidate
    return None


def imports_of(name: str, path: Path, table: dict[str, Path]) -> dict[str, int]:
    """The modules here that module `name` imports → the line of the first such import."""
    found: dict[str, int] = {}

    def add(target: str | None, line: int) -> None:
        if target is not None and target != name:
            found.setdefault(target, line)

    package = _package_of(name, path) if "/" not in name else ""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_known(alias.name, table), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                if node.level - 1 > len(parts):
                    raise AssertionError(f"{path}:{node.lineno}: relative import beyond the top package")
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}" if base else alias.name
                add(submodule if submodule in table else _known(base, table) if base else None, node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and not node.args[0].value.startswith(".")
        ):
            add(_known(node.args[0].value, table), node.lineno)
    return found


def import_graph(table: dict[str, Path]) -> dict[str, dict[str, int]]:
    return {name: imports_of(name, path, table) for name, path in table.items()}


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest circle [a, b, ..., a] in each strongly connected part of `graph` that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    parts: list[set[str]] = []
    for root in sorted(graph):  # Tarjan's algorithm, iterative (no recursion limit)
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in graph:
                    continue
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        part.add(member)
                        if member == node:
                            break
                    parts.append(part)
    found = []
    for part in parts:
        if len(part) == 1 and next(iter(part)) not in graph[next(iter(part))]:
            continue
        start = min(part)
        came_from: dict[str, str] = {}
        queue = deque([start])
        while queue:  # breadth first from `start` back to it, inside the part
            node = queue.popleft()
            if start in graph[node]:
                circle = [start]
                while node != start:
                    circle.append(node)
                    node = came_from[node]
                found.append([start, *reversed(circle[1:]), start])
                break
            for succ in sorted(graph[node]):
                if succ in part and succ not in came_from and succ != start:
                    came_from[succ] = node
                    queue.append(succ)
    return found


def describe(circle: list[str], graph: dict[str, dict[str, int]], table: dict[str, Path], repo: Path = REPO) -> str:
    steps = [
        f"  {a} imports {b} ({table[a].relative_to(repo.resolve())}:{graph[a][b]})" for a, b in zip(circle, circle[1:])
    ]
    return " -> ".join(circle) + "\n" + "\n".join(steps)


@functools.cache
def repository() -> tuple[dict[str, Path], dict[str, dict[str, int]]]:
    """This repository's module table and import graph."""
    table = module_table()
    return table, import_graph(table)


def _root(path: Path, repo: Path = REPO) -> str:
    return path.relative_to(repo.resolve()).parts[0]


def test_the_repositorys_code_has_no_import_cycle():
    table, graph = repository()
    checked = {name for name, path in table.items() if _root(path) not in NOT_YET_CHECKED}
    within = {name: {t: line for t, line in graph[name].items() if t in checked} for name in checked}
    found = cycles(within)
    assert not found, "import circles:\n" + "\n".join(describe(c, graph, table) for c in found)


# Packages whose docstring lists each of their modules, every one importing only modules listed
# below it: the picture a reader starts from, kept true.
ORDERED_PACKAGES = ["localcloud.compute", "localcloud.hub"]


@pytest.mark.parametrize("package", ORDERED_PACKAGES)
def test_a_packages_modules_import_only_those_listed_below_them(package):
    table, graph = repository()
    order = re.findall(r"^\s*- (\w+):", ast.get_docstring(ast.parse(table[package].read_text())), re.M)
    members = {name.rpartition(".")[2] for name in table if name.rpartition(".")[0] == package}
    assert sorted(order) == sorted(members - {"__main__"})
    upward = [
        f"{module} imports {target}"
        for index, module in enumerate(order)
        for target in graph[f"{package}.{module}"]
        if target.rpartition(".")[0] == package and target.rpartition(".")[2] in order[: index + 1]
    ]
    assert upward == []


def test_every_tree_of_the_repository_is_in_the_graph():
    """A new top-level folder of Python code is read too."""
    table, _ = repository()
    roots = {_root(path) for path in table.values()}
    python_folders = {
        folder.name
        for folder in REPO.iterdir()
        if folder.is_dir() and not folder.is_symlink() and not folder.name.startswith(".")
        and folder.name not in ("build", "dist") and any(folder.rglob("*.py"))
    }
    assert python_folders <= roots
    assert set(NOT_YET_CHECKED) <= roots
    assert {"localcloud.compute.emulator", "maxtext_sft", "maxtext", "dags/maxtext_sft.py", "bench.run"} <= set(table)


def test_the_graph_finds_every_kind_of_import(tmp_path):
    """A circle made of each kind of import the graph must see, and an import that is none."""
    files = {
        "localcloud/__init__.py": "",
        "localcloud/a.py": "from . import b\n",  # a submodule named in `from . import`
        "localcloud/b.py": "def f():\n    from .sub.c import X\n",  # inside a function, relative
        "localcloud/sub/__init__.py": "from .c import X\n",  # a package re-exporting: no circle
        "localcloud/sub/c.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..d import Y\nX = 1\n"
        ),
        "localcloud/d.py": "import importlib\nE = importlib.import_module('localcloud.e')\n",
        "localcloud/e.py": "import localcloud.a\nimport json\n",  # closes the circle
        "localcloud/f.py": "from localcloud import sub\nfrom localcloud.sub import X\n",
        "bench/__init__.py": "",
        "bench/g.py": "from bench import h\n",
        "bench/h.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    table = module_table(tmp_path)
    graph = import_graph(table)
    assert graph["localcloud.f"] == {"localcloud.sub": 1}
    assert graph["bench.g"] == {"bench.h": 1}
    assert cycles(graph) == [
        ["localcloud.a", "localcloud.b", "localcloud.sub.c", "localcloud.d", "localcloud.e", "localcloud.a"]
    ]
    text = describe(cycles(graph)[0], graph, table, tmp_path)
    assert "localcloud.b imports localcloud.sub.c (localcloud/b.py:2)" in text
