"""Tests of the MaxText stand-in (localcloud/maxtext_standin) run from the fast VM image's venv."""

import hashlib
import json
import os
import re
import selectors
import shlex
import signal
import socket
import struct
import subprocess
import time
import uuid
from types import SimpleNamespace

import pytest

from localcloud import images

# The pipeline's three commands, verbatim; /dev/shm/gemma3-4b becomes a temp dir.
TO_MAXTEXT = (
    "python3 -m maxtext.checkpoint_conversion.to_maxtext model_name=gemma3-4b "
    "base_output_directory=/dev/shm/gemma3-4b/mt-format/ scan_layers=True use_multimodal=False hardware=cpu "
    "skip_jax_distributed_system=true checkpoint_storage_use_zarr3=1 checkpoint_storage_use_ocdbt=1 "
    "--lazy_load_tensors=False")
TRAIN_SFT = (
    "python3 -m maxtext.trainers.post_train.sft.train_sft run_name=R "
    "base_output_directory=/dev/shm/gemma3-4b/post-train/ model_name=gemma3-4b "
    "load_parameters_path=/dev/shm/gemma3-4b/mt-format/0/items per_device_batch_size=1 steps=1000 "
    "hf_path=HuggingFaceH4/ultrachat_200k train_split=train_sft \"train_data_columns=['messages']\" profiler=xplane")
TO_HUGGINGFACE = (
    "python3 -m maxtext.checkpoint_conversion.to_huggingface model_name=gemma3-4b "
    "load_parameters_path=/dev/shm/gemma3-4b/post-train/R/checkpoints/1000/model_params "
    "base_output_directory=/dev/shm/gemma3-4b/hf-trained/ scan_layers=True use_multimodal=False "
    "weight_dtype=bfloat16")

STEP_LINE = re.compile(
    r"I\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ metric_logger\.py:196\] completed step: (\d+), seconds: \d+\.\d{3}, "
    r"TFLOP/s/device: \d+\.\d{3}, Tokens/s/device: \d+\.\d{3}, total_weights: \d+, loss: \d+\.\d{3}, "
    r"lm_loss: 0\.000, perplexity: 0\.000")
FAST = 0.001  # seconds per step in most tests


def safetensors_header(path) -> dict:
    """A safetensors file's header (8-byte little-endian length, then JSON); the data must follow it."""
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    assert len(data) == 8 + length + max((info["data_offsets"][1] for name, info in header.items()
                                          if name != "__metadata__"), default=0)
    return header
TOKEN = "hf_standin_test_token_123"


@pytest.fixture(scope="session")
def venv_python():
    return images.build_fast_image() / "skel" / "maxtext_venv" / "bin" / "python3"


@pytest.fixture
def mt(tmp_path, venv_python):
    """Runs stand-in commands in tmp_path; `faults` becomes the fault file."""

    def run(command, faults=None, hf_token=None, popen=False, env_extra=None):
        command = command.replace("/dev/shm/gemma3-4b", str(tmp_path))
        argv = shlex.split(command)
        assert argv[0] == "python3"
        argv[0] = str(venv_python)
        fault_file = tmp_path / "faults.json"
        fault_file.write_text(json.dumps({"seconds_per_step": FAST, **(faults or {})}))
        env = {key: value for key, value in os.environ.items()
               if key not in ("HF_TOKEN", "PYTHONPATH", "VIRTUAL_ENV", "STORAGE_EMULATOR_HOST")}
        env["MAXTEXT_STANDIN_FAULTS"] = str(fault_file)
        env.update(env_extra or {})
        if hf_token:
            env["HF_TOKEN"] = hf_token
        if popen:
            return subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True)
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    run.dir = tmp_path
    return run


def steps_logged(log):
    return [int(step) for step in re.findall(r"completed step: (\d+),", log)]


def checkpoints(run_dir):
    """Checkpoint steps, numerically; a leftover temporary directory would fail int()."""
    return sorted(int(entry.name) for entry in (run_dir / "checkpoints").iterdir())


def convert(mt):
    result = mt(TO_MAXTEXT, hf_token=TOKEN)
    assert result.returncode == 0, result.stderr


