"""TrainingStatusTrigger against a real sshd VM of the local cloud: the event for each outcome of a
training (faked on the VM as start_training.sh leaves it: a pid file, train.log, an exit code),
the pinned host key, an unanswering VM and its bound, the timeout; and its serialization. And
TrainingStartTrigger, a try's first watch with no worker before it: from the spec as the triggerer
renders it, it finds the VM or sends the worker to check."""

from __future__ import annotations

import asyncio
import base64
import re
import shlex
import time
from contextlib import contextmanager
from datetime import datetime, timezone

import pytest
from google.api_core.exceptions import NotFound

from localcloud.compute.leases import NEVER_LEASED
from localcloud.connections import LOCAL_PROJECT, LOCAL_RUN_CONF
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.vm.ssh import VmSSHHook
from maxtext_sft.run.spec import build_run_spec
from maxtext_sft.vm.training_watch import TrainingStartTrigger, TrainingStatusTrigger
from maxtext_sft.vm.steps import remote_command, script_files

SSH_CONN_ID = "maxtext_sft_vm_ssh"
GCP_CONN_ID = "google_cloud_default"


def vm_spec(name: str):
    """A RunSpec of its own run (its VM's name, its run folder), with the pipeline's key and user."""
    from airflow.providers.ssh.hooks.ssh import SSHHook

    key = SSHHook(ssh_conn_id=SSH_CONN_ID, remote_host="unused").pkey
    return build_run_spec(
        {"reservation": LOCAL_RUN_CONF["reservation"], "project_id": LOCAL_PROJECT, "steps": 5},
        dag_id="trigger_tests",
        run_id=f"manual__{name}_{time.time()}",
        generation=0,
        started=datetime.now(timezone.utc),
        default_project_id=None,
        ssh_user="maxtext",
        ssh_public_key=f"{key.get_name()} {key.get_base64()}",
    )


@contextmanager
def made_vm(spec):
    """A VM made from `spec`'s insert body, the step scripts uploaded: (spec, address, host keys,
    a paramiko hook to it); deleted on leaving (if it still exists)."""
    compute = ComputeEngineEndpointHook(gcp_conn_id=GCP_CONN_ID)
    where = {"zone": spec.zone, "project_id": spec.project_id}
    compute.insert_instance(body=spec.instance_body(), **where)
    try:
        address = compute.get_instance_address(resource_id=spec.vm_name, **where)
        deadline = time.monotonic() + 60
        while not (keys := compute.get_host_keys(resource_id=spec.vm_name, **where)):
            assert time.monotonic() < deadline, "no host keys published"
            time.sleep(0.5)  # polling interval: the guest agent publishes them after boot
        hook = VmSSHHook(ssh_conn_id=SSH_CONN_ID, remote_host=address, host_keys=keys, conn_timeout=10)
        deadline = time.monotonic() + 60
        while True:
            try:
                with hook.get_conn():
                    hook.upload_scripts(script_files())
                break
            except Exception:
                assert time.monotonic() < deadline, "the VM's sshd did not answer"
                time.sleep(0.5)  # polling interval: sshd starts with the VM
        yield spec, address, keys, hook
    finally:
        try:
            compute.delete_instance(resource_id=spec.vm_name, **where)
        except NotFound:
            pass  # a test deleted it


@pytest.fixture(scope="module")
def vm(pipeline_connections, local_cloud):
    """One VM made from a RunSpec's insert body (the pipeline's own key and user), the step
    scripts uploaded: (spec, address, host keys, a paramiko hook to it)."""
    with made_vm(vm_spec("vm")) as made:
        yield made


def run_on_vm(hook: VmSSHHook, script: str) -> None:
    with hook.get_conn():
        status, tail = hook.run_command(f"bash -c {shlex.quote(script)}", timeout=60, on_line=lambda _: None)
    assert status == 0, tail


def job_dir(spec) -> str:
    work_dir = spec.work_dir.replace("~", "$HOME", 1) if spec.work_dir.startswith("~") else spec.work_dir
    return f"{work_dir}/maxtext-sft-runs/{spec.run_name}"


