"""The distribution says Python >= 3.11 (pyproject.toml) and MWAA and Astro run Airflow 3.3 on
Python 3.12; only 3.11 is installed on the machines this project is built on. What can be checked
from 3.11 of the code's fitness for 3.12 and 3.13 is checked here: no module those versions
removed is imported (PEP 594's dead batteries, distutils), no removed standard-library name is
called, and every file compiles with the warnings that 3.12 turns into SyntaxWarning (invalid
escape sequences) raised as errors."""

from __future__ import annotations

import ast
import contextlib
import gc
import warnings

import pytest

from tests.conftest import REPO

# The product code: the package, the DAG files and the Python the VM steps run.
SOURCES = sorted(
    [*(REPO / "plugins").rglob("*.py"), *(REPO / "dags").glob("*.py"), *(REPO / "include").rglob("*.py")]
)
# Removed in 3.12 (What's New in Python 3.12, "Removed") and 3.13 (PEP 594).
REMOVED_MODULES = {
    "asynchat", "asyncore", "distutils", "imp", "smtpd",
    "aifc", "audioop", "cgi", "cgitb", "chunk", "crypt", "imghdr", "mailcap", "msilib", "nis",
    "nntplib", "ossaudiodev", "pipes", "sndhdr", "spwd", "sunau", "telnetlib", "uu", "xdrlib", "lib2to3",
}
# Standard-library attributes 3.12 removed, as module.attribute.
REMOVED_NAMES = {
    "ssl.wrap_socket", "ssl.match_hostname", "configparser.SafeConfigParser", "configparser.readfp",
    "locale.format", "gzip.GzipFile.filename", "io.OpenWrapper", "unittest.findTestCases",
    "unittest.makeSuite", "unittest.getTestCaseNames", "pkgutil.ImpImporter", "pkgutil.ImpLoader",
}


def imported_modules(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def dotted_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names.add(f"{node.value.id}.{node.attr}")
    return names


@contextlib.contextmanager
def no_cyclic_collection():
    """No cyclic collection inside compile(): it would run earlier tests' finalizers there (an
    unclosed socket's ResourceWarning, an error under the check's filter, goes to pytest's
    unraisable hook, whose traceback formatting parses source with ast again), and 3.11's AST
    constructor, whose depth counter is shared, then fails with "SystemError: AST constructor
    recursion depth mismatch" (pytest-dev/pytest#10763, python/cpython#106905). Seen in CI at
    534bb45. One collection first, outside the filter; each one in a worker that has imported
    Airflow costs ~0.4 s, so not one per file (55 s a run, when it was)."""
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_the_sources_are_found():
    assert len(SOURCES) > 50 and REPO / "dags" / "maxtext_sft.py" in SOURCES


def test_nothing_python_3_12_or_3_13_removed_is_used():
    offences = {}
    with no_cyclic_collection():
        for path in SOURCES:
            with warnings.catch_warnings():
                # 3.11's DeprecationWarning for an invalid escape is 3.12's SyntaxWarning; as an
                # error, the compiler raises it as a SyntaxError.
                warnings.simplefilter("error")
                try:
                    tree = compile(path.read_text(), str(path), "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
                except SyntaxError as error:
                    offences[path.relative_to(REPO)] = str(error)
                    continue
            used = sorted((imported_modules(tree) & REMOVED_MODULES) | (dotted_names(tree) & REMOVED_NAMES))
            if used:
                offences[path.relative_to(REPO)] = used
    assert offences == {}


def test_the_check_sees_what_it_looks_for():
    tree = ast.parse("import distutils.util\nfrom imp import reload\nimport ssl\nssl.wrap_socket(s)\n")
    assert imported_modules(tree) & REMOVED_MODULES == {"distutils", "imp"}
    assert dotted_names(tree) & REMOVED_NAMES == {"ssl.wrap_socket"}
    # Raised as an error, the warning comes out of the compiler as a SyntaxError.
    with warnings.catch_warnings(), pytest.raises(SyntaxError, match="invalid escape sequence"):
        warnings.simplefilter("error")
        compile('pattern = "\\d+"', "escape.py", "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
