"""The local folder of a run's export, wherever collect_outputs left it: downloaded from its
gs:// folder (a run with an output location), or the folder on this worker that a run without
one copied it to (`HOST:/path`). Used by publish_to_hub and the sample-generations DAG.
"""

from __future__ import annotations

import socket
from pathlib import Path

from airflow.sdk.exceptions import AirflowException
from maxtext_sft.cloud.storage import StorageEndpointHook


def export_folder(location: str, scratch: Path, *, gcp_conn_id: str) -> Path:
    """A folder holding the export at `location`: `scratch` after a download, or the worker's own
    folder. Fails, saying what to change, when the export is on another worker (a retry may run on
    the worker that holds it)."""
    if location.startswith("gs://"):
        StorageEndpointHook(gcp_conn_id=gcp_conn_id).download_folder(location, scratch)
        return scratch
    host, _, path = location.partition(":")
    if host != socket.gethostname() or not Path(path).is_dir():
        raise AirflowException(
            f"The export is in {path} on worker {host}, not on this one ({socket.gethostname()}): give the "
            "fine-tune an output_location so that every worker can read it (or share local_output_dir)"
        )
    return Path(path)
