"""Compute Engine hook whose API endpoint can be set on the Google connection.

The provider's `ComputeEngineHook` always talks to compute.googleapis.com. A deployment that
uses a private endpoint (Private Service Connect, a regional endpoint, a proxy), and the local
cloud in tests, set the connection extra `compute_api_endpoint` in gcloud's format for
`api_endpoint_overrides/compute`, e.g. `https://compute-myendpoint.p.googleapis.com/compute/v1/`.
"""

from __future__ import annotations

from functools import cached_property

from google.api_core.client_options import ClientOptions
from google.cloud.compute_v1.services.instances import InstancesClient
from googleapiclient.discovery import build

from airflow.providers.google.cloud.hooks.compute import ComputeEngineHook
from airflow.providers.google.common.consts import CLIENT_INFO
from maxtext_sft.hooks.endpoints import endpoint_override

API_PATH = "compute/v1/"


class ComputeEngineEndpointHook(ComputeEngineHook):
    """`ComputeEngineHook` that honours the connection extra `compute_api_endpoint`.

    The hook uses two clients: google-cloud-compute (insert, get, delete), whose endpoint is the
    host root, and the discovery client (operations, metadata, addresses), whose endpoint is the
    full `.../compute/v1/` base URL. Both are derived from the one extra.
    """

    @cached_property
    def compute_api_endpoint(self) -> str | None:
        return endpoint_override(self, "compute_api_endpoint", API_PATH)

    def get_conn(self):
        if not self.compute_api_endpoint:
            return super().get_conn()
        if not self._conn:
            self._conn = build(
                "compute",
                self.api_version,
                http=self._authorize(),
                cache_discovery=False,
                client_options=ClientOptions(api_endpoint=self.compute_api_endpoint),
            )
        return self._conn

    def get_compute_instance_client(self) -> InstancesClient:
        if not self.compute_api_endpoint:
            return super().get_compute_instance_client()
        return InstancesClient(
            credentials=self.get_credentials(),
            client_info=CLIENT_INFO,
            client_options=ClientOptions(api_endpoint=self.compute_api_endpoint[: -len(API_PATH)].rstrip("/")),
        )
