"""Airflow plugin: a fine-tune run's note says how it ended (maxtext_sft.run_notes, a listener).

Cheap to import: Airflow loads plugins in every process, and the listener imports what it needs
only when a run ends.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin
from maxtext_sft import run_notes


class RunNotesPlugin(AirflowPlugin):
    name = "maxtext_sft_run_notes"
    listeners = [run_notes]
