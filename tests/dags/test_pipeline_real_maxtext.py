"""The pipeline DAG, unchanged, on the real MaxText 0.2.2 at toy size (the local cloud's real image);
the sample-generations DAG downstream of it loads the tuned model in the image's venv."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from huggingface_hub import HfApi, ModelCard

from localcloud.connections import LOCAL_OUTPUTS_CONF, REAL_IMAGE_KEY, real_maxtext_run_conf
from localcloud.images import build_real_image
from maxtext_sft.run.spec import RunSpec
from tests.conftest import REPO
from tests.dags.conftest import REAL_MAXTEXT_TIMEOUT, REAL_RUN_FIRST_BOOT, wait_for_run_end, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.real_maxtext, pytest.mark.timeout(REAL_MAXTEXT_TIMEOUT)]
STEPS = 4  # each step saves a checkpoint to gs:// (several checkpoints, as a real run makes)
# The published model's logits against MaxText's own forward pass on the final checkpoint
# (tests/dags/export_logits.py), both in float32 on the same weights: what is left is the order
# of float32 operations in XLA and in torch. Measured on this run (2026-12-07; logits up to 0.82,
# an 11-token prompt): 1.6e-6 apart as published; with the activation MaxText wrote ("gelu", not
# its tanh approximation) 8.7e-5, with its rope_theta of 10000 on the global layers 5.9e-3. The
# bound sits between, ~6 times above the first and ~9 times below the smaller error, so the check
# can fail. The comparison costs ~46 s of CPU.
LOGITS_TOLERANCE = 1e-5
LOGITS_PROMPT = "The quick brown fox jumps over the lazy dog because it"

@pytest.fixture(scope="module")
def real_image(local_cloud):
    image = build_real_image()
    local_cloud.add_image(REAL_IMAGE_KEY, image)
    return image


def test_fine_tunes_into_storage_publishes_and_a_downstream_dag_generates_from_the_model(
    start_airflow, real_image, local_cloud, hf_token, first_boot, tmp_path
):
    # What `make run` does, through Airflow's real components: MaxText itself writes its run
    # folder to gs:// (Orbax, tensorstore and gcsfs reach the local GCS from the VM), the export
    # is published to the local Hub, and the tuned-model Asset event starts the sample DAG, which
    # generates in the image's venv (torch stays out of Airflow's).
    python = real_image / "maxtext_venv" / "bin" / "python3"
    airflow = start_airflow({"AIRFLOW__MAXTEXT_SFT__GENERATION_PYTHON": str(python)})
    # The waits are checked every 5 s: they are deferred, so a check is an SSH call in the
    # triggerer, not a task process beside MaxText (when they were, 30 s: 23 checks of ~5.5 s each).
    watch = first_boot(*REAL_RUN_FIRST_BOOT)  # its VM boots as a fresh Ubuntu image does
    run_id = airflow.trigger({**real_maxtext_run_conf(real_image, steps=STEPS, outputs=True), "poke_interval_seconds": 5})
    run = wait_for_run_end(airflow, run_id, timeout=1500)
    assert run["state"] == "success", airflow.task_states(run_id)
    # The first boot was still in force when the install step ended (the image has MaxText: it
    # skipped before apt), and the run went through it.
    [install] = [ti for ti in airflow.task_instances(run_id) if ti["task_id"] == "install_maxtext"]
    assert len(watch.in_force_after(datetime.datetime.fromisoformat(install["end_date"]))) == 1, watch.samples[:5]
    assert airflow.xcom(run_id, "wait_for_final_checkpoint")["final_step"] == STEPS
    # MaxText's own eval loop measured the base model before the first step and the tuned model
    # after the last, on the toy's held-out split, and wrote both to its metrics file.
    record = airflow.xcom(run_id, "collect_outputs")
    assert [step for step, _ in record["eval_history"]] == [0, STEPS], record["eval_history"]
    base, tuned = record["eval_loss"]["base"], record["eval_loss"]["tuned"]
    assert 0 < tuned < base, record["eval_loss"]  # four steps on the toy's own data lower its held-out loss
    assert [step for step, _ in record["loss_history"]] == list(range(1, STEPS + 1))
    published = airflow.xcom(run_id, "publish_to_hub")
    assert published["published"] is True and published["commit"], published
    # Each training step was logged once, with its loss, as training went.
    entries = [entry.get("event", "") if isinstance(entry, dict) else str(entry)
               for entry in airflow.task_log(run_id, "wait_for_final_checkpoint")]
    log = "\n".join(entries)
    logged = [int(step) for step in re.findall(r"training progress: step (\d+), loss [0-9.]+", log)]
    assert sorted(set(logged)) == list(range(1, STEPS + 1))
    assert len(logged) == STEPS
    # What a person reads: the first step line early, MaxText's config dump (hundreds of lines
    # before it) and import noise only in the full log, which the log names.
    first_step = next(i for i, entry in enumerate(entries) if "completed step: " in entry)
    assert first_step < 50, entries[: first_step + 1]
    assert not [entry for entry in entries if "Config param" in entry]
    assert "eval metrics after step: 0," in log and f"eval metrics after step: {STEPS}," in log
    # MaxText committed a checkpoint every step (a tenth of 4, rounded up) and the sensor pruned
    # all but the newest two while the real Orbax went on writing.
    bucket_name, _, prefix = LOCAL_OUTPUTS_CONF["output_location"].removeprefix("gs://").partition("/")
    client = storage.Client(
        project="local-project",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": local_cloud.storage_url},
    )
    run_name = airflow.xcom(run_id, "plan_run", "spec")["run_name"]
    run_prefix = f"{prefix}/runs/{run_name}/"
    names = [blob.name[len(run_prefix) :] for blob in client.list_blobs(bucket_name, prefix=run_prefix)]
    committed = {int(m.group(1)) for n in names if (m := re.match(r"checkpoints/(\d+)/commit_success.txt$", n))}
    assert committed == {STEPS - 1, STEPS}, names
    assert any(n.startswith("tensorboard/") for n in names), names
    # The full log, config dump and all, was copied beside them as the training exited.
    full_log = client.bucket(bucket_name).blob(f"{run_prefix}training.log").download_as_text()
    assert "Config param " in full_log and f"completed step: {STEPS}," in full_log
    assert f"gs://{bucket_name}/{run_prefix}training.log once the training exits" in log

    # MaxText sharded the export (the toy image lowers its 3 GiB threshold, as a 4B export
    # exceeds it): the record names the shards, and the index and each shard are in storage...
    record = airflow.xcom(run_id, "collect_outputs")
    shards = record["hf_export_weight_files"]
    assert record["hf_export_layout"] == "sharded" and len(shards) >= 3, record
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    exported = {n.removeprefix("hf-export/") for n in names if n.startswith("hf-export/")}
    assert {"config.json", "model.safetensors.index.json", *shards} <= exported
    assert "model.safetensors" not in exported
    # ...and on the Hub, in the published commit.
    published = airflow.xcom(run_id, "publish_to_hub")
    hub = HfApi(endpoint=local_cloud.hub.endpoint, token=hf_token)
    hub_files = set(hub.list_repo_files(published["repo_id"], revision=published["commit"]))
    assert {"config.json", "model.safetensors.index.json", "README.md", *shards} <= hub_files
    # MaxText 0.2.2 exported the text-only fine-tune under its multimodal config without the
    # vision tower: export_to_hf published it as Gemma 3's text model. It wrote the activation as
    # "gelu": collect_outputs compared the toy export with the local Hub's base config (the toy's
    # widths as the run's arguments asked) and published the corrected one, saying so in the record.
    config = json.loads(Path(hub.hf_hub_download(published["repo_id"], "config.json", revision=published["commit"]))
                        .read_text())
    assert (config["architectures"], config["model_type"]) == (["Gemma3ForCausalLM"], "gemma3_text"), config
    assert record["hf_export_architecture"] == "Gemma3ForCausalLM"
    assert config["hidden_activation"] == "gelu_pytorch_tanh", config
    assert ("hidden_activation", "gelu", "gelu_pytorch_tanh") in [
        (fix["field"], fix["was"], fix["now"]) for fix in record["export_config_corrections"]], record
    # The published card's model-index holds the tuned eval loss, as huggingface_hub parses it.
    card = ModelCard(Path(hub.hf_hub_download(published["repo_id"], "README.md", revision=published["commit"])).read_text())
    [result] = card.data.eval_results
    assert (result.metric_type, result.metric_value, result.dataset_split) == ("loss", tuned, "test_sft")

    # The tuned-model Asset event says where the model is and what made it...
    [event] = airflow.get("/api/v2/assets/events?source_dag_id=maxtext_sft")["asset_events"]
    assert event["source_run_id"] == run_id
    extra = event["extra"]
    assert extra["location"] == f"gs://{bucket_name}/{run_prefix}hf-export"
    assert (extra["steps"], extra["base_model"], extra["run_name"]) == (STEPS, "google/gemma-3-4b-it", run_name)
    assert float(extra["final_loss"]) > 0
    # ...and starts the downstream DAG, which loads that model and generates from each prompt.
    downstream = airflow.get("/api/v2/dags/maxtext_sft_sample_generations")
    assert downstream["dag_id"]

    def sample_run():
        runs = airflow.get("/api/v2/dags/maxtext_sft_sample_generations/dagRuns")["dag_runs"]
        return runs[0] if runs and runs[0]["state"] in ("success", "failed") else None

    triggered = wait_until(sample_run, 600, "the sample generations run")
    assert triggered["run_type"] == "asset_triggered" and triggered["state"] == "success", triggered
    [samples] = airflow.xcom(triggered["dag_run_id"], "generate_samples", dag_id="maxtext_sft_sample_generations")
    prompts = (REPO / "include" / "eval" / "prompts.txt").read_text().split("\n")
    assert samples["model"] == extra["location"]
    # It loaded the sharded export, every weight the text model has from the shards: none missing
    # (left at random by transformers).
    assert (samples["weight_layout"], samples["weight_files"]) == ("sharded", shards)
    assert samples["missing_weights"] == []
    assert [s["prompt"] for s in samples["samples"]] == [p for p in prompts if p]
    assert all(s["new_tokens"] > 0 for s in samples["samples"]), samples

    # The published model computes what MaxText trained: its logits on a fixed prompt are MaxText's
    # own forward pass on the final checkpoint, and would not be with the config MaxText wrote.
    final = f"{run_prefix}checkpoints/{STEPS}/model_params/"
    checkpoint = tmp_path / "model_params"
    for blob in client.list_blobs(bucket_name, prefix=final):
        if blob.name.endswith("/"):  # a folder's placeholder object, if a client made one
            continue
        target = checkpoint / blob.name[len(final):]
        target.parent.mkdir(parents=True, exist_ok=True)
        blob.download_to_filename(target)
    export = Path(hub.snapshot_download(published["repo_id"], revision=published["commit"],
                                        local_dir=tmp_path / "published"))
    spec = RunSpec.from_dict(airflow.xcom(run_id, "plan_run", "spec"))
    # The export step's MaxText arguments but where it reads and writes (the script loads the
    # downloaded checkpoint itself).
    export_args = [arg for arg in spec.export_args()
                   if not arg.startswith(("load_parameters_path=", "base_output_directory="))]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "HF_TOKEN")}
    before = os.times()
    done = subprocess.run(
        [str(python), str(Path(__file__).with_name("export_logits.py")), str(checkpoint), str(export), LOGITS_PROMPT,
         *export_args],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    after = os.times()
    logits = json.loads(done.stdout.strip().splitlines()[-1])
    cpu = after.children_user + after.children_system - before.children_user - before.children_system
    print(f"export_logits.py: {logits}; {cpu:.0f} s of CPU")
    # The export holds the final checkpoint's weights, bit for bit as to_huggingface converts them.
    assert logits["checkpoint"]["compared"] > 0 and logits["checkpoint"]["differ"] == [], logits["checkpoint"]
    assert (logits["checkpoint"]["missing"], logits["checkpoint"]["extra"]) == ([], []), logits["checkpoint"]
    assert logits["model_class"] == "Gemma3ForCausalLM" and logits["tokens"] > 1
    assert logits["published"] < LOGITS_TOLERANCE, logits
    assert min(logits["as_maxtext_wrote"].values()) > LOGITS_TOLERANCE, logits
