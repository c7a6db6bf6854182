"""Airflow plugin from the plugins folder: the Fine-tunes page and the task links
(maxtext_sft.ui.airflow_plugins), unless the installed distribution registers it by its entry point."""

from __future__ import annotations

from maxtext_sft.ui.airflow_plugins import registered_by_entry_point

if not registered_by_entry_point():
    from maxtext_sft.ui.airflow_plugins import MaxTextSftPlugin  # noqa: F401 - found by Airflow's plugin loader
