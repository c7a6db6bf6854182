"""The package's modules import downward only (docs/architecture.md, The modules).

Each module of plugins/maxtext_sft belongs to one layer; it may import from the layers below
its own and, except for the tasks' layer, from its own. The tasks (operators, sensors and the
functions the DAG builders make tasks of) never import one another: what two of them share
lives a layer down. Imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "plugins" / "maxtext_sft"

# Lowest first. A new module gets a row here, and a line in the picture in docs/architecture.md.
LAYERS: list[tuple[str, set[str]]] = [
    ("the run's spec", {
        "catalog", "paths", "run_params", "params", "run_names", "rehearsal_kit", "maxtext_args", "compute_body",
        "spec", "bake", "slice_body",
    }),
    ("pure helpers", {
        "cloud_errors", "sizing", "snapshots", "loss_curve", "training_metrics", "outputs", "lineage", "rehearsal",
        "run_summary", "run_story", "fine_tunes",
    }),
    ("hooks", {
        "hooks.endpoints", "hooks.compute", "hooks.storage", "hooks.hub", "hooks.os_login", "hooks.vm_ssh",
        "hooks.vm_ssh_async", "hooks.vm_ssh_common",
    }),
    ("the VM and the cloud", {
        "instances", "vm_steps", "vm_access", "vm_remake", "vm_recovery", "export_files", "triggers.capacity", "run_task",
        "task_links", "triggers.slice", "triggers.vm_ssh", "triggers.training", "triggers.ssh_ready",
        "slice_hosts", "trigger_start",
    }),
    ("tasks", {
        "operators.compute", "operators.slice", "operators.vm_script", "operators.outputs", "sensors.vm", "plan", "preflight",
        "summarize", "outcome", "phase_timing", "samples", "janitor", "notifier",
    }),
    ("DAG builders", {"dag_settings", "pipeline", "bake_pipeline", "jobs"}),
    # The logic of the Airflow plugins (plugins/*_plugin.py): the run-note listener the scheduler
    # calls, and the Fine-tunes page the API server serves.
    ("Airflow plugins", {"run_notes", "fine_tunes_page", "airflow_plugins"}),
]
NO_SIDEWAYS = {"tasks"}


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    return name.removesuffix(".__init__").removesuffix("__init__")


def imports_of(path: Path) -> set[str]:
    """The maxtext_sft modules `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        found |= {name.removeprefix("maxtext_sft.") for name in names if name.startswith("maxtext_sft.")}
    return found


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if module_name(p)}


def test_every_module_has_a_layer():
    placed = set().union(*(members for _, members in LAYERS))
    assert set(modules()) - {"hooks", "operators", "sensors", "triggers"} == placed


def test_modules_import_only_from_lower_layers_and_tasks_never_from_each_other():
    layer_of = {name: index for index, (_, members) in enumerate(LAYERS) for name in members}
    wrong = []
    for name, path in modules().items():
        if name not in layer_of:
            continue  # a package's empty __init__
        for imported in sorted(imports_of(path)):
            mine, theirs = layer_of[name], layer_of[imported]
            sideways = mine == theirs and LAYERS[mine][0] in NO_SIDEWAYS
            if theirs > mine or sideways:
                wrong.append(f"{name} ({LAYERS[mine][0]}) imports {imported} ({LAYERS[theirs][0]})")
    assert wrong == []


def test_the_check_sees_a_sideways_import(tmp_path):
    """The rule above is not vacuous: an operator importing a sensor's module would be caught."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from maxtext_sft.sensors.vm import VmSshReadySensor\n")
    assert imports_of(probe) == {"sensors.vm"}
