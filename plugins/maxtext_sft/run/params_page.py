"""docs/params.md, written from the Params' declarations (run/params.py, run/bake.py): every Param of
every DAG with its type, default, allowed values, form section, help text and the DAGs that have
it. `make params-page` writes the page; tests/test_docs.py fails when it and the declarations
differ, so the page is never edited by hand.

    python -m maxtext_sft.run.params_page docs/params.md
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from maxtext_sft.run import bake
from maxtext_sft.run import params as run_params
from maxtext_sft.run.params import MAX_STRING_CHARS, Declared

BAKE_DAG = "maxtext_sft_bake_image"


def fine_tune_dags() -> dict[str, tuple[tuple[Declared, ...], Mapping[str, Any]]]:
    """The fine-tuning DAGs (dags/*.py) and what each has beyond the pipeline's Params: (extra
    rows, defaults of its own); read when called, as the DAG files read the declarations."""
    return {
        "maxtext_sft": ((), {}),
        "maxtext_sft_rehearsal": (run_params.REHEARSAL_PARAMS, run_params.REHEARSAL_DEFAULTS),
        "maxtext_sft_slice": (run_params.SLICE_PARAMS, run_params.SLICE_DEFAULTS),
    }


def _value(value: Any) -> str:
    if value is None:
        return "empty"
    if value == "" or value == []:
        return "empty"
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    """Text in a Markdown table cell: a `|` would end the cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def allowed(param: Declared) -> str:
    """What a value may be, as the declaration checks it."""
    parts = []
    if param.choices:
        parts.append("one of " + ", ".join(f"`{choice}`" for choice in param.choices))
    elif param.pattern is not None:
        parts.append(f"matches `{param.pattern.pattern}`" + (f" ({param.what})" if param.what else ""))
    if param.minimum is not None or param.maximum is not None:
        low = "" if param.minimum is None else f"{param.minimum:g}"
        high = "" if param.maximum is None else f"{param.maximum:g}"
        parts.append(f"from {low} to {high}" if low and high else f"at least {low}" if low else f"at most {high}")
    if param.type in ("string", "array"):
        limit = param.max_length or MAX_STRING_CHARS
        parts.append(f"at most {limit} characters" + (" each" if param.type == "array" else ""))
    if param.min_items:
        parts.append(f"at least {param.min_items} item{'s' if param.min_items > 1 else ''}")
    if param.nullable:
        parts.append("may be empty")
    return "; ".join(parts) or "any"


def _row(param: Declared, dags: str, default: str) -> str:
    cells = [f"`{param.name}`", param.title, param.type, default, allowed(param), dags, param.description]
    return "| " + " | ".join(_cell(cell) for cell in cells) + " |"


def _table(rows: Iterable[str]) -> list[str]:
    return ["| Param | form title | type | default | allowed | DAGs | what it does |",
            "|---|---|---|---|---|---|---|", *rows]


def render() -> str:
    """The whole page."""
    rows_by_section: dict[str, list[str]] = {}
    pipeline, dags_of = run_params.PARAMS, fine_tune_dags()
    names_in_order: list[Declared] = list(pipeline)
    for extra, _ in dags_of.values():
        names_in_order += [param for param in extra if param not in names_in_order]
    for param in names_in_order:
        dags = [dag for dag, (extra, _) in dags_of.items() if param in pipeline or param in extra]
        defaults = [f"{_value(param.default)}"]
        for dag in dags:
            own = dags_of[dag][1]
            if param.name in own:
                defaults.append(f"{_value(own[param.name])} in {dag}")
        rows_by_section.setdefault(param.section, []).append(_row(param, ", ".join(dags), "; ".join(defaults)))
    lines = [
        "# Params",
        "",
        "For: whoever triggers, schedules or declares runs (a run conf, the trigger form, a job's file).",
        "",
        "<!-- Written by `make params-page` from run/params.py and run/bake.py; tests/test_docs.py checks it. -->",
        "",
        "Every Param of every DAG, as its declaration has it: the trigger form's title and section, the",
        "type, the default (another DAG's own default after it), what a value may be (plan_run and",
        "preflight refuse anything else before a VM exists), which DAGs have it, and its help text. A",
        "declared job (`include/jobs/*.yaml`) sets values of `maxtext_sft`'s Params; a run conf sets",
        "any of them by name. Empty means null (or an empty string or list).",
        "",
        "The fine-tuning DAGs (`maxtext_sft`, its rehearsal and the multi-host slice) share one table:",
    ]
    for section, rows in rows_by_section.items():
        lines += ["", f"## {section}", "", *_table(rows)]
    lines += [
        "",
        f"## The bake DAG (`{BAKE_DAG}`)",
        "",
        "Its Params are rows of the same kind, most of them the pipeline's with help text of their own:",
        "",
        *_table(_row(param, BAKE_DAG, _value(param.default)) for param in bake.BAKE_PARAMS),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    Path(argv[0]).write_text(render())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