def fake_training(spec, hook, *, steps: int, alive: bool, exit_code: int | None, tail: str = "", first: int = 1) -> None:
    """The files start_training.sh keeps for a training: its pid, its log (steps `first` to
    `steps`; from 1 a new training, else appended), its exit code."""
    lines = "\n".join(f"completed step: {n}, seconds: 1.0, loss: {2.0 - n / 10:.2f}" for n in range(first, steps + 1))
    script = f"""
        set -e
        dir="{job_dir(spec)}"
        if [ {first} = 1 ]; then rm -rf "$dir"; fi
        mkdir -p "$dir"
        printf '%s\\n' {shlex.quote(lines + tail)} >>"$dir/train.log"
        if [ {'yes' if alive else 'no'} = yes ]; then
            nohup sleep 600 >/dev/null 2>&1 &
            echo $! >"$dir/pid"
        else
            echo 999999 >"$dir/pid"
        fi
    """
    if exit_code == 0:  # the final checkpoint is committed before the process exits
        script += f'mkdir -p {shlex.quote(spec.checkpoints_dir)}/{spec.steps}/model_params\n'
    if exit_code is not None:  # as start_training.sh writes it: a reader never sees half a file
        script += f'echo {exit_code} >"$dir/exit_code.tmp" && mv "$dir/exit_code.tmp" "$dir/exit_code"\n'
    run_on_vm(hook, script)


def vm_ssh_kwargs(spec, address, keys) -> dict:
    """A VM SSH trigger's arguments for the test VM: quick polls, a minute's deadline."""
    return dict(
        ssh_conn_id=SSH_CONN_ID,
        host=address,
        host_keys=keys,
        vm_name=spec.vm_name,
        project_id=spec.project_id,
        zone=spec.zone,
        gcp_conn_id=GCP_CONN_ID,
        poll_interval=0.2,
        first_poll_after=0,
        deadline=time.time() + 60,
        connect_timeout=5,
    )


def trigger_for(spec, address, keys, **overrides) -> TrainingStatusTrigger:
    kwargs = dict(command=remote_command("training_status", spec), run_name=spec.run_name, stall_timeout_seconds=3600)
    return TrainingStatusTrigger(**{**vm_ssh_kwargs(spec, address, keys), **kwargs, **overrides})


def first_event(trigger, timeout: float = 60) -> dict:
    async def first():
        return await asyncio.wait_for(anext(trigger.run()), timeout)

    return asyncio.run(first()).payload


def test_serialize_round_trip():
    trigger = TrainingStatusTrigger(
        ssh_conn_id="ssh", host="10.0.0.2", host_keys={"ssh-ed25519": "AAAA"}, command="bash x", vm_name="vm",
        run_name="run", project_id="p", zone="z", gcp_conn_id="gcp", poll_interval=30, stall_timeout_seconds=900,
        deadline=1234.5, username="sa_1", iap={"gcp_conn_id": "gcp", "project": "p", "zone": "z", "instance": "vm", "port": 22}, unreachable_deadline=99.0, first_event_after=60,
        checkpoints_dir="gs://b/c", checkpoints_kept=2,
    )
    classpath, kwargs = trigger.serialize()
    assert classpath == "maxtext_sft.vm.training_watch.TrainingStatusTrigger"
    again = TrainingStatusTrigger(**kwargs)
    assert again.serialize() == (classpath, kwargs)
    assert kwargs["first_poll_after"] == 30  # a poll interval after the worker's own check


def test_a_running_training_is_logged_and_watched_until_it_succeeds(vm, capsys):
    spec, address, keys, hook = vm
    fake_training(spec, hook, steps=3, alive=True, exit_code=None)

    async def watch():
        events = trigger_for(spec, address, keys).run()
        waiting = asyncio.ensure_future(anext(events))
        done, _ = await asyncio.wait({waiting}, timeout=3)
        assert not done, "an event while the training runs"
        await asyncio.to_thread(fake_training, spec, hook, steps=5, alive=False, exit_code=0, first=4)
        return (await asyncio.wait_for(waiting, 30)).payload

    capsys.readouterr()
    event = asyncio.run(watch())
    assert event["status"] == "training" and event["exit_status"] == 0
    assert event["output"][-1].startswith("MAXTEXT_SFT_STATUS state=succeeded exit_code=0 last_step=5 ")
    assert event["last_step"] == 5 and event["answered"] is True
    logged = capsys.readouterr().out  # the trigger's log: the triggerer ships it to the task's log
    progress = re.findall(r"training progress: step \d+, loss [0-9.]+", logged)
    assert progress == [f"training progress: step {n}, loss {2.0 - n / 10:.2f}" for n in range(1, 6)]  # each once
    assert f"Training {spec.run_name}: state running, last step 3," in logged


