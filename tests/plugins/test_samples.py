"""The sample DAG's fetch of a tuned model: either export layout, an incomplete one refused."""

from __future__ import annotations

import socket

import pytest

from airflow.sdk.exceptions import AirflowFailException
from maxtext_sft.tasks.samples import fetch_model
from tests.plugins.test_outputs import SHARDS, write_export


@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_a_model_on_this_worker_is_read_with_its_weights(tmp_path, layout):
    write_export(tmp_path / "export", layout)
    folder, export = fetch_model(f"{socket.gethostname()}:{tmp_path / 'export'}", tmp_path / "copy", gcp_conn_id="unused")
    assert folder == tmp_path / "export"  # read where it is: this worker holds it
    assert export.layout == layout
    assert all((folder / name).read_bytes() == b"weights" for name in export.weight_files)
    assert export.weight_files == (tuple(SHARDS) if layout == "sharded" else ("model.safetensors",))


def test_a_model_missing_a_shard_is_refused_before_generating(tmp_path):
    write_export(tmp_path / "export", "sharded")
    (tmp_path / "export" / SHARDS[0]).unlink()
    location = f"{socket.gethostname()}:{tmp_path / 'export'}"
    with pytest.raises(AirflowFailException, match=rf"The model at {location} is incomplete: the shards \['{SHARDS[0]}'\]"):
        fetch_model(location, tmp_path / "copy", gcp_conn_id="unused")


def test_an_unset_generation_python_skips_saying_how_and_a_wrong_one_fails(monkeypatch, tmp_path):
    from airflow.sdk.exceptions import AirflowSkipException
    from maxtext_sft.tasks.samples import generation_python

    monkeypatch.delenv("AIRFLOW__MAXTEXT_SFT__GENERATION_PYTHON", raising=False)
    with pytest.raises(AirflowSkipException, match="generation_python is unset"):
        generation_python()
    monkeypatch.setenv("AIRFLOW__MAXTEXT_SFT__GENERATION_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(AirflowFailException, match="which is no file"):
        generation_python()
    (tmp_path / "python3").write_text("")
    monkeypatch.setenv("AIRFLOW__MAXTEXT_SFT__GENERATION_PYTHON", str(tmp_path / "python3"))
    assert generation_python() == str(tmp_path / "python3")