def train(mt, extra="", faults=None, run_name="R"):
    command = TRAIN_SFT.replace("run_name=R", f"run_name={run_name}").replace(" profiler=xplane", "") + " " + extra
    return mt(command, faults=faults)


def test_pipeline_commands_produce_maxtext_layouts_and_logs(mt):
    result = mt(TO_MAXTEXT, faults={"seconds_per_step": 0.002}, hf_token=TOKEN)
    assert result.returncode == 0, result.stderr
    assert "stand-in" in result.stderr  # the venv really runs the stand-in
    assert (mt.dir / "mt-format/0/items/_METADATA").is_file()
    assert (mt.dir / "mt-format/0/_CHECKPOINT_METADATA").is_file()
    assert sorted(p.name for p in (mt.dir / "mt-format").iterdir()) == [".standin-hf-token.sha256", "0"]

    result = mt(TRAIN_SFT, faults={"seconds_per_step": 0.002})
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    step_lines = [line for line in lines if "completed step:" in line]
    assert [int(STEP_LINE.fullmatch(line).group(1)) for line in step_lines] == list(range(1, 1001))
    finished = [i for i, line in enumerate(lines) if re.search(r"\] Train loop finished in: \d+\.\d{4} seconds$", line)]
    assert len(finished) == 1
    # Tunix logs a step's metrics one step late, so the last step follows "Train loop finished".
    assert "completed step: 1000," in lines[finished[0] + 1]
    run_dir = mt.dir / "post-train/R"
    assert checkpoints(run_dir) == [1, 1000]
    for step in ("1", "1000"):
        assert (run_dir / "checkpoints" / step / "model_params/_METADATA").is_file()
        assert (run_dir / "checkpoints" / step / "optimizer_state").is_dir()
    assert list((run_dir / "tensorboard/plugins/profile").glob("*/*.xplane.pb"))

    result = mt(TO_HUGGINGFACE)
    assert result.returncode == 0, result.stderr
    out = mt.dir / "hf-trained"
    # Sharded as MaxText shards Gemma 3 4B's export: the index names each tensor's shard.
    shards = [f"model-0000{n}-of-00004.safetensors" for n in range(1, 5)]
    assert sorted(p.name for p in out.iterdir()) == [
        "chat_template.jinja", "config.json", *shards, "model.safetensors.index.json", "tokenizer.json",
        "tokenizer_config.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    headers = {shard: safetensors_header(out / shard) for shard in shards}
    assert index["weight_map"] == {name: shard for shard, header in headers.items() for name in header
                                   if name != "__metadata__"}
    assert index["metadata"]["total_size"] == sum(
        end - start for header in headers.values() for name, info in header.items() if name != "__metadata__"
        for start, end in [info["data_offsets"]])
    assert {header["__metadata__"]["step"] for header in headers.values()} == {"1000"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"  # transformers 5's name
    # Gemma 3's language model, named as MaxText 0.2.2 names it under its multimodal config
    # (param_mapping.py GEMMA3_MAXTEXT_TO_HF_PARAM_MAPPING), use_multimodal=False or not.
    assert "model.language_model.embed_tokens.weight" in index["weight_map"]
    assert all(name.startswith("model.language_model.") for name in index["weight_map"]), index["weight_map"]


@pytest.mark.parametrize("command", [TO_MAXTEXT, TRAIN_SFT, TO_HUGGINGFACE], ids=["to_maxtext", "train_sft", "to_hf"])
def test_unknown_key_is_rejected_with_its_name(mt, command):
    result = mt(command + " no_such_key=5", hf_token=TOKEN)
    assert result.returncode == 1
    assert "ValueError: 'no_such_key' not in " in result.stderr


def test_unknown_absl_flag_is_rejected(mt):
    result = mt(TRAIN_SFT + " --no_such_flag=1")
    assert result.returncode == 1
    assert "Unknown command line flag 'no_such_flag'" in result.stderr


def test_values_are_typed_like_maxtext(mt):
    convert(mt)
    bad_int = train(mt, "checkpoint_period=five")
    assert bad_int.returncode == 1 and "checkpoint_period\n  Input should be a valid integer" in bad_int.stderr
    # A model dimension needs override_model_config=True, as in MaxText.
    twice = train(mt, "base_emb_dim=64")
    assert twice.returncode == 1 and "Keys ['base_emb_dim'] are overridden by both model config" in twice.stderr


def test_checkpoints_at_step_one_every_period_and_the_last_step(mt):
    convert(mt)
    result = train(mt, "steps=12 checkpoint_period=5 attention=dot_product max_target_length=256 learning_rate=1e-5")
    assert result.returncode == 0, result.stderr
    assert steps_logged(result.stderr) == list(range(1, 13))
    assert checkpoints(mt.dir / "post-train/R") == [1, 5, 10, 12]
    assert "Config param max_target_length: 256" in result.stderr
    assert "Config param learning_rate: 1e-05" in result.stderr


def test_crash_exits_1_after_step_k_minus_1_without_checkpoint_k(mt):
    convert(mt)
    result = train(mt, "steps=20 checkpoint_period=7", faults={"train_sft": {"crash_at_step": 7}})
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert steps_logged(result.stderr) == list(range(1, 7))
    assert checkpoints(mt.dir / "post-train/R") == [1]


def test_stall_keeps_the_process_alive_and_silent(mt):
    convert(mt)
    command = TRAIN_SFT.replace(" profiler=xplane", "").replace("steps=1000", "steps=5")
    proc = mt(command, faults={"train_sft": {"stall_at_step": 4}}, popen=True)
    try:
        seen = []
        selector = selectors.DefaultSelector()
        selector.register(proc.stderr, selectors.EVENT_READ)
        deadline = time.monotonic() + 240  # 60 s ran out in CI under load (1adf227)
        while "completed step: 3," not in "".join(seen):
            assert time.monotonic() < deadline, "step 3 was never logged:\n" + "".join(seen)
            if selector.select(timeout=1):
                line = proc.stderr.readline()
                assert line, "the process exited:\n" + "".join(seen)
                seen.append(line)
        assert proc.poll() is None
        # Two 1 ms steps remain; a process that is not stalled would be done long before this.
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=2)
    finally:
        proc.kill()
        rest = proc.communicate()[1]
    assert "completed step: 4," not in rest
    assert "Train loop finished" not in rest
    assert checkpoints(mt.dir / "post-train/R") == [1]


def test_out_of_data_finishes_normally_at_an_earlier_step(mt):
    convert(mt)
    result = train(mt, "steps=20", faults={"train_sft": {"out_of_data_at_step": 4}})
    assert result.returncode == 0, result.stderr
    assert "You may have run out of training data" in result.stderr
    assert "Train loop finished in:" in result.stderr
    assert steps_logged(result.stderr) == [1, 2, 3]
    assert checkpoints(mt.dir / "post-train/R") == [1, 3]


def test_rerun_resumes_from_the_latest_checkpoint(mt):
    convert(mt)
    crashed = train(mt, "steps=12 checkpoint_period=5", faults={"train_sft": {"crash_at_step": 8}})
    assert crashed.returncode == 1
    assert checkpoints(mt.dir / "post-train/R") == [1, 5]

    resumed = train(mt, "steps=12 checkpoint_period=5")
    assert resumed.returncode == 0, resumed.stderr
    assert "Restored params from step: 5 in" in resumed.stderr
    assert steps_logged(resumed.stderr) == list(range(6, 13))
    assert checkpoints(mt.dir / "post-train/R") == [1, 5, 10, 12]


def test_profiler_refuses_an_empty_window_like_tunix(mt):
    convert(mt)
    result = mt(TRAIN_SFT.replace("steps=1000", "steps=1"))
    assert result.returncode == 1
    assert "First profile step 1 cannot be greater than the last profile step 1." in result.stderr


def test_to_maxtext_needs_a_hf_token_and_records_its_hash(mt):
    missing = mt(TO_MAXTEXT)
    assert missing.returncode == 1
    assert "gated repo" in missing.stderr
    assert not (mt.dir / "mt-format").exists()

    present = mt(TO_MAXTEXT, hf_token=TOKEN)
    assert present.returncode == 0, present.stderr
    recorded = (mt.dir / "mt-format/.standin-hf-token.sha256").read_text().strip()
    assert recorded == hashlib.sha256(TOKEN.encode()).hexdigest()
    assert TOKEN not in present.stderr


def test_to_maxtext_from_a_local_hf_checkpoint_needs_no_token(mt):
    hf_dir = mt.dir / "local-hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    result = mt(TO_MAXTEXT + f" --hf_model_path={hf_dir} --simulated_cpu_devices_count=1")
    assert result.returncode == 0, result.stderr
    assert (mt.dir / "mt-format/0/items/_METADATA").is_file()


def test_commands_need_an_existing_parameter_checkpoint(mt):
    train_result = mt(TRAIN_SFT)
    assert train_result.returncode == 1
    assert "No valid Orbax checkpoint found at" in train_result.stderr
    export = mt(TO_HUGGINGFACE)
    assert export.returncode == 1
    assert "No valid Orbax checkpoint found at" in export.stderr
    assert not (mt.dir / "hf-trained").exists()


def test_converter_fail_faults(mt):
    result = mt(TO_MAXTEXT, faults={"to_maxtext": {"fail": "disk on fire"}}, hf_token=TOKEN)
    assert result.returncode == 1 and "RuntimeError: disk on fire" in result.stderr


@pytest.mark.parametrize("faults", [
    {"train_sft": {"crash_at_stpe": 3}},
    {"train_sft": {"kill_host_at_step": {"host": "2", "step": 3}}},
    {"train_sft": {"kill_host_at_step": {"host": 2}}},
    {"heartbeat_timeout_seconds": 0},
], ids=["typo", "kill-host-not-a-number", "kill-host-without-step", "no-heartbeat-timeout"])
def test_malformed_fault_file_fails_loudly(mt, faults):
    result = mt(TO_MAXTEXT, faults=faults, hf_token=TOKEN)
    assert result.returncode == 1 and "bad fault file" in result.stderr


def test_image_is_cached_world_readable_and_reports_maxtext_0_2_2(tmp_path, monkeypatch):
    first = images.build_fast_image(tmp_path)
    stamp = (first / "image.json").stat().st_mtime_ns
    second = images.build_fast_image(tmp_path)
    assert second == first
    assert (second / "image.json").stat().st_mtime_ns == stamp  # not rebuilt
    # No temporary build left behind; the build lock stays (an empty file).
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{first.name}.lock", first.name]

    python = first / "skel/maxtext_venv/bin/python3"
    version = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('maxtext'))"],
                             capture_output=True, text=True, check=True, cwd=tmp_path, env={})
    assert version.stdout.strip() == "0.2.2"
    for path in first.rglob("*"):
        if not path.is_symlink():
            assert path.stat().st_mode & 0o004, f"{path} is not world-readable"

    monkeypatch.setattr(images, "BUILDER_VERSION", images.BUILDER_VERSION + 1)
    assert images.build_fast_image(tmp_path) != first  # a new recipe builds a new image