def test_a_crashed_training_comes_back_with_its_tail(vm):
    spec, address, keys, hook = vm
    fake_training(spec, hook, steps=4, alive=False, exit_code=1, tail="\nTraceback (most recent call last):\nBoom")
    event = first_event(trigger_for(spec, address, keys))
    assert event["status"] == "training"
    assert event["output"][0].startswith("--- tail of ")
    assert "Traceback (most recent call last):" in event["output"] and "Boom" in event["output"]
    assert event["output"][-1].startswith("MAXTEXT_SFT_STATUS state=failed exit_code=1 last_step=4 ")


def test_no_training_started_and_a_stall_go_to_the_worker(vm):
    spec, address, keys, hook = vm
    run_on_vm(hook, f'rm -rf "{job_dir(spec)}"')
    started = time.monotonic()
    event = first_event(trigger_for(spec, address, keys, first_event_after=2))
    assert event["status"] == "training" and "reason=no-training-started" in event["output"][-1]
    assert time.monotonic() - started >= 2  # held until the executor has reported the deferral

    fake_training(spec, hook, steps=2, alive=True, exit_code=None)
    event = first_event(trigger_for(spec, address, keys, stall_timeout_seconds=-1))
    assert event["status"] == "training" and "state=running" in event["output"][-1]


# An Ed25519 key the test VM's sshd does not have.
WRONG_KEY = {"ssh-ed25519": base64.b64encode(b"\x00\x00\x00\x0bssh-ed25519\x00\x00\x00\x20" + bytes(range(32))).decode()}


def test_a_host_key_other_than_the_published_one_is_refused(vm):
    spec, address, keys, hook = vm
    event = first_event(trigger_for(spec, address, WRONG_KEY))
    assert event["status"] == "refused" and event["kind"] == "host_key", event
    assert "refusing to connect" in event["message"]


def test_an_unanswering_vm_goes_to_the_worker_at_once_then_at_its_bound(vm, local_cloud):
    spec, address, keys, hook = vm
    nobody = NEVER_LEASED[0]  # nothing listens there
    event = first_event(trigger_for(spec, nobody, keys))
    assert event["status"] == "unreachable" and event["answered"] is False and event["error"], event

    started = time.time()
    event = first_event(trigger_for(spec, nobody, keys, unreachable_deadline=started + 2))
    assert event["status"] == "unreachable"
    assert time.time() - started >= 2  # polled on while the VM is RUNNING, until the bound


def test_the_training_timeout_ends_the_wait(vm):
    spec, address, keys, hook = vm
    fake_training(spec, hook, steps=1, alive=True, exit_code=None)
    event = first_event(trigger_for(spec, address, keys, deadline=time.time() + 1))
    assert event == {"status": "timeout", "last_step": 1, "answered": True}


def test_without_the_step_scripts_the_worker_checks(vm):
    """A VM recreated since the worker uploaded the scripts has none: the worker's check uploads them."""
    spec, address, keys, hook = vm
    command = remote_command("training_status", spec).replace("training_status.sh", "no_such_script.sh")
    event = first_event(trigger_for(spec, address, keys, command=command))
    assert event["status"] == "no_status" and event["exit_status"] != 0 and event["answered"] is True, event


def test_a_byte_that_is_not_utf8_is_logged_replaced_and_the_vm_stays_answered(vm, capsys):
    """A training line with bytes that are not UTF-8 (a progress bar's, a library's) is logged with
    U+FFFD, as the workers' checks log it: the check is not lost (the script's cursor has passed
    its lines), nor taken for one without a status."""
    spec, address, keys, hook = vm
    fake_training(spec, hook, steps=2, alive=True, exit_code=None)
    run_on_vm(hook, rf"""printf 'WARNING: bar \377\376 50%%\ncompleted step: 3, seconds: 1.0, loss: 1.70\n' >>"{job_dir(spec)}/train.log" """)
    capsys.readouterr()
    event = first_event(trigger_for(spec, address, keys, stall_timeout_seconds=-1))
    assert event["status"] == "training" and event["answered"] is True, event
    logged = capsys.readouterr().out
    assert "WARNING: bar \ufffd\ufffd 50%" in logged
    assert "training progress: step 3, loss 1.70" in logged


