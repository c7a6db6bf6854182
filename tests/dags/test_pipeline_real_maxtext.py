"""The pipeline DAG, unchanged, on the real MaxText 0.2.2 at toy size (the local cloud's real image)."""

from __future__ import annotations

import re
import subprocess

import pytest

from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from localcloud.connections import LOCAL_OUTPUTS_CONF, REAL_IMAGE_KEY, real_maxtext_run_conf
from localcloud.images import build_real_image

pytestmark = [pytest.mark.e2e, pytest.mark.real_maxtext]
STEPS = 5

GENERATE = """
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
path = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
inputs = tokenizer("Hello", return_tensors="pt")
output = model.generate(**inputs, max_new_tokens=4, do_sample=False)
print("NEW_TOKENS", output.shape[1] - inputs["input_ids"].shape[1])
"""


@pytest.fixture(scope="module")
def real_image(local_cloud):
    image = build_real_image()
    local_cloud.add_image(REAL_IMAGE_KEY, image)
    return image


def test_fine_tunes_into_storage_and_publishes_a_model_that_generates(run_pipeline, real_image, local_cloud, tmp_path):
    # What `make run` does: MaxText itself writes its run folder to gs:// (Orbax, tensorstore and
    # gcsfs reach the local GCS from the VM), and the export is published to the local Hub.
    run = run_pipeline(real_maxtext_run_conf(real_image, steps=STEPS, outputs=True))
    log = run.log
    assert run.state == "success", run.task_states
    assert run.xcoms["wait_for_final_checkpoint.return_value"]["final_step"] == STEPS
    assert run.xcoms["publish_to_hub.return_value"]["commit"]
    # Each training step was logged once, with its loss, as training went.
    logged = [int(step) for step in re.findall(r"training progress: step (\d+), loss [0-9.]+", log)]
    assert sorted(set(logged)) == list(range(1, STEPS + 1))
    assert len(logged) == STEPS
    # MaxText committed checkpoints/<steps> in the bucket, and nothing later.
    bucket_name, _, prefix = LOCAL_OUTPUTS_CONF["output_location"].removeprefix("gs://").partition("/")
    client = storage.Client(
        project="local-project",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": local_cloud.storage_url},
    )
    run_prefix = f"{prefix}/runs/{run.xcoms['plan_run.spec']['run_name']}/"
    names = [blob.name[len(run_prefix) :] for blob in client.list_blobs(bucket_name, prefix=run_prefix)]
    committed = {int(m.group(1)) for n in names if (m := re.match(r"checkpoints/(\d+)/commit_success.txt$", n))}
    assert max(committed) == STEPS, names
    assert any(n.startswith("tensorboard/") for n in names), names
    # The export loads in transformers and generates (in the image's venv: torch stays out of Airflow's).
    export = tmp_path / "hf-export"
    export.mkdir()
    for blob in client.list_blobs(bucket_name, prefix=run_prefix + "hf-export/"):
        blob.download_to_filename(export / blob.name.rsplit("/", 1)[1])
    python = real_image / "maxtext_venv" / "bin" / "python3"
    result = subprocess.run([str(python), "-c", GENERATE, str(export)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "NEW_TOKENS 4" in result.stdout


def test_a_dataset_too_small_for_the_steps_fails_the_run_with_the_reason(run_pipeline, real_image, local_cloud):
    run = run_pipeline(real_maxtext_run_conf(real_image, steps=STEPS, dataset="ultrachat_small"))
    log = run.log
    assert run.state == "failed", run.task_states
    assert run.task_states["wait_for_final_checkpoint"] == "failed"
    assert run.task_states["delete_vm"] == "success"
    reason = re.search(rf"training exited 0 after step (\d) of {STEPS}: the dataset ran out of training data", log)
    assert reason and int(reason.group(1)) < STEPS, log[log.find("ended without") - 500 :][:3000]
    assert local_cloud.vms() == []
