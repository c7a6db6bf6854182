"""Hostile values never run as code on the VM.

A property test: hypothesis puts hostile text (quotes, `$(...)`, backticks, `;`, newlines, globs,
unicode, very long strings) into each value that reaches a remote step. Each value is either
refused when the run is planned (SpecError), or, for every remote step, the command the pipeline
builds is run by the VM's real login shell over SSH against a probe script that reports the
arguments it received: they must equal, byte for byte, the arguments the step meant to pass. A
canary file that injected code would create must never appear. One SSH connection serves every
example; the example count is fixed and the generation derandomized, so CI runs the same cases.
"""

from __future__ import annotations

import io
import time
from datetime import datetime, timezone

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from localcloud.connections import LOCAL_PROJECT, LOCAL_RUN_CONF
from maxtext_sft.vm import steps as vm_steps
from maxtext_sft.run.params import SpecError
from maxtext_sft.run.spec import build_run_spec

pytestmark = pytest.mark.e2e
SSH_CONN_ID = "maxtext_sft_vm_ssh"
PROBE_DIR = ".maxtext-sft/argv-probe"
CANARY = "pwned-by-a-value"
EXAMPLE_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample"
# What a shell would run if a value escaped its quoting: each creates the canary in the home folder.
PAYLOADS = [
    f"$(touch ~/{CANARY})",
    f"`touch ~/{CANARY}`",
    f"x; touch ~/{CANARY}",
    f"x\ntouch ~/{CANARY}",
    f"x' ; touch ~/{CANARY}; echo '",
    f'x" ; touch ~/{CANARY}; echo "',
    f"x && touch ~/{CANARY} || touch ~/{CANARY}",
    f"x | tee ~/{CANARY}",
    f"x > ~/{CANARY}",
    "*",
    "~/*",
    "${HOME}",
    "$HOME/../../etc/passwd",
    "-rf",
    "--help",
    "",
    " ",
    "\\",
    "é😀中\u202e",
]
HOSTILE = st.one_of(
    st.sampled_from(PAYLOADS),
    st.text(alphabet="$`'\"\\;|&<>*?[]{}()~!#%^\n\t =/.-_:@,aZ9", max_size=40),
    st.text(st.characters(codec="utf-8"), max_size=60),
    st.builds(lambda unit, times: unit * times, st.sampled_from(["$(x)", "a", "é"]), st.integers(300, 1000)),
    st.builds(lambda a, b: a + b, st.sampled_from(PAYLOADS), st.text(max_size=20)),
)


def with_value(field: str, value: str) -> dict:
    """Params with `value` put where `field` takes text (a list item, an extra argument's value...)."""
    if field in ("convert_extra_args", "train_extra_args", "export_extra_args"):
        return {field: [f"some_key={value}"]}
    if field == "train_data_columns":
        return {field: [value]}
    return {field: value}


FIELDS = [
    "work_dir", "maxtext_version", "model_name", "model_revision", "dataset_name", "dataset_revision",
    "train_split", "train_data_columns", "output_location", "base_model_id",
    "convert_extra_args", "train_extra_args", "export_extra_args",
]


@pytest.fixture(scope="module")
def probe(local_cloud, pipeline_connections):
    """A VM with probe scripts named like the step scripts, and one open SSH connection to it."""
    from airflow.providers.ssh.hooks.ssh import SSHHook
    from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
    from maxtext_sft.vm.ssh import VmSSHHook

    key = SSHHook(ssh_conn_id=SSH_CONN_ID, remote_host="unused").pkey
    spec = spec_for({}, run_id=f"manual__{time.time()}", public_key=f"{key.get_name()} {key.get_base64()}")
    compute = ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default")
    where = {"zone": spec.zone, "project_id": LOCAL_PROJECT}
    compute.insert_instance(body=spec.instance_body(), **where)
    try:
        hook = VmSSHHook(
            ssh_conn_id=SSH_CONN_ID,
            remote_host=compute.get_instance_address(resource_id=spec.vm_name, **where),
            host_keys=compute.get_host_keys(resource_id=spec.vm_name, **where),
            conn_timeout=10,
        )
        # Each argument as hex on its own line: newlines and any byte survive the trip back.
        script = b"""#!/usr/bin/env bash
for arg in "$@"; do printf '%s' "$arg" | od -An -v -tx1 | tr -d ' \\n'; echo; done
echo END
"""
        with hook.get_conn():
            sftp = hook.get_conn().open_sftp()
            sftp.mkdir(".maxtext-sft")
            sftp.mkdir(PROBE_DIR)
            for step in vm_steps.STEPS.values():
                sftp.putfo(io.BytesIO(script), f"{PROBE_DIR}/{step.script}")
            sftp.close()
            yield hook, local_cloud.state_dir / "vms" / spec.vm_name / "home" / spec.ssh_user
    finally:
        compute.delete_instance(resource_id=spec.vm_name, **where)


def spec_for(params: dict, run_id: str = "manual__quoting", public_key: str = EXAMPLE_KEY):
    return build_run_spec(
        {**LOCAL_RUN_CONF, **params},
        dag_id="quoting_tests",
        run_id=run_id,
        generation=0,
        started=datetime(2026, 11, 30, tzinfo=timezone.utc),
        default_project_id=None,
        ssh_user="maxtext",
        ssh_public_key=public_key,
    )


OUTCOMES = {"refused": 0, "passed as data": 0}


@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(FIELDS), value=HOSTILE, reported=HOSTILE)
def test_a_hostile_value_is_refused_or_arrives_as_data(probe, monkeypatch_module, field, value, reported):
    hook, home = probe
    try:
        spec = spec_for(with_value(field, value))
    except SpecError:
        OUTCOMES["refused"] += 1
        return
    OUTCOMES["passed as data"] += 1
    # What an earlier step reported comes back from the VM: treated as hostile too.
    results = {"base_checkpoint": reported}
    for name, step in vm_steps.STEPS.items():
        expected = step.arguments(spec, results)
        try:
            command = vm_steps.remote_command(name, spec, results)
        except ValueError:
            assert any("\x00" in argument for argument in expected)  # refused: no command line carries it
            continue
        lines: list[str] = []
        status, _ = hook.run_command(command, timeout=30, on_line=lines.append)
        assert status == 0 and lines[-1] == "END", lines[-5:]
        assert [bytes.fromhex(line).decode() for line in lines[:-1]] == expected, name
    assert not (home / CANARY).exists()


@pytest.fixture(scope="module")
def monkeypatch_module():
    """Point the step commands at the probe scripts for this module only."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vm_steps, "REMOTE_SCRIPT_DIR", PROBE_DIR)
        yield patch


def test_both_outcomes_were_exercised():
    """The property test above saw values refused and values passed (runs after it, in file order)."""
    assert OUTCOMES["refused"] > 10 and OUTCOMES["passed as data"] > 10, OUTCOMES
