"""The pipeline DAG, unchanged, on the real MaxText 0.2.2 at toy size (the local cloud's real image)."""

from __future__ import annotations

import re
import subprocess

import pytest

from localcloud.connections import REAL_IMAGE_KEY, real_maxtext_run_conf
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


def test_fine_tunes_with_real_maxtext_and_exports_a_model_that_generates(run_pipeline, real_image, local_cloud):
    run = run_pipeline(real_maxtext_run_conf(real_image, steps=STEPS))
    log = run.log
    assert run.state == "success", run.task_states
    assert run.xcoms["wait_for_final_checkpoint.return_value"]["final_step"] == STEPS
    # Each training step was logged once, with its loss, as training went.
    logged = [int(step) for step in re.findall(r"training progress: step (\d+), loss [0-9.]+", log)]
    assert sorted(set(logged)) == list(range(1, STEPS + 1))
    assert len(logged) == STEPS
    # The last checkpoint is checkpoints/<steps>; nothing later.
    vm_name = run.xcoms["plan_run.vm_name"]
    files = [entry["path"] for entry in local_cloud.deleted_manifest(vm_name)]
    steps_saved = {int(m.group(1)) for f in files if (m := re.search(r"/checkpoints/(\d+)/model_params/", f))}
    assert max(steps_saved) == STEPS
    # The export loads in transformers and generates (in the image's venv: torch stays out of Airflow's).
    export = local_cloud.deleted_shm(vm_name) / "gemma3-4b" / "hf-trained"
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
