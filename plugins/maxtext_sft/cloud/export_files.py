"""A run's export, wherever collect_outputs left it: its gs:// folder (a run with an output
location), or the folder on this worker that a run without one copied it to (`HOST:/path`).
`export_folder` gives the whole export as a local folder (the sample-generations DAG);
`ExportFiles` reads it one file at a time (publish_to_hub, so a worker needs room for one file).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from airflow.sdk.exceptions import AirflowException
from maxtext_sft.cloud.storage import StorageEndpointHook, split_gcs_uri


def export_folder(location: str, scratch: Path, *, gcp_conn_id: str) -> Path:
    """A folder holding the export at `location`: `scratch` after a download, or the worker's own
    folder. Fails, saying what to change, when the export is on another worker (a retry may run on
    the worker that holds it)."""
    if location.startswith("gs://"):
        StorageEndpointHook(gcp_conn_id=gcp_conn_id).download_folder(location, scratch)
        return scratch
    return _this_workers_folder(location)


def _this_workers_folder(location: str) -> Path:
    host, _, path = location.partition(":")
    if host != socket.gethostname() or not Path(path).is_dir():
        raise AirflowException(
            f"The export is in {path} on worker {host}, not on this one ({socket.gethostname()}): give the "
            "fine-tune an output_location so that every worker can read it (or share local_output_dir)"
        )
    return Path(path)


class ExportFiles:
    """The export at `location`, one file at a time: `sizes` lists its files (names relative to
    it, nested ones with "/"), `read_text` reads a small one, `local_file` lends one as a file on
    this worker. Names that would leave the folder (".." parts) are refused before anything is read."""

    def __init__(self, location: str, *, gcp_conn_id: str) -> None:
        self.location = location.rstrip("/")
        if location.startswith("gs://"):
            self._storage: StorageEndpointHook | None = StorageEndpointHook(gcp_conn_id=gcp_conn_id)
            self.sizes = self._storage.sizes_under(self.location)
            self._folder = None
        else:
            self._storage = None
            self._folder = _this_workers_folder(location)
            self.sizes = {
                path.relative_to(self._folder).as_posix(): path.stat().st_size
                for path in self._folder.rglob("*") if path.is_file()
            }
        leaving = sorted(name for name in self.sizes if PurePosixPath(name).is_absolute() or ".." in name.split("/"))
        if leaving:
            raise ValueError(f"objects under {location} whose names leave the folder: {leaving[:5]}")

    def read_text(self, name: str) -> str:
        if self._storage is not None:
            return self._storage.read_text(f"{self.location}/{name}")
        return (self._folder / name).read_text(encoding="utf-8")

    @contextmanager
    def local_file(self, name: str, scratch: Path) -> Iterator[Path]:
        """File `name` on this worker: downloaded into `scratch` and removed after the block, or
        the worker's own file (left in place)."""
        if self._storage is None:
            yield self._folder / name
            return
        bucket, prefix = split_gcs_uri(self.location)
        copy = scratch / "file"  # one at a time: the same name each time
        try:
            self._storage.download(bucket, f"{prefix}/{name}", filename=str(copy))
            yield copy
        finally:
            copy.unlink(missing_ok=True)