async def closed(conn) -> bool:
    """Whether SSH connection `conn` is closed (within 5 s)."""
    try:
        await asyncio.wait_for(conn.wait_closed(), 5)
    except TimeoutError:
        return False
    return True


def test_each_check_closes_its_connection_and_a_cancelled_trigger_its_open_one(vm, monkeypatch):
    """One SSH connection per check, closed after it; the triggerer cancelling the trigger (its
    task cleared or marked, the triggerer stopping) mid-check closes the one open and ends it."""
    from maxtext_sft.vm.ssh_async import VmSSHHookAsync

    spec, address, keys, hook = vm
    fake_training(spec, hook, steps=2, alive=True, exit_code=None)
    connect = VmSSHHookAsync.get_conn

    async def watch_then_cancel():
        opened, third = [], asyncio.Event()

        async def recorded(self):
            conn = await connect(self)
            opened.append(conn)
            if len(opened) == 3:
                third.set()
            return conn

        monkeypatch.setattr(VmSSHHookAsync, "get_conn", recorded)
        waiting = asyncio.ensure_future(anext(trigger_for(spec, address, keys).run()))
        await asyncio.wait_for(third.wait(), 30)  # the third check has its connection open
        assert [await closed(conn) for conn in opened[:2]] == [True, True]  # the checks before it closed theirs
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert await closed(opened[2])
        return len(opened)

    assert asyncio.run(watch_then_cancel()) == 3  # no check after the cancel


# ----- TrainingStartTrigger: the first watch of a try, with no check on the worker before it -----

def start_trigger_for(spec) -> TrainingStartTrigger:
    """The start trigger as the triggerer runs it: `spec` rendered from plan_run's XCom (a dict)
    by the template the sensor gives it, in a sandboxed Jinja environment as BaseTrigger's."""
    from jinja2.sandbox import SandboxedEnvironment

    from maxtext_sft.cloud.trigger_start import xcom_json_template

    class PlanRunXCom:
        def xcom_pull(self, task_ids, key, map_indexes):
            assert (task_ids, key, map_indexes) == ("plan_run", "spec", -1)
            return spec.to_dict()

    template = xcom_json_template("plan_run", "spec")
    rendered = SandboxedEnvironment(cache_size=0).from_string(template).render(ti=PlanRunXCom())
    return TrainingStartTrigger(spec=rendered, ssh_conn_id=SSH_CONN_ID, gcp_conn_id=GCP_CONN_ID)


def test_the_start_trigger_serializes_its_template_and_connections_only():
    trigger = TrainingStartTrigger(spec="{{ ti.xcom_pull(task_ids='plan_run', key='spec') | tojson }}",
                                   ssh_conn_id="ssh", gcp_conn_id="gcp")
    classpath, kwargs = trigger.serialize()
    assert classpath == "maxtext_sft.vm.training_watch.TrainingStartTrigger"
    assert kwargs == {"spec": trigger.spec, "ssh_conn_id": "ssh", "gcp_conn_id": "gcp", "first_event_after": 0}
    assert TrainingStartTrigger(**kwargs).serialize() == (classpath, kwargs)


def test_the_start_trigger_finds_the_vm_and_polls_at_once(vm):
    """From the rendered spec alone: the VM's address and published host keys from the Compute
    API, then the watch (its first poll at once: no check came before it), the try's clock in the
    event."""
    spec, address, keys, hook = vm
    fake_training(spec, hook, steps=5, alive=False, exit_code=0)
    trigger = start_trigger_for(spec)
    assert trigger.run_spec() == spec  # the JSON text Jinja's tojson made is the spec again
    started = time.time()
    event = first_event(trigger, timeout=30)
    assert event["status"] == "training" and event["answered"] is True and event["last_step"] == 5, event
    assert event["output"][-1].startswith("MAXTEXT_SFT_STATUS state=succeeded exit_code=0 last_step=5 ")
    assert started <= event["watch_since"] <= time.time()
    assert time.time() - started < spec.poke_interval_seconds  # not a poke interval's wait first


def test_the_start_trigger_sends_the_worker_to_check_a_vm_it_cannot_find(pipeline_connections, local_cloud):
    spec = vm_spec("never-made")
    event = first_event(start_trigger_for(spec), timeout=30)
    assert event["status"] == "check" and event["answered"] is False, event
    assert event["error"].startswith("NotFound") and spec.vm_name in event["error"]
    assert event["watch_since"] <= time.time()
