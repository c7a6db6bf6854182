"""How tasks read a run's export after the VM: a gs:// folder downloaded whole (nested names kept,
names that climb out refused) or one file at a time, or the folder on this worker; another
worker's refused."""

from __future__ import annotations

import socket
import uuid

import pytest

from airflow.sdk.exceptions import AirflowException
from maxtext_sft.cloud.export_files import ExportFiles, export_folder
from maxtext_sft.cloud.storage import StorageEndpointHook
from tests.conftest import local_bucket
from tests.plugins.test_outputs import SHARDS, write_export

pytestmark = pytest.mark.e2e


@pytest.fixture
def bucket(local_cloud, pipeline_connections):
    return local_bucket(local_cloud, "export-files")


def test_a_bucket_folder_is_downloaded_whole_with_its_nested_names(bucket, tmp_path):
    write_export(tmp_path / "export", "sharded")
    (tmp_path / "export" / "extra").mkdir()
    (tmp_path / "export" / "extra" / "notes.txt").write_text("nested")
    prefix = f"runs/{uuid.uuid4().hex}/hf-export"
    for path in sorted((tmp_path / "export").rglob("*")):
        if path.is_file():
            bucket.blob(f"{prefix}/{path.relative_to(tmp_path / 'export')}").upload_from_filename(str(path))
    bucket.blob(f"{prefix}-other/config.json").upload_from_string("{}")  # a sibling with the same start

    folder = export_folder(f"gs://{bucket.name}/{prefix}", tmp_path / "copy", gcp_conn_id="google_cloud_default")

    assert folder == tmp_path / "copy"
    copied = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert copied == sorted(["config.json", "tokenizer.json", "model.safetensors.index.json", *SHARDS, "extra/notes.txt"])
    assert (folder / SHARDS[1]).read_bytes() == b"weights" and (folder / "extra" / "notes.txt").read_text() == "nested"


def test_an_object_name_that_climbs_out_of_the_folder_is_refused_before_any_download(bucket, tmp_path):
    prefix = f"runs/{uuid.uuid4().hex}"
    bucket.blob(f"{prefix}/config.json").upload_from_string("{}")
    bucket.blob(f"{prefix}/../../escape.txt").upload_from_string("x")  # GCS names are just strings

    names = StorageEndpointHook(gcp_conn_id="google_cloud_default").names_under(f"gs://{bucket.name}/{prefix}")
    assert "../../escape.txt" in names  # the listing really holds it
    with pytest.raises(ValueError, match=r"names leave the folder: \['\.\./\.\./escape\.txt'\]"):
        export_folder(f"gs://{bucket.name}/{prefix}", tmp_path / "scratch" / "copy", gcp_conn_id="google_cloud_default")
    assert not (tmp_path / "scratch").exists() and not (tmp_path / "escape.txt").exists()


def test_a_folder_on_this_worker_is_used_where_it_is(tmp_path):
    write_export(tmp_path / "export", "single")
    location = f"{socket.gethostname()}:{tmp_path / 'export'}"
    assert export_folder(location, tmp_path / "unused", gcp_conn_id="unused") == tmp_path / "export"
    assert not (tmp_path / "unused").exists()


def test_a_folder_on_another_worker_is_refused_naming_output_location(tmp_path):
    with pytest.raises(AirflowException, match=r"on worker other-worker, not on this one .*output_location"):
        export_folder(f"other-worker:{tmp_path}", tmp_path / "copy", gcp_conn_id="unused")


def test_a_bucket_folder_is_read_one_file_at_a_time(bucket, tmp_path):
    write_export(tmp_path / "export", "sharded")
    prefix = f"runs/{uuid.uuid4().hex}/hf-export"
    for path in sorted((tmp_path / "export").rglob("*")):
        bucket.blob(f"{prefix}/{path.relative_to(tmp_path / 'export')}").upload_from_filename(str(path))
    bucket.blob(f"{prefix}/extra/notes.txt").upload_from_string("nested")

    files = ExportFiles(f"gs://{bucket.name}/{prefix}", gcp_conn_id="google_cloud_default")

    assert sorted(files.sizes) == sorted(["config.json", "tokenizer.json", "model.safetensors.index.json", *SHARDS,
                                          "extra/notes.txt"])
    assert files.sizes[SHARDS[1]] == len(b"weights") and files.read_text("extra/notes.txt") == "nested"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with files.local_file(SHARDS[1], scratch) as path:
        assert path.read_bytes() == b"weights" and list(scratch.iterdir()) == [path]
    assert list(scratch.iterdir()) == []  # gone before the next is fetched


def test_one_file_at_a_time_refuses_a_name_that_climbs_out_and_another_workers_folder(bucket, tmp_path):
    prefix = f"runs/{uuid.uuid4().hex}"
    bucket.blob(f"{prefix}/../../escape.txt").upload_from_string("x")
    with pytest.raises(ValueError, match=r"names leave the folder: \['\.\./\.\./escape\.txt'\]"):
        ExportFiles(f"gs://{bucket.name}/{prefix}", gcp_conn_id="google_cloud_default")
    with pytest.raises(AirflowException, match=r"on worker other-worker, not on this one .*output_location"):
        ExportFiles(f"other-worker:{tmp_path}", gcp_conn_id="unused")


def test_a_folder_on_this_worker_lends_its_own_files(tmp_path):
    write_export(tmp_path / "export", "single")
    files = ExportFiles(f"{socket.gethostname()}:{tmp_path / 'export'}", gcp_conn_id="unused")
    assert "model.safetensors" in files.sizes and files.read_text("config.json")
    with files.local_file("model.safetensors", tmp_path / "unused") as path:
        assert path == tmp_path / "export" / "model.safetensors"
    assert path.exists() and not (tmp_path / "unused").exists()
