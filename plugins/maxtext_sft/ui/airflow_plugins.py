"""The project's Airflow plugins, registered by the distribution's `airflow.plugins` entry point
(pyproject.toml): the Fine-tunes page in the UI's navigation with the task links, and the run-note
listener. Where the package is not installed, plugins/*_plugin.py hand the same classes to
Airflow's plugins folder instead (registered_by_entry_point says which).

Airflow loads plugins in every process (API server, scheduler, DAG processor, triggerer, task
processes), so this module imports only the link classes and the listener module; the page's
FastAPI app, its database queries and the plotting code are imported when the API server asks for
the app (`fastapi_apps`), and the listener imports what it needs only when a run ends.
"""

from __future__ import annotations

from functools import cache, cached_property
from importlib.metadata import entry_points

from airflow.plugins_manager import AirflowPlugin
from maxtext_sft.ui import run_notes
from maxtext_sft.ui.task_links import HubCommitLink, RunFolderConsoleLink, VmConsoleLink

FINE_TUNES_PREFIX = "/fine-tunes"  # maxtext_sft.ui.fine_tunes_page.URL_PREFIX, without importing it here


@cache  # both plugin files ask, in every process that loads plugins: the installed set is read once
def registered_by_entry_point() -> bool:
    """Whether an installed distribution registers these plugins (its `airflow.plugins` entry
    points): then the plugins folder must not register them again (Airflow reports a plugin
    registered twice as an import error)."""
    return any(point.value.startswith(f"{__name__}:") for point in entry_points(group="airflow.plugins"))


class MaxTextSftPlugin(AirflowPlugin):
    name = "maxtext_sft"
    # The UI shows the page in its navigation, framed, at /plugin/fine-tunes.
    external_views = [
        {"name": "Fine-tunes", "href": f"{FINE_TUNES_PREFIX}/", "destination": "nav", "url_route": "fine-tunes"}
    ]
    # The operators declare these links themselves; Airflow's docs ask for them here as well.
    # (`operators` is left empty: listed there, the API server would call get_link itself instead
    # of reading the URL the task stored.)
    operator_extra_links = [VmConsoleLink(), RunFolderConsoleLink(), HubCommitLink()]

    @cached_property
    def fastapi_apps(self) -> list[dict]:  # type: ignore[override]  # built when the API server asks
        from maxtext_sft.ui.fine_tunes_page import URL_PREFIX, create_app

        return [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "Fine-tunes"}]


class RunNotesPlugin(AirflowPlugin):
    """A fine-tune run's note says how it ended (maxtext_sft.ui.run_notes, a listener)."""

    name = "maxtext_sft_run_notes"
    listeners = [run_notes]
