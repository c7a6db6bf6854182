"""The project's Airflow plugin: the Fine-tunes page in the UI's navigation, and the task links.

Airflow loads this file in every component (API server, scheduler, dag-processor, triggerer, task
processes), so it imports only the link classes; the page's FastAPI app, its database queries and
the plotting code are imported when the API server asks for the app (`fastapi_apps`).
plugins/.airflowignore keeps Airflow's plugin loader out of maxtext_sft/: it is a package imported
by name, not a folder of plugins.
"""

from __future__ import annotations

from functools import cached_property

from airflow.plugins_manager import AirflowPlugin
from maxtext_sft.task_links import HubCommitLink, RunFolderConsoleLink, VmConsoleLink

FINE_TUNES_PREFIX = "/fine-tunes"  # maxtext_sft.fine_tunes_page.URL_PREFIX, without importing it here


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
        from maxtext_sft.fine_tunes_page import URL_PREFIX, create_app

        return [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "Fine-tunes"}]
