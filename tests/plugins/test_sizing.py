"""Real run sizes from the model's shape, and preflight's refusals of what cannot fit."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from localcloud.connections import LOCAL_RUN_CONF
from maxtext_sft.tasks.preflight import PreflightFailed, check_room
from maxtext_sft.run.sizing import GB, MODEL_SHAPES, Gemma3Shape, RunSizes, prunable_steps, run_sizes, saved_steps
from tests.plugins.test_spec import make_spec as spec_of


def safetensors_parameters(path: Path) -> int:
    """Elements of every tensor a .safetensors file holds, read from its header alone."""
    with path.open("rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    return sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")


def test_gemma3_4b_has_the_published_parameter_count():
    # Google's Gemma 3 model card: the 4B model has 4.3B parameters, of which the SigLIP vision
    # encoder is about 417M (its technical report, Table 1: 417M vision, 3,209M non-embedding, 675M embedding).
    shape = MODEL_SHAPES["gemma3-4b"]
    assert round((shape.text_parameters() + shape.vision_parameters()) / 1e9, 1) == 4.3
    assert round(shape.vision_parameters() / 1e6) in range(415, 421)
    embedding = shape.vocab_size * shape.hidden_size
    assert round((shape.text_parameters() - embedding) / 1e6) in range(3200, 3215)


def test_real_sizes_of_a_gemma3_4b_run():
    sizes = run_sizes("gemma3-4b")
    assert sizes == RunSizes.of(MODEL_SHAPES["gemma3-4b"])
    assert 8.5 * GB < sizes.hf_download < 8.7 * GB  # the Hub's two safetensors files, bf16
    assert sizes.converted_checkpoint == sizes.export == sizes.text_parameters * 2
    assert 46 * GB < sizes.training_checkpoint < 47 * GB  # fp32 weights and two AdamW moments
    assert run_sizes("llama3.1-8b") is None


def test_saved_steps_counts_the_first_every_period_and_the_last():
    assert saved_steps(1000, 10000) == 2  # the tutorial: step 1 and step 1000
    assert saved_steps(1000, 100) == 11  # 1, 100, ..., 1000
    assert saved_steps(1000, 300) == 5  # 1, 300, 600, 900, 1000
    assert saved_steps(1, 10) == 1


def test_pruning_keeps_the_newest_committed_steps():
    assert prunable_steps([1, 100, 200, 300], 2) == [1, 100]
    assert prunable_steps([1, 100], 2) == [] and prunable_steps([], 2) == []
    assert prunable_steps([1, 100, 200], 1) == [1, 100]
    assert prunable_steps([1, 100, 200], None) == []  # empty Param: keep all


def test_the_tutorials_run_fits():
    found = check_room(spec_of(), worker_free_bytes=100 * GB)
    assert "gemma3-4b (3.88B parameters trained) fits" in found


def test_a_boot_disk_without_room_for_the_download_is_refused():
    with pytest.raises(PreflightFailed, match=r"boot disk of 40 GB cannot hold 50\.6 GB \(the gemma3-4b download 8\.6 GB"):
        check_room(spec_of(boot_disk_size_gb=40), worker_free_bytes=100 * GB)
    # A base checkpoint read from a folder on the VM downloads nothing.
    spec = spec_of(boot_disk_size_gb=42, convert_extra_args=["--hf_model_path=/data/gemma"])
    assert "fits" in check_room(spec, worker_free_bytes=100 * GB)


def test_checkpoints_that_stay_on_the_vm_must_fit_in_its_ram_disk():
    # 1 + 100 checkpoints of 46.6 GB cannot stay in /dev/shm (768 GiB on a v6e-8) ...
    with pytest.raises(PreflightFailed, match=r"/dev/shm on ct6e-standard-8t .* 101 training checkpoints of 46\.6 GB"):
        check_room(spec_of(steps=1000, checkpoint_period=10), worker_free_bytes=100 * GB)
    # ... but with an output location they go to storage, and only the export is written there.
    durable = spec_of(steps=1000, checkpoint_period=10, output_location="gs://team/sft")
    assert "/dev/shm 7.8 GB" in check_room(durable, worker_free_bytes=None)
    # A smaller machine has a smaller RAM disk: 96 GiB on a v6e-1 holds the tutorial's two.
    with pytest.raises(PreflightFailed, match=r"/dev/shm on ct6e-standard-1t"):
        check_room(spec_of(machine_type="ct6e-standard-1t", checkpoint_period=500), worker_free_bytes=100 * GB)


def test_the_worker_must_have_room_for_the_export_it_copies():
    with pytest.raises(PreflightFailed, match=r"local_output_dir has 5\.0 GB free, not the 7\.8 GB of the export"):
        check_room(spec_of(), worker_free_bytes=5 * GB)
    assert "fits" in check_room(spec_of(output_location="gs://team/sft"), worker_free_bytes=None)


def test_the_worker_that_publishes_must_have_room_for_the_largest_file_it_fetches():
    # gemma3-4b's export is 7.8 GB; MaxText shards it at 3 GiB, the most publish_to_hub holds at once.
    publishing = spec_of(output_location="gs://team/sft", hub_repo_id="team/gemma-sft")
    with pytest.raises(PreflightFailed, match=r"temporary folder .* has 2\.0 GB free, not the 3\.2 GB of the export's largest file"):
        check_room(publishing, worker_free_bytes=None, publish_free_bytes=2 * GB)
    assert "fits" in check_room(publishing, worker_free_bytes=None, publish_free_bytes=4 * GB)
    # A run that does not publish fetches nothing there.
    assert "fits" in check_room(spec_of(output_location="gs://team/sft"), worker_free_bytes=None, publish_free_bytes=0)


def test_a_model_without_a_known_shape_is_not_checked():
    assert "not checked" in check_room(spec_of(model_name="llama3.1-8b"), worker_free_bytes=0)


@pytest.mark.real_maxtext
def test_the_formula_counts_the_toy_checkpoint_exactly():
    """The toy model has gemma3-4b's structure at tiny widths: the same formula must count its
    safetensors tensors exactly, so a real model's count is the formula at the real widths."""
    from localcloud import images

    model = images.build_real_image() / "toy" / "model"
    shape = Gemma3Shape.from_hf_config(json.loads((model / "config.json").read_text()))
    assert shape.text_parameters() + shape.vision_parameters() == safetensors_parameters(model / "model.safetensors")


def test_local_run_conf_names_a_model_with_a_shape():
    """The local cloud's toy plays gemma3-4b, so preflight sizes local runs as a real 4B run."""
    assert LOCAL_RUN_CONF.get("model_name", "gemma3-4b") in MODEL_SHAPES


def test_the_sample_dag_refuses_a_model_the_worker_cannot_load():
    from airflow.sdk.exceptions import AirflowFailException
    from maxtext_sft.tasks.samples import available_memory_bytes, check_worker_can_load

    export = run_sizes("gemma3-4b").export  # a real 4B export, 7.8 GB
    with pytest.raises(AirflowFailException, match=r"loading it takes about 19\.4 GB of memory and 8\.0 GB is available"):
        check_worker_can_load(export, available_memory=8 * GB, free_disk=100 * GB, location="gs://team/sft/hf-export")
    with pytest.raises(AirflowFailException, match=r"temporary folder has 2\.0 GB free for the model's 7\.8 GB"):
        check_worker_can_load(export, available_memory=64 * GB, free_disk=2 * GB, location="gs://team/sft/hf-export")
    check_worker_can_load(export, available_memory=32 * GB, free_disk=100 * GB, location="gs://team/sft/hf-export")
    assert 0 < available_memory_bytes() < 1024**4
