"""StorageEndpointHook: the provider's GCS hook on the connection's endpoint, and committed steps."""

from __future__ import annotations

import pytest

from maxtext_sft.cloud.storage import ORBAX_COMMIT_MARKER, StorageEndpointHook, split_gcs_uri

BUCKET = "hook-tests"


@pytest.fixture(scope="module")
def hook(local_cloud, pipeline_connections):
    local_cloud.create_bucket(BUCKET)
    return StorageEndpointHook(gcp_conn_id="google_cloud_default")


def test_the_hook_talks_to_the_connections_endpoint(hook, local_cloud):
    local_cloud.clear_storage_requests()
    hook.upload(BUCKET, "probe.txt", data="hello")
    assert hook.uri_exists(f"gs://{BUCKET}/probe.txt")
    assert not hook.uri_exists(f"gs://{BUCKET}/absent.txt")
    assert any(BUCKET in r["path"] for r in local_cloud.storage_requests())


def test_only_steps_with_the_commit_marker_count(hook):
    prefix = "run/checkpoints"
    for step in (1, 10):
        hook.upload(BUCKET, f"{prefix}/{step}/model_params/data", data="x")
        hook.upload(BUCKET, f"{prefix}/{step}/{ORBAX_COMMIT_MARKER}", data="")
    hook.upload(BUCKET, f"{prefix}/20/model_params/data", data="half written")  # no marker yet
    hook.upload(BUCKET, f"{prefix}/notastep/{ORBAX_COMMIT_MARKER}", data="")
    uri = f"gs://{BUCKET}/{prefix}"
    assert hook.committed_steps(uri) == [1, 10]
    hook.upload(BUCKET, f"{prefix}/20/{ORBAX_COMMIT_MARKER}", data="")
    assert hook.committed_steps(uri) == [1, 10, 20]


def test_delete_folder_removes_what_is_under_it_and_nothing_beside_it(hook):
    prefix = "prune/checkpoints"
    for name in ("3/model_params/a", "3/model_params/b", f"3/{ORBAX_COMMIT_MARKER}", "30/model_params/a"):
        hook.upload(BUCKET, f"{prefix}/{name}", data="x")
    assert hook.delete_folder(f"gs://{BUCKET}/{prefix}/3") == 3
    assert hook.names_under(f"gs://{BUCKET}/{prefix}") == ["30/model_params/a"]  # 30 starts with 3, and stays
    assert hook.delete_folder(f"gs://{BUCKET}/{prefix}/3") == 0


def test_create_once_writes_an_object_only_if_it_does_not_exist(hook):
    """The recovery ledger's guard: of two writers of the same entry, exactly one wins."""
    folder = f"gs://{BUCKET}/ledger"
    assert hook.create_once(f"{folder}/1.json", '{"first": true}')
    assert not hook.create_once(f"{folder}/1.json", '{"second": true}')
    assert hook.download(BUCKET, "ledger/1.json") == b'{"first": true}'
    assert hook.create_once(f"{folder}/2.json", "{}")
    assert hook.names_under(folder) == ["1.json", "2.json"]
    assert hook.names_under(f"gs://{BUCKET}/no-such-folder") == []


def test_sizes_and_text_of_an_export_in_storage(hook):
    folder = f"gs://{BUCKET}/export"
    hook.upload(BUCKET, "export/model.safetensors.index.json", data='{"weight_map": {}}')
    hook.upload(BUCKET, "export/model-00001-of-00002.safetensors", data=b"12345")
    hook.upload(BUCKET, "export/empty.safetensors", data=b"")
    hook.upload(BUCKET, "export-other/config.json", data="{}")  # beside the folder, not in it
    assert hook.sizes_under(folder) == {"model.safetensors.index.json": 18, "model-00001-of-00002.safetensors": 5,
                                        "empty.safetensors": 0}
    assert hook.read_text(f"{folder}/model.safetensors.index.json") == '{"weight_map": {}}'


def test_a_bad_endpoint_extra_is_refused(monkeypatch):
    monkeypatch.setenv(
        "AIRFLOW_CONN_BAD_GCS",
        '{"conn_type": "google_cloud_platform", "extra": {"storage_api_endpoint": "http://x/other/"}}',
    )
    with pytest.raises(ValueError, match="must end with /storage/v1/"):
        StorageEndpointHook(gcp_conn_id="bad_gcs").get_client_options()


@pytest.mark.parametrize(
    ("uri", "parts"),
    [("gs://b/a/b/", ("b", "a/b")), ("gs://bucket", ("bucket", "")), ("gs://bucket/x", ("bucket", "x"))],
)
def test_split_gcs_uri(uri, parts):
    assert split_gcs_uri(uri) == parts
