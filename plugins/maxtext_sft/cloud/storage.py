"""GCS hook whose API endpoint can be set on the Google connection, and gs:// helpers.

Like `ComputeEngineEndpointHook`: a private endpoint (Private Service Connect, a proxy), or the
local cloud in tests, is the connection extra `storage_api_endpoint` in gcloud's format for
`api_endpoint_overrides/storage`, e.g. `https://storage-myendpoint.p.googleapis.com/storage/v1/`.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from google.api_core.client_options import ClientOptions
from google.api_core.exceptions import PreconditionFailed

from airflow.providers.google.cloud.hooks.gcs import GCSHook
from maxtext_sft.cloud.endpoints import endpoint_override
from maxtext_sft.run.names import ORBAX_COMMIT_MARKER, split_gcs_uri  # noqa: F401 - split_gcs_uri: its callers' import

API_PATH = "storage/v1/"
__all__ = ["ORBAX_COMMIT_MARKER", "StorageEndpointHook", "split_gcs_uri"]


class StorageEndpointHook(GCSHook):
    """`GCSHook` that honours the connection extra `storage_api_endpoint`."""

    @cached_property
    def storage_api_endpoint(self) -> str | None:
        return endpoint_override(self, "storage_api_endpoint", API_PATH)

    def get_client_options(self, api_endpoint_override: str | None = None) -> ClientOptions:
        if self.storage_api_endpoint and not api_endpoint_override:
            # google-cloud-storage wants the host root; it adds /storage/v1 itself.
            api_endpoint_override = self.storage_api_endpoint[: -len(API_PATH)].rstrip("/")
        return super().get_client_options(api_endpoint_override)

    def uri_exists(self, uri: str) -> bool:
        bucket, name = split_gcs_uri(uri)
        return self.exists(bucket, name)

    def committed_steps(self, checkpoints_uri: str) -> list[int]:
        """Checkpoint steps under `checkpoints_uri` whose Orbax commit marker exists, ascending.

        A step folder without the marker is being written, or was abandoned: it does not count.
        """
        bucket, prefix = split_gcs_uri(checkpoints_uri)
        steps = []
        for name in self.list(bucket, prefix=f"{prefix}/"):
            step, _, rest = name[len(prefix) + 1 :].partition("/")
            if step.isdigit() and rest == ORBAX_COMMIT_MARKER:
                steps.append(int(step))
        return sorted(steps)

    def create_once(self, uri: str, text: str) -> bool:
        """Write `uri` unless it exists (ifGenerationMatch=0); False when it already did."""
        bucket, name = split_gcs_uri(uri)
        blob = self.get_conn().bucket(bucket).blob(name)
        try:
            blob.upload_from_string(text, content_type="application/json", if_generation_match=0)
        except PreconditionFailed:
            return False
        return True

    def names_under(self, folder_uri: str) -> list[str]:
        """Object names directly or deeper under `folder_uri`, relative to it, sorted."""
        return sorted(self.sizes_under(folder_uri))

    def sizes_under(self, folder_uri: str) -> dict[str, int]:
        """{name relative to `folder_uri`: size in bytes} of every object under it."""
        bucket, prefix = split_gcs_uri(folder_uri)
        blobs = self.get_conn().list_blobs(bucket, prefix=f"{prefix}/")
        return {blob.name[len(prefix) + 1 :]: blob.size or 0 for blob in blobs}

    def download_folder(self, folder_uri: str, into: Path) -> list[str]:
        """Copy every object under `folder_uri` into the local folder `into`, under its name
        relative to the folder; returns those names, sorted. A name that would land outside `into`
        (`..` parts) is refused before anything is written."""
        bucket, prefix = split_gcs_uri(folder_uri)
        names = self.names_under(folder_uri)
        root = into.resolve()
        targets = [(root / name).resolve() for name in names]
        if outside := [name for name, target in zip(names, targets) if not target.is_relative_to(root)]:
            raise ValueError(f"objects under {folder_uri} whose names leave the folder: {outside[:5]}")
        for name, target in zip(names, targets):
            target.parent.mkdir(parents=True, exist_ok=True)
            self.download(bucket, f"{prefix}/{name}", filename=str(target))
        return names

    def delete_folder(self, folder_uri: str) -> int:
        """Delete every object under `folder_uri`; how many there were. One already gone is no
        error. (The client's own delete, not GCSHook.delete: that logs, and records as lineage,
        every object of a checkpoint.)"""
        bucket_name, prefix = split_gcs_uri(folder_uri)
        client = self.get_conn()
        blobs = list(client.list_blobs(bucket_name, prefix=f"{prefix}/"))
        client.bucket(bucket_name).delete_blobs(blobs, on_error=lambda blob: None)
        return len(blobs)

    def read_text(self, uri: str) -> str:
        bucket, name = split_gcs_uri(uri)
        return self.download(bucket, name).decode("utf-8")