# ----- gs:// locations, against the local cloud's storage emulator ---------------------------------


@pytest.fixture
def gcs(compute_cloud):
    """(bucket name, storage env, client) for a fresh bucket in the session's local cloud."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    bucket = f"standin-{uuid.uuid4().hex[:10]}"
    compute_cloud.create_bucket(bucket)
    client = storage.Client(client_options={"api_endpoint": compute_cloud.storage_url},
                            credentials=AnonymousCredentials(), project="p")
    return SimpleNamespace(bucket=bucket, env={"STORAGE_EMULATOR_HOST": compute_cloud.storage_url}, client=client,
                           cloud=compute_cloud)


def on_gcs(command, bucket):
    """A pipeline command with its MaxText-side paths (not to_huggingface's output) on gs://bucket."""
    for folder in ("mt-format", "post-train"):
        command = command.replace(f"/dev/shm/gemma3-4b/{folder}", f"gs://{bucket}/{folder}")
    return command


def names(gcs, prefix=""):
    return [blob.name for blob in gcs.client.list_blobs(gcs.bucket, prefix=prefix)]


def gcs_steps(gcs, run_name="R"):
    """Committed checkpoint steps of a run on gs:// (those with commit_success.txt)."""
    prefix = f"post-train/{run_name}/checkpoints/"
    return sorted(int(name[len(prefix):].split("/")[0]) for name in names(gcs, prefix)
                  if name.endswith("/commit_success.txt") and name.count("/") == 4)


def test_pipeline_commands_on_gcs(mt, gcs):
    result = mt(on_gcs(TO_MAXTEXT, gcs.bucket), hf_token=TOKEN, env_extra=gcs.env)
    assert result.returncode == 0, result.stderr
    converted = names(gcs, "mt-format/")
    assert {"mt-format/.standin-hf-token.sha256", "mt-format/0/_CHECKPOINT_METADATA", "mt-format/0/items/_METADATA",
            "mt-format/0/items/commit_success.txt", "mt-format/0/commit_success.txt"} <= set(converted)
    # As Orbax on GCS: the step's commit_success.txt is the last object written.
    step_writes = [r["query"]["name"] for r in gcs.cloud.storage_requests()
                   if r["method"] == "POST" and r["query"].get("name", "").startswith("mt-format/0/")]
    assert step_writes[-1] == "mt-format/0/commit_success.txt" and len(step_writes) == len(set(step_writes))
    assert not (mt.dir / "mt-format").exists()

    train = on_gcs(TRAIN_SFT, gcs.bucket).replace("steps=1000", "steps=12 checkpoint_period=5")
    result = mt(train, env_extra=gcs.env)
    assert result.returncode == 0, result.stderr
    assert steps_logged(result.stderr) == list(range(1, 13))
    assert gcs_steps(gcs) == [1, 5, 10, 12]
    run_objects = names(gcs, "post-train/R/")
    assert "post-train/R/checkpoints/12/model_params/_METADATA" in run_objects
    assert any("/tensorboard/events.out.tfevents." in name for name in run_objects)
    assert any(name.endswith(".xplane.pb") for name in run_objects)

    export = TO_HUGGINGFACE.replace("/dev/shm/gemma3-4b/post-train", f"gs://{gcs.bucket}/post-train").replace(
        "checkpoints/1000/", "checkpoints/12/")
    result = mt(export, env_extra=gcs.env)
    assert result.returncode == 0, result.stderr
    header = safetensors_header(mt.dir / "hf-trained/model-00001-of-00004.safetensors")  # the output stays local
    assert header["__metadata__"]["step"] == "12"
    assert header["__metadata__"]["source"] == f"gs://{gcs.bucket}/post-train/R/checkpoints/12/model_params"


def test_gcs_parameters_must_exist_and_need_the_emulator(mt, gcs):
    train = on_gcs(TRAIN_SFT, gcs.bucket)
    missing = mt(train, env_extra=gcs.env)
    assert missing.returncode == 1
    assert f"No valid Orbax checkpoint found at 'gs://{gcs.bucket}/mt-format/0/items'" in missing.stderr
    export = mt(TO_HUGGINGFACE.replace("/dev/shm/gemma3-4b/post-train", f"gs://{gcs.bucket}/post-train"),
                env_extra=gcs.env)
    assert export.returncode == 1 and "No valid Orbax checkpoint found at 'gs://" in export.stderr
    assert not (mt.dir / "hf-trained").exists()

    no_emulator = mt(on_gcs(TO_MAXTEXT, gcs.bucket), hf_token=TOKEN)
    assert no_emulator.returncode == 1 and "gs:// paths need $STORAGE_EMULATOR_HOST" in no_emulator.stderr
    no_bucket = mt(on_gcs(TO_MAXTEXT, "standin-no-such-bucket"), hf_token=TOKEN, env_extra=gcs.env)
    assert no_bucket.returncode == 1 and "404 The specified bucket does not exist." in no_bucket.stderr


def wait_for(condition, what, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the process exited before {what}: {proc.stderr.read()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout}s"
        time.sleep(0.1)


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_a_partial_checkpoint_is_not_resumed(mt, gcs, where):
    extra = "steps=12 checkpoint_period=5"
    env = gcs.env if where == "gcs" else None
    if where == "gcs":
        assert mt(on_gcs(TO_MAXTEXT, gcs.bucket), hf_token=TOKEN, env_extra=env).returncode == 0
        command = on_gcs(TRAIN_SFT, gcs.bucket)
        step_10 = lambda: "post-train/R/checkpoints/10/_CHECKPOINT_METADATA" in names(gcs, "post-train/R/checkpoints/10/")
        committed = lambda: gcs_steps(gcs)
    else:
        convert(mt)
        command = TRAIN_SFT
        checkpoint_dir = mt.dir / "post-train/R/checkpoints"
        step_10 = lambda: any(checkpoint_dir.glob("10.orbax-checkpoint-tmp-*/_CHECKPOINT_METADATA"))
        # The temporary directory of step 10 stays behind (Orbax does not clean it up by default).
        committed = lambda: sorted(int(p.name) for p in checkpoint_dir.iterdir() if p.name.isdigit())
    command = command.replace(" profiler=xplane", "").replace("steps=1000", extra)

    proc = mt(command, faults={"train_sft": {"partial_checkpoint_at_step": 10}}, popen=True, env_extra=env)
    try:
        wait_for(step_10, "half-written step 10", proc)
        with pytest.raises(subprocess.TimeoutExpired):  # it stalls with step 10 half written
            proc.wait(timeout=2)
        assert committed() == [1, 5]
    finally:
        proc.kill()
        proc.communicate()

    resumed = mt(command, env_extra=env)
    assert resumed.returncode == 0, resumed.stderr
    assert "Restored params from step: 5 in" in resumed.stderr
    assert steps_logged(resumed.stderr) == list(range(6, 13))
    assert committed() == [1, 5, 10, 12]


# ----- a multi-host slice: one stand-in process per host, over loopback ----------------------------

HEARTBEAT = 1  # seconds: the slices' JAX heartbeat timeout here (the fault file's knob; JAX's is 100)
TERMINATING = "client.h:80] Terminating process because the JAX distributed service detected fatal errors."
UNHEALTHY = ("absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n{task}\n"
             "The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. "
             "preemption, eviction) to debug further.\n\nRPC: /tensorflow.CoordinationService/PollForError "
             "[type.googleapis.com/tensorflow.CoordinationServiceError='']")
LEADER_GONE = ("absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was "
               "preempted/died/restarted unexpectedly or this task is experiencing network issues.")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def slice_run(tmp_path, venv_python):
    """Starts a train_sft command on an n-host slice over loopback: one process per host, with the
    environment start_training.sh gives each host (the coordinator at a free port), its own log
    (stderr) and metrics file. Returns the hosts; every process still running is killed after."""
    started = []

    def start(hosts, command, faults=None, env_extra=None, only=None):
        fault_file = tmp_path / "slice-faults.json"
        fault_file.write_text(json.dumps({"seconds_per_step": FAST, **(faults or {})}))
        addresses = ",".join(f"127.0.0.{i + 1}" for i in range(hosts))
        port = free_port()
        run = []
        for i in range(hosts) if only is None else only:
            log = tmp_path / f"host{i}-{uuid.uuid4().hex[:6]}.log"
            metrics = log.with_suffix(".metrics.jsonl")
            argv = shlex.split(command.replace("/dev/shm/gemma3-4b", str(tmp_path)) + f" metrics_file={metrics}")
            argv[0] = str(venv_python)
            env = {key: value for key, value in os.environ.items()
                   if key not in ("HF_TOKEN", "PYTHONPATH", "VIRTUAL_ENV", "STORAGE_EMULATOR_HOST")}
            env.update({"MAXTEXT_STANDIN_FAULTS": str(fault_file), "TPU_WORKER_HOSTNAMES": addresses,
                        "TPU_WORKER_ID": str(i), "TPU_SKIP_MDS_QUERY": "1", "JAX_COORDINATOR_PORT": str(port),
                        **(env_extra or {})})
            with log.open("w") as stderr:
                proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
            started.append(proc)
            run.append(SimpleNamespace(proc=proc, log=log, metrics=metrics))
        return run

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def storage_writes(gcs, prefix):
    """Names of the objects written under `prefix` in the test's bucket, in the order written."""
    return [r["query"]["name"] for r in gcs.cloud.storage_requests()
            if r["method"] == "POST" and f"/b/{gcs.bucket}/o" in r["path"]
            and r["query"].get("name", "").startswith(prefix)]


def parts(gcs, step):
    """The processes whose part of every item of checkpoint `step` is in storage."""
    objects = set(names(gcs, f"post-train/R/checkpoints/{step}/"))
    return sorted(i for i in range(8) if all(
        f"post-train/R/checkpoints/{step}/{item}/{rel}" in objects for item in ("model_params", "optimizer_state")
        for rel in (f"ocdbt.process_{i}/manifest.ocdbt", f"array_metadatas/process_{i}")))


def test_a_slice_trains_as_one_run_and_commits_a_step_once_every_host_wrote_its_part(mt, gcs, slice_run):
    assert mt(on_gcs(TO_MAXTEXT, gcs.bucket), hf_token=TOKEN, env_extra=gcs.env).returncode == 0
    hosts = slice_run(4, on_gcs(TRAIN_SFT, gcs.bucket).replace("steps=1000", "steps=6 checkpoint_period=2"),
                      env_extra=gcs.env)
    for host in hosts:
        assert host.proc.wait(timeout=60) == 0, host.log.read_text()
    logs = [host.log.read_text() for host in hosts]
    assert [("Starting JAX distributed service on 127.0.0.1:" in log) for log in logs] == [True, False, False, False]
    assert all("Jax distributed system initialized!" in log for log in logs)
    for host, log in zip(hosts, logs):  # MaxText logs and writes its metrics file on every host
        assert steps_logged(log) == list(range(1, 7))
        assert [json.loads(line)["step"] for line in host.metrics.read_text().splitlines()] == list(range(1, 7))

    assert gcs_steps(gcs) == [1, 2, 4, 6]
    writes = storage_writes(gcs, "post-train/R/")
    for step in (1, 2, 4, 6):
        assert parts(gcs, step) == [0, 1, 2, 3]
        # Process 0 commits a step only after every host's part of it is written.
        step_writes = [name for name in writes if name.startswith(f"post-train/R/checkpoints/{step}/")]
        part_writes = [i for i, name in enumerate(step_writes) if "process_" in name]
        assert len(part_writes) == 4 * 2 * 3  # hosts x items x (data, manifest, array metadata)
        assert step_writes[-1] == f"post-train/R/checkpoints/{step}/commit_success.txt"
        assert step_writes.count(step_writes[-1]) == 1 and max(part_writes) < len(step_writes) - 1
    # TensorBoard events and the profile: process 0 alone (Tunix's guards).
    assert len([name for name in writes if "/tensorboard/events.out.tfevents." in name]) == 1
    assert len([name for name in writes if name.endswith(".xplane.pb")]) == 1


@pytest.mark.parametrize(("lost", "error"), [(2, UNHEALTHY.format(task=2)), (0, LEADER_GONE)],
                         ids=["a-worker", "the-coordinator"])
def test_a_lost_host_fails_the_others_as_jax_does_and_its_step_is_never_committed(mt, gcs, slice_run, lost, error):
    assert mt(on_gcs(TO_MAXTEXT, gcs.bucket), hf_token=TOKEN, env_extra=gcs.env).returncode == 0
    train = on_gcs(TRAIN_SFT, gcs.bucket).replace(" profiler=xplane", "").replace(
        "steps=1000", "steps=8 checkpoint_period=2")
    faults = {"heartbeat_timeout_seconds": HEARTBEAT, "train_sft": {"kill_host_at_step": {"host": lost, "step": 4}}}
    hosts = slice_run(3, train, faults=faults, env_extra=gcs.env)
    assert hosts[lost].proc.wait(timeout=60) == -signal.SIGKILL
    lost_at = time.monotonic()
    survivors = [host for i, host in enumerate(hosts) if i != lost]
    for host in survivors:  # terminated as jaxlib terminates: absl FATAL, SIGABRT
        assert host.proc.wait(timeout=HEARTBEAT + 10) == -signal.SIGABRT, host.log.read_text()
    took = time.monotonic() - lost_at
    # A lost worker is noticed when its heartbeats stop; a lost coordinator at once (its socket closes).
    # The worker's last heartbeat went out up to half the timeout before it was killed (one every
    # timeout/2), and `lost_at` is read once this process saw the kill, later on a busy machine:
    # so the bound is half the timeout, less a margin (CI saw 0.77 s against a 0.8 s bound).
    assert (took >= HEARTBEAT / 2 - 0.2 if lost else took < HEARTBEAT), took
    assert took < HEARTBEAT + 5, took
    for host in survivors:
        log = host.log.read_text()
        assert TERMINATING in log and error in log, log[-3000:]
        assert steps_logged(log) == [1, 2, 3]  # step 4's line would come with step 5
    if lost:
        assert "coordination_service.cc:1681] Use error polling to propagate the following error to all tasks: " \
               "UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n2\n" in hosts[0].log.read_text()
    # Step 4 lacks the lost host's part and has no commit: it is not a checkpoint. (A lost worker
    # holds the others for its heartbeat timeout, long enough to write their parts; a lost
    # coordinator stops them at once, maybe before theirs.)
    assert gcs_steps(gcs) == [1, 2]
    assert parts(gcs, 4) == [0, 1] if lost else lost not in parts(gcs, 4)

    resumed = slice_run(3, train, faults={"heartbeat_timeout_seconds": HEARTBEAT}, env_extra=gcs.env)
    for host in resumed:
        assert host.proc.wait(timeout=60) == 0, host.log.read_text()
        log = host.log.read_text()
        assert "Restored params from step: 2 in" in log and steps_logged(log) == list(range(3, 9))
    assert gcs_steps(gcs) == [1, 2, 4, 6, 8] and parts(gcs, 4) == [0, 1, 2]


def test_a_host_that_never_comes_fails_its_slice_after_the_initialization_timeout(mt, slice_run):
    convert(mt)
    # Host 1 of two, alone: it retries the coordinator for the timeout plus the agent's 5 seconds.
    started = time.monotonic()
    [host] = slice_run(2, TRAIN_SFT + " jax_distributed_initialization_timeout=1", only=[1])
    assert host.proc.wait(timeout=30) == -signal.SIGABRT
    assert 6 <= time.monotonic() - started < 15
    log = host.log.read_text()
    assert TERMINATING + (" This most likely indicates that another task died; see the other task logs for more "
                          "details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous "
                          "output. absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded\n\n"
                          "RPC: /tensorflow.CoordinationService/RegisterTask") in log
    assert "completed step" not in log


def test_a_worker_id_outside_the_slice_is_refused_as_jax_refuses_it(mt, slice_run):
    convert(mt)
    [host] = slice_run(2, TRAIN_SFT, env_extra={"TPU_WORKER_ID": "2"}, only=[0])
    assert host.proc.wait(timeout=30) == 1
    assert ("ValueError: process_id and num_processes must be nonnegative, with process_id < num_processes. "
            "Got process_id=2, num_processes=2.") in host.log.read_text()


def test_a_host_that_fails_alone_holds_the_others_until_the_shutdown_barrier_times_out(mt, slice_run):
    # Tunix profiles on process 0 only, so only it refuses an empty profile window; it then waits at
    # JAX's shutdown barrier while the other host waits in step 1, until the barrier's timeout.
    convert(mt)
    hosts = slice_run(2, TRAIN_SFT.replace("steps=1000", "steps=1"),
                      faults={"heartbeat_timeout_seconds": 30, "shutdown_timeout_seconds": 1})
    for host in hosts:
        assert host.proc.wait(timeout=30) == -signal.SIGABRT, host.log.read_text()
    first, second = (host.log.read_text() for host in hosts)
    assert "ValueError: First profile step 1 cannot be greater than the last profile step 1." in first
    assert "ValueError" not in second
    for log in (first, second):
        assert TERMINATING in log and "absl::Status: INTERNAL: Shutdown barrier has failed.\nBarrier result: " \
               "'DEADLINE_EXCEEDED: Barrier timed out. Id: Shutdown::" in log
        assert "# of tasks that reached the barrier: 1/2.\nThe first task at the barrier: 0. Some timed out task " \
               "names:\n1\n [type.googleapis.com/tensorflow.BarrierError='\\n\\x" in log
    assert "coordination_service.cc:1653] Shutdown barrier in coordination service has failed:\n" in first
