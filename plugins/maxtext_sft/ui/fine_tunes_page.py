"""The Fine-tunes page: every run of every fine-tune DAG, newest first, with its loss plot.

A FastAPI app the API server mounts under URL_PREFIX (plugins/fine_tunes_plugin.py builds it only
there, on first use). It reads the metadata database with the API server's own session and asks
the API server's auth manager who the caller is (the UI's `_token` cookie, or a bearer token) and
which DAGs they may read, as Airflow's own routes do: Airflow mounts a plugin's app as is, so the
app must check the user itself. The rows come from the XComs the runs left (maxtext_sft.results.fine_tunes).
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from typing import Annotated
from urllib.parse import quote, urlencode

from fastapi import FastAPI, HTTPException, Query, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.security import HTTPBearer
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.base_user import BaseUser
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import get_user
from airflow.models.dag import DagTag
from airflow.models.dagrun import DagRun, DagRunNote
from airflow.models.taskinstance import TaskInstance
from airflow.models.xcom import XComModel
from maxtext_sft.results.fine_tunes import (
    FINE_TUNE_TAG,
    OUTPUTS_TASK,
    PLAN_SPEC_KEY,
    PLAN_TASK,
    PUBLISH_TASK,
    SUMMARY_TASK,
    FineTuneRow,
    Link,
    fine_tune_row,
    loss_plot_series,
)

URL_PREFIX = "/fine-tunes"
RETURN_VALUE = "return_value"
MAX_ROWS = 500


def _readable_fine_tune_dags(session: Session, user: BaseUser) -> list[str]:
    """The fine-tune DAGs (tagged by fine_tune_dag) this user may read, sorted."""
    tagged = set(session.scalars(select(DagTag.dag_id).where(DagTag.name == FINE_TUNE_TAG)))
    readable = get_auth_manager().get_authorized_dag_ids(user=user, method="GET", session=session)
    return sorted(tagged & readable)


def _xcoms(session: Session, run_ids: Iterable[int]) -> dict[tuple[int, str], object]:
    """{(dag run id, task id): value} of the return values (and plan_run's spec) the page reads."""
    rows = session.scalars(
        select(XComModel).where(
            XComModel.dag_run_id.in_(list(run_ids)),
            XComModel.task_id.in_([PLAN_TASK, OUTPUTS_TASK, PUBLISH_TASK, SUMMARY_TASK]),
            XComModel.key.in_([RETURN_VALUE, PLAN_SPEC_KEY]),
            XComModel.map_index == -1,
        )
    )
    found = {}
    for row in rows:
        if (row.task_id == PLAN_TASK) == (row.key == PLAN_SPEC_KEY):  # plan_run's spec; the others' return values
            found[(row.dag_run_id, row.task_id)] = XComModel.deserialize_value(row)
    return found


def _ui_base(request: Request) -> str:
    """Airflow's own address prefix (empty unless it is served under a path)."""
    return request.scope.get("root_path", "").removesuffix(URL_PREFIX)


def _text(state) -> str | None:
    """A state enum's value ("success"), or None."""
    return str(getattr(state, "value", state)) if state else None


def _rows(session: Session, dag_ids: list[str], ui_base: str, limit: int) -> list[FineTuneRow]:
    runs = session.execute(
        select(DagRun.id, DagRun.dag_id, DagRun.run_id, DagRun.state, DagRun.logical_date, DagRun.run_after)
        .where(DagRun.dag_id.in_(dag_ids))
        .order_by(DagRun.run_after.desc(), DagRun.id.desc())
        .limit(limit)
    ).all()
    ids = [run.id for run in runs]
    values = _xcoms(session, ids)
    notes = dict(session.execute(select(DagRunNote.dag_run_id, DagRunNote.content).where(DagRunNote.dag_run_id.in_(ids))).all())
    publish_states = {
        (dag_id, run_id): _text(state)
        for dag_id, run_id, state in session.execute(
            select(TaskInstance.dag_id, TaskInstance.run_id, TaskInstance.state).where(
                TaskInstance.dag_id.in_({run.dag_id for run in runs}),
                TaskInstance.run_id.in_({run.run_id for run in runs}),
                TaskInstance.task_id == PUBLISH_TASK,
                TaskInstance.map_index == -1,
            )
        )
    }
    return [
        fine_tune_row(
            dag_id=run.dag_id,
            run_id=run.run_id,
            state=_text(run.state),
            logical_date=run.logical_date,
            run_after=run.run_after,
            run_page=f"{ui_base}/dags/{quote(run.dag_id, safe='')}/runs/{quote(run.run_id, safe='')}",
            spec=values.get((run.id, PLAN_TASK)),
            record=values.get((run.id, OUTPUTS_TASK)),
            published=values.get((run.id, PUBLISH_TASK)),
            summary=values.get((run.id, SUMMARY_TASK)),
            publish_state=publish_states.get((run.dag_id, run.run_id)),
            note=notes.get(run.id),
        )
        for run in runs
    ]


def _link(link: Link) -> str:
    if not link.url:
        return f"<span>{html.escape(link.text)}</span>"
    # A new tab outside Airflow's frame: the console and the Hub refuse to be framed.
    return f'<a href="{html.escape(link.url)}" target="_blank" rel="noopener">{html.escape(link.text)}</a>'


def _row_html(row: FineTuneRow) -> str:
    plot = (
        f'<img class="loss" alt="loss curve of {html.escape(row.run_id)}" loading="lazy" '
        f'src="loss.png?{html.escape(urlencode({"dag_id": row.dag_id, "run_id": row.run_id}))}">'
        if row.has_loss_plot else "-"
    )
    outputs = "<br>".join(_link(link) for link in row.outputs)
    # A failed run says why, in its note's words (the run's page shows the same note).
    cause = f'<div class="cause">{"<br>".join(html.escape(line) for line in row.cause.splitlines())}</div>' if row.cause else ""
    cells = [
        f"<b>{html.escape(row.dag_id)}</b>",
        f'{html.escape(row.logical_date)}<br><span class="state {html.escape(row.state)}">{html.escape(row.state)}</span>'
        f'<br><small>{html.escape(row.run_id)}</small>{cause}',
        html.escape(row.dataset), html.escape(row.steps), html.escape(row.train_loss), html.escape(row.eval_loss),
        html.escape(row.vm), _link(row.published), outputs, plot,
    ]
    return (f'<tr data-dag-id="{html.escape(row.dag_id)}" data-run-id="{html.escape(row.run_id)}">'
            + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")


COLUMNS = ("job", "logical date / state", "dataset snapshot", "steps", "train loss (final)",
           "eval loss (base → tuned)", "VM-hours, cost", "published", "outputs", "loss plot")

STYLE = """
body { font-family: system-ui, sans-serif; margin: 16px; color: #1a202c; background: #fff; }
h1 { font-size: 20px; margin: 0 0 12px; }
form { margin-bottom: 12px; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { border-bottom: 1px solid #e2e8f0; padding: 6px 8px; text-align: left; vertical-align: top; }
th { background: #f7fafc; position: sticky; top: 0; }
small { color: #718096; }
img.loss { width: 220px; height: auto; border: 1px solid #e2e8f0; }
.cause { color: #c53030; max-width: 360px; margin-top: 4px; }
.state { font-weight: 600; } .success { color: #2f855a; } .failed { color: #c53030; } .running { color: #2b6cb0; }
"""


def render_page(rows: list[FineTuneRow], dag_ids: list[str], selected: str | None) -> str:
    options = "".join(
        f'<option value="{html.escape(dag_id)}"{" selected" if dag_id == selected else ""}>{html.escape(dag_id)}</option>'
        for dag_id in dag_ids
    )
    body = "".join(_row_html(row) for row in rows) or f'<tr><td colspan="{len(COLUMNS)}">No runs yet.</td></tr>'
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Fine-tunes</title><style>{STYLE}</style></head>
<body><h1>Fine-tunes</h1>
<form method="get"><label>Job <select name="dag_id" id="job-filter" onchange="this.form.submit()">
<option value="">every fine-tune DAG</option>{options}</select></label> <button type="submit">Show</button>
<small>{len(rows)} run(s), newest first</small></form>
<table id="fine-tunes"><thead><tr>{"".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)}</tr></thead>
<tbody>{body}</tbody></table></body></html>"""


async def _user_or_none(request: Request) -> BaseUser | None:
    """The caller as Airflow's own routes find them (a bearer token, else the UI's `_token` cookie);
    None when there is none, or it expired."""
    try:
        return await get_user(request, None, await HTTPBearer(auto_error=False)(request))
    except HTTPException as error:
        if error.status_code in (status.HTTP_401_UNAUTHORIZED, status.HTTP_403_FORBIDDEN):
            return None
        raise


def create_app() -> FastAPI:
    app = FastAPI(title="Fine-tunes", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/", response_class=HTMLResponse)
    async def fine_tunes(
        request: Request, session: SessionDep, dag_id: Annotated[str | None, Query()] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_ROWS)] = 200,
    ):
        user = await _user_or_none(request)
        if user is None:  # like the rest of the UI: log in first, then come back here
            return RedirectResponse(get_auth_manager().get_url_login(next_url=str(request.url)), status.HTTP_303_SEE_OTHER)
        dag_ids = _readable_fine_tune_dags(session, user)
        shown = [dag_id] if dag_id in dag_ids else dag_ids
        rows = _rows(session, shown, _ui_base(request), limit) if shown else []
        return HTMLResponse(render_page(rows, dag_ids, dag_id if dag_id in dag_ids else None))

    @app.get("/loss.png")
    async def loss_plot(request: Request, session: SessionDep, dag_id: str, run_id: str):
        user = await _user_or_none(request)
        if user is None:
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, "Not authenticated")
        if dag_id not in _readable_fine_tune_dags(session, user):
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"No fine-tune DAG {dag_id!r} you may read")
        record = session.scalar(
            select(XComModel).where(
                XComModel.dag_id == dag_id, XComModel.run_id == run_id, XComModel.task_id == OUTPUTS_TASK,
                XComModel.key == RETURN_VALUE, XComModel.map_index == -1,
            )
        )
        history, eval_history = loss_plot_series(XComModel.deserialize_value(record) if record else None)
        if not history:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"Run {run_id} of {dag_id} has no loss history")
        from maxtext_sft.results.loss_curve import render_loss_curve  # the plotting code loads on the first plot only

        # Drawing takes a tenth of a second of CPU: off the API server's event loop.
        png = await run_in_threadpool(render_loss_curve, history, eval_history=eval_history or None)
        return Response(png, media_type="image/png", headers={"Cache-Control": "private, max-age=300"})

    return app
