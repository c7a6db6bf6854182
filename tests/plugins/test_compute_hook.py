"""The Compute Engine hook's discovery client: built from a document parsed once per thread, at the
endpoint the connection names (or Google's), and the client library's requests unchanged."""

from __future__ import annotations

import json
import threading

import pytest

from maxtext_sft.cloud.compute import ComputeEngineEndpointHook, compute_discovery_document


def google_connection(monkeypatch, **extra) -> None:
    connection = {"conn_type": "google_cloud_platform", "extra": {"project": "p", "is_anonymous": True, **extra}}
    monkeypatch.setenv("AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT", json.dumps(connection))


def test_the_document_is_parsed_once_per_thread():
    mine = compute_discovery_document("v1")
    assert compute_discovery_document("v1") is mine
    assert mine["rootUrl"] == "https://compute.googleapis.com/" and "instances" in mine["resources"]
    theirs = []
    thread = threading.Thread(target=lambda: theirs.append(compute_discovery_document("v1")))
    thread.start()
    thread.join()
    # Another thread parses its own: the client library writes into the method descriptions.
    assert theirs[0] is not mine and theirs[0]["revision"] == mine["revision"]


def test_an_unknown_version_is_named():
    with pytest.raises(ValueError, match="no discovery document for compute v0"):
        compute_discovery_document("v0")


@pytest.mark.parametrize(
    "extra, base",
    [
        ({}, "https://compute.googleapis.com/compute/v1/"),
        ({"compute_api_endpoint": "http://127.0.0.1:9/compute/v1/"}, "http://127.0.0.1:9/compute/v1/"),
    ],
)
def test_the_client_sends_to_the_connections_endpoint(monkeypatch, extra, base):
    google_connection(monkeypatch, **extra)
    first = ComputeEngineEndpointHook().get_conn()
    second = ComputeEngineEndpointHook().get_conn()
    assert first is not second  # a client per hook; the parsed document is what they share
    for client in (first, second):
        request = client.instances().get(project="p", zone="z", instance="vm-1")
        assert request.uri.split("?")[0] == f"{base}projects/p/zones/z/instances/vm-1"
        assert request.method == "GET"
