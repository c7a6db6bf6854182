"""The VM-side step scripts, run directly with bash (no SSH), on the fast image's MaxText stand-in.

Arguments come from the real RunSpec and step table, with the tutorial's /dev/shm paths moved
into a temp dir. Each script must be runnable by hand and safe to run twice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from localcloud import images
from localcloud.cloud import storage_env
from maxtext_sft.results.loss_curve import parse_loss_history
from maxtext_sft.results.outputs import check_export_folder
from maxtext_sft.run.spec import build_run_spec
from maxtext_sft.results.training_metrics import parse_metrics
from maxtext_sft.vm.steps import STEPS, vm_scripts_dir
from tests.conftest import poll
from tests.plugins.test_outputs import SHARDS, write_export

TOKEN = "hf_script_test_token_42"
STATUS = re.compile(r"^MAXTEXT_SFT_STATUS (.*)$", re.M)


@pytest.fixture(scope="module")
def image_venv() -> Path:
    return images.build_fast_image() / "skel" / "maxtext_venv"


class Vm:
    """A fake VM home with the image's venv, and a runner for one step's script."""

    def __init__(
        self, tmp_path: Path, image_venv: Path, params: dict, env: dict | None = None, run_id: str = "manual__test"
    ):
        self.home = tmp_path / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        if not (self.home / "maxtext_venv").exists():
            (self.home / "maxtext_venv").symlink_to(image_venv)
        self.shm = tmp_path / "shm"
        self.faults = tmp_path / "faults.json"
        self.faults.write_text(json.dumps({"seconds_per_step": 0.002}))
        self.env = env or {}
        self.spec = build_run_spec(
            {"reservation": "r", "steps": 12, **params},
            dag_id="maxtext_sft",
            run_id=run_id,
            generation=0,
            started=datetime(2026, 11, 29, tzinfo=timezone.utc),
            default_project_id="my-project",
            ssh_user="maxtext",
            ssh_public_key="ssh-ed25519 AAAA",
        )

    def path(self, remote: str) -> Path:
        return Path(remote.replace("/dev/shm", str(self.shm)))

    def run(self, step: str, token: str | None = TOKEN, check: bool = True, path_prefix: str = "",
            replace: dict[str, str] | None = None):
        """Run a step's script with the step table's arguments (`replace`: some of them swapped)."""
        args = [a.replace("/dev/shm", str(self.shm)) for a in STEPS[step].arguments(self.spec, {})]
        args = [(replace or {}).get(a, a) for a in args]
        env = {
            "HOME": str(self.home),
            "PATH": f"{path_prefix}/usr/bin:/bin",
            "MAXTEXT_STANDIN_FAULTS": str(self.faults),
            **self.env,
        }
        result = subprocess.run(
            ["bash", str(vm_scripts_dir() / STEPS[step].script), *args],
            input=(token + "\n") if token else "",
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        if check:
            assert result.returncode == 0, result.stdout + result.stderr
        return result

    def status(self) -> tuple[dict[str, str], str]:
        out = self.run("training_status").stdout
        fields = dict(item.split("=", 1) for item in STATUS.findall(out)[-1].split())
        return fields, out

    def wait_for_training(self, timeout: float = 60) -> tuple[dict[str, str], str]:
        seen = ""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields, out = self.status()
            seen += out
            if fields["state"] != "running":
                return fields, seen
            time.sleep(0.1)  # polling interval, not synchronisation: the state is re-read
        raise AssertionError("training still running at the deadline")


@pytest.fixture
def vm(tmp_path, image_venv):
    return Vm(tmp_path, image_venv, {})


def converted(vm) -> None:
    vm.run("convert")


def test_install_skips_when_the_pinned_version_is_in_the_venv(vm):
    result = vm.run("install")
    assert "already installed" in result.stdout


def test_convert_gets_the_token_on_stdin_and_is_safe_to_run_twice(vm):
    first = vm.run("convert")
    out_dir = vm.path(vm.spec.maxtext_checkpoint_dir)
    assert (out_dir / "0" / "items").is_dir()
    token_hash = (out_dir / ".standin-hf-token.sha256").read_text().strip()
    assert token_hash == hashlib.sha256(TOKEN.encode()).hexdigest()
    assert TOKEN not in first.stdout + first.stderr
    assert f"MAXTEXT_SFT_RESULT base_checkpoint={out_dir}/0/items" in first.stdout
    second = vm.run("convert")
    assert "already converted" in second.stdout


def test_convert_without_a_token_fails_and_leaves_no_checkpoint(vm):
    result = vm.run("convert", token=None, check=False)
    assert result.returncode != 0
    assert not (vm.path(vm.spec.maxtext_checkpoint_dir) / "0" / "items").exists()


def test_training_runs_detached_and_status_streams_each_line_once(vm):
    converted(vm)
    started = vm.run("start_training")
    assert "Started training" in started.stdout
    fields, seen = vm.wait_for_training()
    assert fields["state"] == "succeeded", seen
    assert fields["exit_code"] == "0" and fields["last_step"] == "12"
    assert fields["out_of_data"] == "no"
    steps = [int(s) for s in re.findall(r"completed step: (\d+),", seen)]
    assert steps == list(range(1, 13))  # every step line once, in order, across all the checks
    assert vm.path(vm.spec.final_checkpoint_path).is_dir()
    again = vm.run("start_training")
    assert "already finished" in again.stdout
    log = (vm.home / "maxtext-sft-runs" / vm.spec.run_name / "train.log").read_text()
    assert log.count("Train loop finished") == 1


def test_the_first_status_after_a_start_writes_nothing_to_stderr(vm):
    """stderr reaches the sensor over its own SSH channel, maybe after the status line: the first
    check after a (re)start, with no progress file yet, must not complain about it."""
    converted(vm)
    vm.faults.write_text(json.dumps({"seconds_per_step": 0.002, "train_sft": {"stall_at_step": 3}}))
    vm.run("start_training")
    first = vm.run("training_status")
    assert first.stderr == "" and "MAXTEXT_SFT_STATUS" in first.stdout
    pid = int((vm.home / "maxtext-sft-runs" / vm.spec.run_name / "pid").read_text())
    os.killpg(os.getpgid(pid), signal.SIGKILL)


def test_start_training_twice_while_running_starts_one_process(vm):
    converted(vm)
    vm.faults.write_text(json.dumps({"seconds_per_step": 0.002, "train_sft": {"stall_at_step": 5}}))
    vm.run("start_training")
    second = vm.run("start_training")
    assert "already running" in second.stdout
    pid = int((vm.home / "maxtext-sft-runs" / vm.spec.run_name / "pid").read_text())
    os.killpg(os.getpgid(pid), signal.SIGKILL)
    fields, seen = vm.wait_for_training()
    assert fields["state"] == "failed" and fields["exit_code"] == "none", seen


def test_a_crash_is_reported_with_the_log_tail(vm):
    converted(vm)
    vm.faults.write_text(json.dumps({"seconds_per_step": 0.002, "train_sft": {"crash_at_step": 5}}))
    vm.run("start_training")
    fields, seen = vm.wait_for_training()
    assert fields["state"] == "failed" and fields["exit_code"] == "1"
    assert fields["last_step"] == "4"
    tail = seen.split("--- tail of ")[-1]
    assert "Traceback" in tail


def test_exit_zero_before_the_final_step_is_a_failure(vm):
    converted(vm)
    vm.faults.write_text(json.dumps({"seconds_per_step": 0.002, "train_sft": {"out_of_data_at_step": 6}}))
    vm.run("start_training")
    fields, seen = vm.wait_for_training()
    assert fields["exit_code"] == "0"
    assert fields["state"] == "failed", seen
    assert fields["out_of_data"] == "yes"
    assert "run out of training data" in seen


@pytest.fixture
def env_probe(tmp_path):
    """A VM whose MaxText venv's python3 prints the TPU_* and JAX_* environment it was started with
    (into train.log) and exits 0; returns the Vm and a reader of that environment once the
    detached training has exited."""
    venv = tmp_path / "probe_venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'PATH="{venv}/bin:$PATH"\n')
    python = venv / "bin" / "python3"
    python.write_text("#!/bin/bash\nenv | grep -E '^(TPU|JAX|MEGASCALE)_' | sort\n")
    python.chmod(0o755)
    vm = Vm(tmp_path, venv, {})

    def started_env() -> dict[str, str]:
        job_dir = vm.home / "maxtext-sft-runs" / vm.spec.run_name
        poll(lambda: (job_dir / "exit_code").exists(), 30, "the probe's exit code")
        lines = (job_dir / "train.log").read_text().splitlines()
        return dict(line.split("=", 1) for line in lines if "=" in line)

    return vm, started_env


SLICE_HOSTS = ("10.128.0.11", "10.128.0.12", "10.128.0.13", "10.128.0.14")


def on_slice_host(vm, host_index: int, hosts: tuple[str, ...] = SLICE_HOSTS, tpu_slice: str = "v6e-16") -> None:
    """Make the VM's spec one host's of a multi-host slice (the plan's fields for that host)."""
    vm.spec = dataclasses.replace(vm.spec, params={**vm.spec.params, "tpu_slice": tpu_slice}, host_index=host_index,
                                  worker_hostnames=hosts)


def test_start_training_on_a_single_vm_exports_the_tutorials_environment(env_probe):
    vm, started_env = env_probe
    vm.run("start_training")
    env = started_env()
    assert env.pop("TPU_NAME")  # the VM's host name
    assert env == {
        "TPU_ACCELERATOR_TYPE": "v6e-8", "TPU_TOPOLOGY": "2x4", "TPU_CHIPS_PER_HOST_BOUNDS": "2,4,1",
        "TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_SKIP_MDS_QUERY": "1",
    }  # no coordinator address: a single process


@pytest.mark.parametrize("host_index", [0, 2])
def test_start_training_on_a_slice_host_exports_its_place_in_the_slice(env_probe, host_index):
    vm, started_env = env_probe
    on_slice_host(vm, host_index)
    vm.run("start_training")
    env = started_env()
    assert env["TPU_WORKER_ID"] == str(host_index)
    assert env["TPU_WORKER_HOSTNAMES"] == ",".join(SLICE_HOSTS)
    assert (env["TPU_HOST_BOUNDS"], env["TPU_TOPOLOGY"], env["TPU_CHIPS_PER_HOST_BOUNDS"]) == ("2,2,1", "4x4", "2,2,1")
    assert env["TPU_ACCELERATOR_TYPE"] == "v6e-16" and env["TPU_SKIP_MDS_QUERY"] == "1"
    # Every host names the first as JAX's coordinator, at the port JAX's Cloud TPU cluster uses.
    assert env["JAX_COORDINATOR_ADDRESS"] == "10.128.0.11:8482"
    assert not any(name.startswith("MEGASCALE_") for name in env)


@pytest.mark.parametrize(
    ("host_index", "hosts", "tpu_slice", "error"),
    [
        (4, SLICE_HOSTS, "v6e-16", "WORKER_ID must be a number below the number of hosts in WORKER_HOSTNAMES (4), got '4'"),
        (-1, SLICE_HOSTS, "v6e-16", "WORKER_ID must be a number below the number of hosts in WORKER_HOSTNAMES (4), got '-1'"),
        (0, ("10.128.0.11", "10.128.0.12;touch x", "a", "b"), "v6e-16",
         "WORKER_HOSTNAMES must be host names or IPv4 addresses separated by commas, got '10.128.0.11,10.128.0.12;touch x,a,b'"),
        (0, ("10.128.0.11", "", "a", "b"), "v6e-16", "WORKER_HOSTNAMES must be host names or IPv4 addresses"),
        (1, SLICE_HOSTS[:2], "v6e-16", "HOST_BOUNDS 2,2,1 spans 4 hosts, but WORKER_HOSTNAMES names 2"),
    ],
    ids=["id-too-high", "negative-id", "hostile-host", "empty-host", "bounds-mismatch"],
)
def test_start_training_refuses_a_wrong_place_in_the_slice(env_probe, host_index, hosts, tpu_slice, error):
    vm, _ = env_probe
    on_slice_host(vm, host_index, hosts, tpu_slice)
    result = vm.run("start_training", check=False)
    assert result.returncode == 2 and f"start_training.sh: {error}" in result.stderr, result.stderr
    assert not (vm.home / "maxtext-sft-runs").exists()  # nothing started, nothing written


def test_start_training_on_every_host_of_a_slice_forms_one_training(tmp_path, image_venv):
    """Four hosts over loopback, each with its own home; their MaxText stand-ins find each other
    from the environment start_training.sh exports (the coordinator at a free port here)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    hosts = tuple(f"127.0.0.{i + 1}" for i in range(4))
    vms = [Vm(tmp_path / f"host{i}", image_venv, {}, env={"JAX_COORDINATOR_PORT": str(port)}) for i in range(4)]
    for i, vm in enumerate(vms):
        vm.shm = tmp_path / "shm"  # one checkpoint folder for all (a real slice's is in storage)
        on_slice_host(vm, i, hosts)
    vms[0].run("convert")
    try:
        for vm in vms:
            assert "Started training" in vm.run("start_training").stdout
        for vm in vms:
            fields, seen = vm.wait_for_training()
            assert fields["state"] == "succeeded" and fields["last_step"] == "12", seen
    finally:
        for vm in vms:
            pid_file = vm.home / "maxtext-sft-runs" / vm.spec.run_name / "pid"
            if pid_file.exists():
                try:
                    os.killpg(int(pid_file.read_text()), signal.SIGKILL)
                except ProcessLookupError:
                    pass
    logs = [(vm.home / "maxtext-sft-runs" / vm.spec.run_name / "train.log").read_text() for vm in vms]
    assert f"Starting JAX distributed service on 127.0.0.1:{port}" in logs[0]
    assert all(f"Connecting to JAX distributed service on 127.0.0.1:{port}" in log for log in logs)
    final = vms[0].path(vms[0].spec.final_checkpoint_path)
    assert sorted(p.name for p in final.glob("ocdbt.process_*")) == [f"ocdbt.process_{i}" for i in range(4)]


def run_script(vm, script: str, *args: str) -> subprocess.CompletedProcess:
    env = {"HOME": str(vm.home), "PATH": "/usr/bin:/bin"}
    return subprocess.run(["bash", str(vm_scripts_dir() / script), *args], capture_output=True, text=True, env=env)


def test_loss_history_prints_every_step_line_of_the_training_and_is_safe_to_run_twice(vm):
    # start_training.sh copies these lines to storage as the training exits (the final loss).
    args = (vm.spec.work_dir, vm.spec.run_name)
    missing = run_script(vm, "loss_history.sh", *args, "2000")
    assert missing.returncode != 0 and "no training log" in missing.stderr
    converted(vm)
    vm.run("start_training")
    assert vm.wait_for_training()[0]["state"] == "succeeded"
    first = run_script(vm, "loss_history.sh", *args, "2000")
    assert first.returncode == 0 and first.stdout == run_script(vm, "loss_history.sh", *args, "2000").stdout
    lines = first.stdout.splitlines()
    assert all("completed step: " in line for line in lines)
    history = parse_loss_history(lines)
    assert [step for step, _ in history] == list(range(1, 13))
    assert all(isinstance(loss, float) and loss > 0 for _, loss in history)
    # A long log is thinned to MAX_LINES lines, the first and last step always kept.
    steps = [step for step, _ in parse_loss_history(run_script(vm, "loss_history.sh", *args, "5").stdout.splitlines())]
    assert len(steps) <= 5 and steps[0] == 1 and steps[-1] == 12


def test_training_metrics_prints_every_eval_and_the_steps_metrics_and_is_safe_to_run_twice(vm):
    missing = vm.run("training_metrics", check=False)
    assert missing.returncode != 0 and "no metrics file" in missing.stderr
    converted(vm)
    vm.run("start_training")
    assert vm.wait_for_training()[0]["state"] == "succeeded"
    first = vm.run("training_metrics", token=None)
    assert first.stdout == vm.run("training_metrics", token=None).stdout
    metrics = parse_metrics(first.stdout.splitlines())
    assert [step for step, _ in metrics.train] == list(range(1, 13))
    # eval_interval = steps: the base model before the first step, the tuned one after the last.
    assert [step for step, _ in metrics.eval] == [0, 12]
    results = metrics.eval_results(12)
    assert results["tuned"] < results["base"]
    # Many steps are thinned to MAX_LINES lines, the evaluations all kept.
    script, args = STEPS["training_metrics"].script, STEPS["training_metrics"].arguments(vm.spec, {})
    thin = parse_metrics(run_script(vm, script, *args[:2], "5").stdout.splitlines())
    assert len(thin.train) <= 5 and thin.train[0][0] == 1 and thin.train[-1][0] == 12
    assert thin.eval == metrics.eval


def test_export_writes_the_hf_files_and_is_safe_to_run_twice(vm):
    # The stand-in shards its export like MaxText's export of Gemma 3 4B.
    converted(vm)
    vm.run("start_training")
    assert vm.wait_for_training()[0]["state"] == "succeeded"
    for _ in range(2):
        result = vm.run("export")
        assert "Exported Hugging Face model" in result.stdout
        assert "Weights: 4 shards named by model.safetensors.index.json: model-00001-of-00004.safetensors" in result.stdout
        # MaxText's text-only export of Gemma 3 (model.language_model.* under a multimodal config)
        # leaves the step as Gemma 3's text model (include/vm/text_only_export.py).
        assert "Architecture: Gemma3ForCausalLM (text only" in result.stdout
    export = vm.path(vm.spec.hf_export_dir)
    assert {"config.json", "model.safetensors.index.json", "model-00004-of-00004.safetensors", "tokenizer.json"} <= {
        p.name for p in export.iterdir()}
    assert check_export_folder(export).layout == "sharded"
    config = json.loads((export / "config.json").read_text())
    assert (config["architectures"], config["model_type"]) == (["Gemma3ForCausalLM"], "gemma3_text")
    weight_map = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.embed_tokens.weight" in weight_map
    assert not [name for name in weight_map if "language_model" in name], weight_map


def test_a_small_model_is_exported_as_one_model_safetensors(vm):
    # Below MaxText's shard threshold the export is a single file (the stand-in's threshold raised).
    vm.faults.write_text(json.dumps({"seconds_per_step": 0.002, "to_huggingface": {"max_shard_size": 1 << 20}}))
    converted(vm)
    vm.run("start_training")
    assert vm.wait_for_training()[0]["state"] == "succeeded"
    assert "Weights: model.safetensors" in vm.run("export").stdout
    export = vm.path(vm.spec.hf_export_dir)
    assert not list(export.glob("model-*")) and check_export_folder(export).weight_files == ("model.safetensors",)


@pytest.fixture
def export_check(tmp_path):
    """export_to_hf.sh with a converter that writes nothing, so its check reads the files a test
    puts in the output folder. Returns (the output folder, a runner of the script)."""
    venv = tmp_path / "fake_venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'PATH="{venv}/bin:$PATH"\n')
    python = venv / "bin" / "python3"
    python.write_text('#!/bin/bash\n[ "$1 $2" = "-m maxtext.checkpoint_conversion.to_huggingface" ] && exit 0\n'
                      'exec /usr/bin/python3 "$@"\n')
    python.chmod(0o755)
    vm = Vm(tmp_path, venv, {})
    vm.path(vm.spec.final_checkpoint_path).mkdir(parents=True)  # a committed final step, on a local disk
    return vm.path(vm.spec.hf_export_dir), lambda: vm.run("export", check=False)


def test_the_export_check_accepts_either_layout(export_check):
    folder, run = export_check
    write_export(folder, "sharded")
    result = run()
    assert result.returncode == 0, result.stderr
    assert f"Weights: 3 shards named by model.safetensors.index.json: {' '.join(SHARDS)}" in result.stdout
    for shard in SHARDS + ["model.safetensors.index.json"]:
        (folder / shard).unlink()
    write_export(folder, "single")
    result = run()
    assert result.returncode == 0, result.stderr
    assert "Weights: model.safetensors" in result.stdout


@pytest.mark.parametrize(
    ("damage", "error"),
    [
        (lambda folder: (folder / SHARDS[1]).unlink(),
         f"wrote no {SHARDS[1]}, a shard named by model.safetensors.index.json"),
        (lambda folder: (folder / SHARDS[2]).write_bytes(b""),
         f"wrote an empty {SHARDS[2]}, a shard named by model.safetensors.index.json"),
        (lambda folder: (folder / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {}}'),
         "wrote a model.safetensors.index.json that names no shard"),
        (lambda folder: (folder / "model.safetensors.index.json").write_text("{"),
         "wrote a model.safetensors.index.json that is not JSON"),
        (lambda folder: (folder / "model.safetensors.index.json").unlink(),
         "wrote neither model.safetensors nor model.safetensors.index.json"),
        (lambda folder: (folder / "config.json").unlink(), "wrote no config.json"),
    ],
    ids=["missing-shard", "empty-shard", "index-naming-no-shard", "unreadable-index", "no-weights", "no-config"],
)
def test_the_export_check_fails_an_incomplete_export_naming_what_is_missing(export_check, damage, error):
    folder, run = export_check
    write_export(folder, "sharded")
    damage(folder)
    result = run()
    assert result.returncode == 1
    assert f"export exited 0 but {error}" in result.stderr and f" in {folder}" in result.stderr
    assert "MAXTEXT_SFT_RESULT" not in result.stdout


def test_export_without_a_checkpoint_fails_clearly(vm):
    result = vm.run("export", check=False)
    assert result.returncode != 0
    assert "no checkpoint at" in result.stderr


# ----- with an output location: the conversion cache in storage ------------------------------


@pytest.fixture
def storage_vms(tmp_path, image_venv, local_cloud):
    """Two runs' VMs (same base model) whose scripts reach the local cloud's storage."""
    bucket = f"cache-{uuid.uuid4().hex[:10]}"
    local_cloud.create_bucket(bucket)
    env = {**storage_env(local_cloud.storage_url), "CLOUDSDK_CONFIG": str(tmp_path / "gcloud")}
    params = {"output_location": f"gs://{bucket}/sft"}
    first = Vm(tmp_path / "a", image_venv, params, env, run_id="manual__a")
    second = Vm(tmp_path / "b", image_venv, params, env, run_id="manual__b")
    return first, second, storage.Client(
        project="p", credentials=AnonymousCredentials(), client_options={"api_endpoint": local_cloud.storage_url}
    ).bucket(bucket)


def reported(result) -> str:
    return re.findall(r"^MAXTEXT_SFT_RESULT base_checkpoint=(.*)$", result.stdout, re.M)[-1]


def test_a_conversion_is_published_once_and_reused_by_the_next_run(storage_vms, tmp_path):
    first, second, bucket = storage_vms
    assert first.spec.base_checkpoint_cache == second.spec.base_checkpoint_cache
    cache = first.spec.base_checkpoint_cache.removeprefix(f"gs://{bucket.name}/")
    converted_first = first.run("convert", path_prefix=gcloud_recorder(tmp_path / "recorded"))
    items = reported(converted_first)
    # Its folder was looked at with one listing, and with nothing in it nothing was removed.
    calls = (tmp_path / "recorded" / "calls").read_text().splitlines()
    assert [c.split()[:3] for c in calls if c.split()[:2] != ["storage", "cat"]] == [
        ["storage", "objects", "list"], ["storage", "objects", "describe"], ["storage", "cp", "--if-generation-match=0"]
    ], calls
    assert items == f"{first.spec.maxtext_checkpoint_dir}0/items"
    assert bucket.blob(f"{cache}/COMPLETE.json").exists()
    assert bucket.blob(items.removeprefix(f"gs://{bucket.name}/") + "/commit_success.txt").exists()
    assert first.run("convert").stdout.count("skipping conversion") == 1  # safe to run twice
    reused = second.run("convert")
    assert reported(reused) == items
    assert "converted before" in reused.stdout and "Converted checkpoint" not in reused.stdout
    assert not list(bucket.list_blobs(prefix=f"{cache}/attempts/{second.spec.run_name}/"))


def test_a_retried_conversion_keeps_a_finished_checkpoint_and_clears_a_half_written_one(storage_vms):
    # The run's own folder, before its marker was published (a retry of the task): a committed
    # checkpoint there is used as it is; one without commit_success.txt is removed first.
    first, second, bucket = storage_vms
    cache = first.spec.base_checkpoint_cache.removeprefix(f"gs://{bucket.name}/")
    items = reported(first.run("convert"))
    bucket.blob(f"{cache}/COMPLETE.json").delete()
    again = first.run("convert")
    assert "Checkpoint already converted in" in again.stdout and "Converted checkpoint" not in again.stdout
    assert reported(again) == items
    bucket.blob(f"{cache}/COMPLETE.json").delete()
    left = second.spec.maxtext_checkpoint_dir.removeprefix(f"gs://{bucket.name}/") + "0/items/half-written"
    bucket.blob(left).upload_from_string("an interrupted conversion's object")
    cleared = second.run("convert")
    assert "Converted checkpoint" in cleared.stdout
    assert reported(cleared) == f"{second.spec.maxtext_checkpoint_dir}0/items"
    assert not bucket.blob(left).exists()
    assert bucket.blob(reported(cleared).removeprefix(f"gs://{bucket.name}/") + "/commit_success.txt").exists()


def test_of_two_concurrent_conversions_the_second_to_finish_adopts_the_first(storage_vms, tmp_path):
    first, second, bucket = storage_vms
    cache = first.spec.base_checkpoint_cache.removeprefix(f"gs://{bucket.name}/")
    items = reported(first.run("convert"))
    marker = bucket.get_blob(f"{cache}/COMPLETE.json")
    # The second run looked for the marker before the first one published it: a gcloud on its
    # PATH answers that first look with "no such object", then runs the real gcloud.
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "gcloud").write_text(
        "#!/bin/bash\n"
        f'if [ "$1 $2" = "storage cat" ] && [[ "$3" == */COMPLETE.json ]] && [ ! -e {shim}/looked ]; then\n'
        f"  touch {shim}/looked; exit 1\nfi\n"
        'exec /usr/bin/gcloud "$@"\n'
    )
    (shim / "gcloud").chmod(0o755)
    late = second.run("convert", path_prefix=f"{shim}:")
    assert "Converted checkpoint" in late.stdout  # it did convert, believing it was first
    assert "Another run published this conversion first" in late.stdout
    assert reported(late) == items
    assert bucket.get_blob(f"{cache}/COMPLETE.json").generation == marker.generation  # never overwritten
    assert not list(bucket.list_blobs(prefix=f"{cache}/attempts/{second.spec.run_name}/"))


# ----- with an output location: the training's copies as it exits ---------------------------


def gcloud_recorder(folder: Path, fail_copies: bool = False) -> str:
    """A gcloud first on a script's PATH that notes each call's arguments in folder/calls, then
    runs the real one (or, with fail_copies, fails every `storage cp`); the PATH prefix."""
    folder.mkdir(exist_ok=True)
    fail = '[ "$1 $2" = "storage cp" ] && exit 1\n' if fail_copies else ""
    (folder / "gcloud").write_text(f'#!/bin/bash\necho "$*" >>{folder}/calls\n{fail}exec /usr/bin/gcloud "$@"\n')
    (folder / "gcloud").chmod(0o755)
    return f"{folder}:"


def copies(folder: Path) -> list[list[str]]:
    return [line.split()[2:] for line in (folder / "calls").read_text().splitlines() if line.startswith("storage cp ")]


def test_a_finished_training_copies_its_step_lines_metrics_and_log_in_one_gcloud_call(storage_vms, tmp_path):
    vm, _, bucket = storage_vms
    vm.run("convert")
    shim = tmp_path / "recorded"
    vm.run("start_training", path_prefix=gcloud_recorder(shim))
    fields, seen = vm.wait_for_training()
    assert (fields["state"], fields["exit_code"]) == ("exited", "0"), seen  # its checkpoints are in storage
    names = [uri.rsplit("/", 1)[1] for uri in (vm.spec.training_steps_uri, vm.spec.training_metrics_uri, vm.spec.training_log_uri)]
    assert copies(shim) == [[*names, f"{vm.spec.run_output_dir}/"]]  # one call, each file under its object's name
    job = vm.home / "maxtext-sft-runs" / vm.spec.run_name
    for uri, local in zip((vm.spec.training_steps_uri, vm.spec.training_metrics_uri, vm.spec.training_log_uri),
                          ("step-lines.log", "metrics.jsonl", "train.log")):
        assert bucket.blob(uri.removeprefix(f"gs://{bucket.name}/")).download_as_text() == (job / local).read_text(), uri
    assert "completed step: 12," in (job / "step-lines.log").read_text()


def test_a_file_for_another_folder_is_copied_alone(storage_vms, tmp_path):
    vm, _, bucket = storage_vms
    vm.run("convert")
    elsewhere = f"gs://{bucket.name}/elsewhere/metrics.jsonl"
    shim = tmp_path / "recorded"
    vm.run("start_training", path_prefix=gcloud_recorder(shim), replace={vm.spec.training_metrics_uri: elsewhere})
    assert vm.wait_for_training()[0]["exit_code"] == "0"
    job = vm.home / "maxtext-sft-runs" / vm.spec.run_name
    assert copies(shim) == [[str(job / "metrics.jsonl"), elsewhere],
                            ["training-steps.log", "training.log", f"{vm.spec.run_output_dir}/"]]
    assert bucket.blob("elsewhere/metrics.jsonl").download_as_text() == (job / "metrics.jsonl").read_text()


def test_a_failed_copy_is_a_warning_in_the_log_and_the_training_still_reports_its_end(storage_vms, tmp_path):
    vm, _, bucket = storage_vms
    vm.run("convert")
    vm.run("start_training", path_prefix=gcloud_recorder(tmp_path / "failing", fail_copies=True))
    fields, seen = vm.wait_for_training()
    assert fields["exit_code"] == "0", seen  # the training's end is still reported
    job = vm.home / "maxtext-sft-runs" / vm.spec.run_name
    assert (f"WARNING: could not copy training-steps.log training-metrics.jsonl training.log to "
            f"{vm.spec.run_output_dir}/ (see {job}/upload.log)") in (job / "train.log").read_text()
    assert not bucket.blob(vm.spec.training_log_uri.removeprefix(f"gs://{bucket.name}/")).exists()
