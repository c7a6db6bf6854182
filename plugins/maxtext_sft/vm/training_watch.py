"""Watch a training on the triggerer: training_status.sh over SSH, every poll, until the worker is needed.

Each poll opens one SSH connection to the VM (vm/ssh_async.py: asyncssh, only the host keys
the VM published are accepted), runs training_status.sh (uploaded by the worker before it
deferred; it gets no secret) and logs what a person reads of its new lines (`TrainingLogFilter`:
step lines, evaluations, warnings and errors, not MaxText's config dump and import noise) and each
step's loss: a deferred task's triggerer log is part of its task log. A watch starts by naming
where the full log is (on the VM, and in storage once the training exits). With
`checkpoints_kept`, each poll also deletes the committed checkpoints older than the newest ones
kept.

Events (one, then the trigger ends); each carries `last_step` (the last step seen, or None) and
`answered` (whether some poll reached the VM):
  {"status": "training", "exit_status": S, "output": [...]}   the training ended (succeeded,
      exited, failed), stalled past stall_timeout_seconds, or was never started: the worker judges
      it. `output` is the tail the judgement needs (the failure's "--- tail", else the last 40
      lines), the status line last; every line was logged here already.
  {"status": "no_status", "exit_status": S, "output": [...]}   the script printed no status line:
      not there (a VM recreated since the worker uploaded the step scripts), or broken; the worker
      checks itself, which uploads the scripts
  {"status": "unreachable", "error": ...}   no SSH answer, and no bound was running (the worker
      starts one after asking the Compute API about the VM), or the bound `unreachable_deadline`
      passed, or the Compute API says the VM is gone or TERMINATED
  {"status": "refused", "kind": "host_key" | "login", "message": ...}   not the VM's host key,
      or its sshd refused the login: the worker fails the task, as VmSSHHook's errors do
  {"status": "timeout"}   `deadline` (training_timeout_hours) passed
No event leaves before `first_event_after` seconds from the trigger's start (vm/trigger_ssh.py:
apache/airflow#72716); the polls and their log lines do not wait.

`TrainingStartTrigger` is the first watch of a try, started by the scheduler on the triggerer
(wait_for_final_checkpoint's start_from_trigger): no task process runs before it. It finds the
VM's SSH target as the worker's check does, then watches as above; its event adds
`watch_since`, and {"status": "check", "error": ...} says it found no SSH target (the worker's
own check finds out why).

A slice: `SliceTrainingStatusTrigger` watches host 0 as above and, at each poll, reads every other
host's status and asks the Compute API whether a host is lost; its event is host 0's, or names
the hosts whose training died or that are lost (see that class).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Any

from maxtext_sft.results.loss_curve import STEP_LINE
from maxtext_sft.run.sizing import prunable_steps
from maxtext_sft.vm.trigger_ssh import HeldEventTrigger, VmSshTrigger, cancel_all

STATUS_LINE = re.compile(r"^MAXTEXT_SFT_STATUS (.*)$")
TAIL_MARKER = "--- tail of "
TAIL_LINES = 40
# A watch logs the training's status line when its state or last step changes, and at least this
# often while neither does (a compilation, an evaluation): not at every poll.
STATUS_REPEAT_SECONDS = 300


def status_fields(line: str) -> dict[str, str]:
    """The key=value fields of training_status.sh's status line."""
    return dict(item.split("=", 1) for item in STATUS_LINE.match(line).group(1).split())


def number(text: str | None) -> float | int | None:
    if text in (None, "none"):
        return None
    try:
        return int(text)
    except ValueError:
        return float(text)


def status_last(output: list[str]) -> list[str] | None:
    """training_status.sh's lines with its status line last, or None without one. stdout and
    stderr come over separate SSH channels: a stderr line may follow the status line."""
    at = next((i for i in range(len(output) - 1, -1, -1) if STATUS_LINE.match(output[i])), None)
    if at is None:
        return None
    return [*output[:at], *output[at + 1 :], output[at]]


def tail_start(output: list[str]) -> int:
    for index in range(len(output) - 1, -1, -1):
        if output[index].startswith(TAIL_MARKER):
            return index + 1
    return max(0, len(output) - TAIL_LINES - 1)


def tail_for_the_worker(ordered: list[str]) -> list[str]:
    """Of training_status.sh's lines, status line last (`status_last`), what the worker's judgement
    needs: the failure's "--- tail" (with that line, for the worker's tail_start), else the last
    40 lines, and the status line."""
    return ordered[max(0, tail_start(ordered) - 1) :]


def needs_the_worker(fields: dict[str, str], stall_timeout_seconds: float) -> bool:
    """Whether a status is for the worker to act on: anything but a training running and stepping."""
    if fields.get("reason") == "no-training-started" or fields.get("state") != "running":
        return True
    return (number(fields.get("idle_seconds")) or 0) > stall_timeout_seconds


def training_died(fields: dict[str, str]) -> bool:
    """Whether a status says the training process is dead: exited non-zero, killed before it
    wrote its exit code, or never started (reason=no-training-started). What a slice's other host
    is watched for: its own end, a success included, is host 0's to judge."""
    return fields.get("state") == "failed"


def error_text(error: BaseException) -> str:
    """An error's type and text, for a log line or an event (its type alone when it has no text)."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def unanswered_errors() -> tuple[type[BaseException], ...]:
    """What a check raises when the VM did not answer (for `except`: evaluated only when something
    was raised); a refusal (`TrainingStatusTrigger._refusal`) is among them."""
    import asyncssh

    return (OSError, EOFError, asyncio.TimeoutError, asyncssh.Error)


# ----- what of MaxText's log the task log shows ---------------------------------------------------
#
# MaxText 0.2.2 writes ~1,000 lines before its first step on CPU and more on a TPU VM: its config
# dump (one `pyconfig.py] Config param NAME: VALUE` line per setting), TensorFlow's and XLA's
# start-up notes, Orbax's checkpoint chatter, tqdm's progress bar (\r-separated, and a log line
# may follow it on the same line). The task log shows what a person reads: the step lines and the
# evaluations (with a few landmarks: an evaluation starting, a resume, the end of the loop), the
# warnings and errors (absl/glog's W, E and F lines, C++ ones too; Python warnings; `ERROR`,
# `WARNING`, exception and crash lines; tracebacks and faulthandler's thread stacks whole), and the
# pipeline's own WARNING lines. A warning or error identical to one shown already (timestamps and
# thread ids aside; for a Python warning, the same category at the same place) is shown once. The
# full log stays on the VM and is copied to storage when the training exits (start_training.sh).

# absl (Python) and glog (C++) records: "W1205 21:50:44.084530 140475398304448 pyconfig.py:100] ..."
ABSL_RECORD = re.compile(r"([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ([^\s\]]+:\d+)\] ?(.*)")
# TensorFlow's and XLA's C++ records: "2026-12-05 21:50:44.082870: E external/.../cuda_platform.cc:51] ..."
NATIVE_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: ([IWEF]) ([^\s\]]+)\] ?(.*)")
# Where a record starts after other text on the same line (a progress bar's, without a newline).
GLUED_RECORD = re.compile(r"(?<=.)(?=[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\s\]]+:\d+\] )")
# Python's warnings: "/path/file.py:273: FutureWarning: message" (the source line follows, indented).
PYTHON_WARNING = re.compile(r"(\S.*?):(\d+): ([A-Za-z_]\w*Warning): (.*)")
# MaxText's metric_logger: a step's loss, time and throughput ("[Rampup Batch Size Phase]" may come
# first), an evaluation's loss and perplexity: shown whatever comes before them on their line.
STEP_OR_EVAL = re.compile(r"completed step: \d|eval metrics after step: \d")
# What else MaxText and Tunix log at INFO that a person follows a training by.
INFO_SHOWN = (
    "Running evaluation on train step",  # Tunix: an evaluation starts
    "Restored params from step",  # Tunix: a training resumed from a checkpoint
    "Exception in load_next_",  # MaxText's SFT hooks: the data ran out (or failed)
    "Train loop finished in",
)
SEVERITY_WORD = re.compile(r"(ERROR|WARNING|CRITICAL|FATAL)\b")
# An exception's own line ("ValueError: ...", "jaxlib...XlaRuntimeError: INTERNAL: ..."), and a
# process's death as the shell or the loader reports it.
EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)(: |$)")
DEATH_WORDS = re.compile(r"\b(Killed|Segmentation fault|Aborted|No module named|command not found)\b")
TRACEBACK_START = "Traceback (most recent call last):"
CHAINED_EXCEPTION = ("During handling of the above exception", "The above exception was the direct cause")
# faulthandler (PYTHONFAULTHANDLER=1, start_training.sh): "Fatal Python error: ...", then each
# thread's stack under "Thread 0x... (most recent call first):".
THREAD_STACK = re.compile(r"(Current thread|Thread) 0x[0-9a-f]+ .*\(most recent call first\):")


def log_records(line: str) -> list[str]:
    """One line of the log as the records in it: tqdm's redraws (carriage-return-separated) apart,
    and a log record written after a progress bar (no newline between them) apart from the bar."""
    records = []
    for piece in line.split("\r"):
        records += [record.rstrip() for record in GLUED_RECORD.split(piece)]
    return [record for record in records if record]


class TrainingLogFilter:
    """Which of the training log's lines the task log shows (see above). Keeps what it has seen
    across calls: a traceback split across two polls stays whole, a repeated warning is shown once."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, ...]] = set()
        self.stack: str | None = None  # within a traceback ("traceback") or a thread stack ("threads")

    def shown(self, lines: list[str]) -> list[str]:
        """Of the log's new `lines`, the records to show, in order."""
        return [record for line in lines for record in log_records(line) if self._shows(record)]

    def _once(self, *key: str) -> bool:
        if key in self.seen:
            return False
        self.seen.add(key)
        return True

    def _shows(self, record: str) -> bool:
        if self.stack:
            if record[0].isspace():
                return True  # a frame, or its source line
            ended, self.stack = self.stack, None
            if ended == "traceback":
                return True  # the exception's own line ends a traceback
        if record.startswith(TRACEBACK_START):
            self.stack = "traceback"
            return True
        if THREAD_STACK.match(record):
            self.stack = "threads"
            return True
        if record.startswith(("Fatal Python error", *CHAINED_EXCEPTION)) or STEP_OR_EVAL.search(record):
            return True
        if match := ABSL_RECORD.match(record) or NATIVE_RECORD.match(record):
            severity, where, message = match.groups()
            if severity == "I":  # a few landmarks; MaxText also logs some errors at INFO ("ERROR: ...")
                return message.startswith(INFO_SHOWN) or bool(SEVERITY_WORD.match(message))
            return self._once(severity, where, message)
        if match := PYTHON_WARNING.match(record):
            return self._once(match.group(1), match.group(2), match.group(3))
        if record[0].isspace():
            return False  # a Python warning's source line, a config dump's continuation
        return bool(SEVERITY_WORD.match(record) or EXCEPTION_LINE.match(record) or DEATH_WORDS.search(record))


def full_log_note(vm_name: str, log_path: str, log_uri: str | None) -> str:
    """Where the training's full log is: on the VM, and in storage once the training exits."""
    where = f"on VM {vm_name} at {log_path}"
    if log_uri:
        where += f", and at {log_uri} once the training exits"
    return (
        f"MaxText's full log (its config dump and start-up output too) is {where}; "
        "this log shows its step lines, evaluations, warnings and errors"
    )


def spec_full_log_note(spec) -> str:
    """full_log_note for `spec`'s training (a RunSpec)."""
    return full_log_note(spec.vm_name, f"{spec.work_dir}/maxtext-sft-runs/{spec.run_name}/train.log",
                         spec.training_log_uri)


def log_training_lines(log: Any, lines: list[str], shown: TrainingLogFilter | None = None) -> None:
    """What a person reads of the training's new log lines (`shown`: the filter of the watch, which
    remembers what it showed), and each step's loss. The failure's "--- tail" that
    training_status.sh adds is not new: the worker's failure message carries it."""
    shown = shown or TrainingLogFilter()
    end = next((i for i, line in enumerate(lines) if line.startswith(TAIL_MARKER)), len(lines))
    for record in shown.shown(lines[:end]):
        log.info("%s", record)
        if progress := STEP_LINE.search(record):
            log.info("training progress: step %s, loss %s", *progress.groups())


def prune_checkpoints(storage: Callable[[], Any], checkpoints_dir: str, kept: int, log: Any) -> None:
    """Keep the newest `kept` committed checkpoints in storage (`storage()` makes the storage
    hook), deleting older ones (MaxText 0.2.2's train_sft keeps every one:
    sizing.prunable_steps). A storage error only postpones it to the next check."""
    try:
        hook = storage()
        for step in prunable_steps(hook.committed_steps(checkpoints_dir), kept):
            deleted = hook.delete_folder(f"{checkpoints_dir}/{step}")
            log.info("Deleted checkpoint step %s (%s objects): checkpoints_kept=%s", step, deleted, kept)
    except Exception as error:  # noqa: BLE001 - housekeeping: the training is what is watched
        log.warning("Could not prune old checkpoints in %s this time: %s", checkpoints_dir, error)


class TrainingStatusTrigger(VmSshTrigger):
    """Poll training_status.sh on the VM every `poll_interval` (the first after `first_poll_after`)."""

    def __init__(
        self,
        *,
        command: str,
        run_name: str,
        stall_timeout_seconds: float,
        unreachable_deadline: float | None = None,
        checkpoints_dir: str | None = None,
        checkpoints_kept: int | None = None,
        full_log: str | None = None,
        **kwargs,  # VmSshTrigger's: where the VM is, how to log in, the polls' pace and deadline
    ):
        super().__init__(**kwargs)
        self.command = command
        self.run_name = run_name
        self.stall_timeout_seconds = float(stall_timeout_seconds)
        self.unreachable_deadline = None if unreachable_deadline is None else float(unreachable_deadline)
        self.checkpoints_dir = checkpoints_dir
        self.checkpoints_kept = checkpoints_kept
        self.full_log = full_log  # full_log_note's text, logged as the watch starts
        self.shown = TrainingLogFilter()

    def _kwargs(self) -> dict[str, Any]:
        return {
            **super()._kwargs(),
            "command": self.command,
            "run_name": self.run_name,
            "stall_timeout_seconds": self.stall_timeout_seconds,
            "unreachable_deadline": self.unreachable_deadline,
            "checkpoints_dir": self.checkpoints_dir,
            "checkpoints_kept": self.checkpoints_kept,
            "full_log": self.full_log,
        }

    async def _read(self) -> tuple[int, list[str]]:
        """One connection, one run of training_status.sh: its exit status and lines (stderr merged)."""
        import asyncssh

        await self._renew_os_login_key()
        async with await self._hook().get_conn() as conn:  # closed on leaving, a cancelled check's too
            # A byte that is not UTF-8 is replaced, as the workers' VmSSHHook reads lines: asyncssh's
            # strict decoding fails the read (no status line), and the lines of this check, which
            # the script's cursor has already passed, would never be logged.
            result = await conn.run(
                self.command, stderr=asyncssh.STDOUT, check=False, timeout=self.command_timeout,
                encoding="utf-8", errors="replace",
            )
        status = result.exit_status if result.exit_status is not None else -1
        return status, [line.rstrip("\r") for line in (result.stdout or "").splitlines()]

    def _refusal(self, error: BaseException) -> dict[str, str] | None:
        """The event of a check SSH refused: not the VM's host key, or its login; None for another error."""
        import asyncssh

        if isinstance(error, asyncssh.HostKeyNotVerifiable):
            message = (
                f"SSH host key of {self.host} is not one the VM {self.vm_name} published in its guest "
                f"attributes (hostkeys/): refusing to connect ({error})"
            )
            return {"status": "refused", "kind": "host_key", "message": message}
        if isinstance(error, asyncssh.PermissionDenied):
            return {"status": "refused", "kind": "login",
                    "message": f"{self.host} refused the SSH login with the connection's key: {error}"}
        return None

    def _prune(self) -> None:
        from maxtext_sft.cloud.storage import StorageEndpointHook

        prune_checkpoints(
            lambda: StorageEndpointHook(gcp_conn_id=self.gcp_conn_id), self.checkpoints_dir, self.checkpoints_kept, self.log
        )

    async def _watch(self) -> dict[str, Any]:
        """Poll until something needs the worker: the event's payload."""
        answered, last_step = False, None
        unreachable_deadline = self.unreachable_deadline
        pause = self.first_poll_after
        last_said, said_at = None, 0.0  # the status line is logged when it changes, else every few minutes
        if self.full_log:
            self.log.info("%s", self.full_log)
        while True:
            await asyncio.sleep(max(0.0, min(pause, self.deadline - time.time())))
            pause = self.poll_interval
            if time.time() >= self.deadline:
                return {"status": "timeout", "last_step": last_step, "answered": answered}
            try:
                status, output = await self._read()
            except unanswered_errors() as error:
                if refused := self._refusal(error):
                    return {**refused, "last_step": last_step, "answered": answered}
                text = error_text(error)
                self.log.warning("Could not check training on %s this time: %s", self.vm_name, text)
                if unreachable_deadline is None or time.time() >= unreachable_deadline or await self._vm_lost():
                    return {"status": "unreachable", "error": text, "last_step": last_step, "answered": answered}
                continue
            answered, unreachable_deadline = True, None
            ordered = status_last(output)
            if status != 0 or ordered is None:
                self.log.warning("training_status.sh gave no status (exit %s): %s", status, output[-5:])
                return {"status": "no_status", "exit_status": status, "output": output[-5:], "last_step": last_step,
                        "answered": True}
            fields = status_fields(ordered[-1])
            last_step = number(fields.get("last_step"))
            log_training_lines(self.log, ordered[:-1], self.shown)
            if needs_the_worker(fields, self.stall_timeout_seconds):
                return {"status": "training", "exit_status": status, "output": tail_for_the_worker(ordered),
                        "last_step": last_step, "answered": True}
            said = (fields.get("state"), fields.get("last_step"))
            if said != last_said or time.monotonic() - said_at >= STATUS_REPEAT_SECONDS:
                self.log.info(
                    "Training %s: state %s, last step %s, loss %s",
                    self.run_name, fields.get("state"), fields.get("last_step"), fields.get("last_loss"),
                )
                last_said, said_at = said, time.monotonic()
            if self.checkpoints_dir and self.checkpoints_kept is not None:
                await asyncio.to_thread(self._prune)


def training_watch_kwargs(spec) -> dict[str, Any]:
    """A TrainingStatusTrigger's arguments that say what to watch on `spec`'s VM (a RunSpec), beside
    vm_ssh_kwargs' where and how, and its deadlines."""
    from maxtext_sft.vm.steps import STEPS, remote_command

    return {
        "command": remote_command("training_status", spec),
        "command_timeout": STEPS["training_status"].timeout_seconds(spec),
        "run_name": spec.run_name,
        "stall_timeout_seconds": spec.stall_timeout_seconds,
        "checkpoints_dir": spec.checkpoints_dir if spec.durable and spec.checkpoints_kept is not None else None,
        "checkpoints_kept": spec.checkpoints_kept,
        "full_log": spec_full_log_note(spec),
    }


class TrainingStartTrigger(HeldEventTrigger):
    """A try's first watch of the training, with no worker before it: the scheduler starts it on the
    triggerer (wait_for_final_checkpoint's start_from_trigger), and Airflow 3.3's triggerer renders
    `spec`, a template of plan_run's XCom as JSON text, with the task's context. It reads the VM's
    SSH target from the Compute API (its address and published host keys, as the worker's check
    does: only those keys are accepted), then polls at once and every poke_interval_seconds as
    TrainingStatusTrigger, until training_timeout_hours from its start. Its event is that watch's
    with `watch_since` (epoch seconds: the try's timeout runs from it), or, when there is no SSH
    target (the VM gone or booting, the Compute API not answering, anything else raised reading it),
    {"status": "check", "error": ...}: the worker checks itself, as after any pause.

    It waits out no executor report: the scheduler deferred the try itself (vm/trigger_ssh.py)."""

    def __init__(self, *, spec: str | dict[str, Any], ssh_conn_id: str, gcp_conn_id: str, first_event_after: float = 0):
        super().__init__()
        self.spec = spec
        self.ssh_conn_id = ssh_conn_id
        self.gcp_conn_id = gcp_conn_id
        self.first_event_after = float(first_event_after)

    def _kwargs(self) -> dict[str, Any]:
        return {"spec": self.spec, "ssh_conn_id": self.ssh_conn_id, "gcp_conn_id": self.gcp_conn_id,
                "first_event_after": self.first_event_after}

    def run_spec(self):
        """The rendered spec as a RunSpec (JSON text; a dict where a template was not needed)."""
        from maxtext_sft.run.spec import RunSpec
        from maxtext_sft.cloud.trigger_start import from_json

        return RunSpec.from_dict(from_json(self.spec))

    async def _watch(self) -> dict[str, Any]:
        from maxtext_sft.vm.trigger_ssh import vm_ssh_kwargs
        from maxtext_sft.vm.access import ssh_target

        watch_since = time.time()
        spec = self.run_spec()
        try:
            target = await asyncio.to_thread(ssh_target, spec, self.gcp_conn_id, caller="triggerer")
        except Exception as error:  # noqa: BLE001 - the worker's check judges what this was
            self.log.warning("No SSH target for VM %s now (%s): the worker checks", spec.vm_name, error_text(error))
            return {"status": "check", "error": error_text(error), "last_step": None, "answered": False,
                    "watch_since": watch_since}
        watch = TrainingStatusTrigger(
            **vm_ssh_kwargs(spec, target, ssh_conn_id=self.ssh_conn_id, gcp_conn_id=self.gcp_conn_id,
                            poll_interval=spec.poke_interval_seconds, first_event_after=0),
            **training_watch_kwargs(spec),
            deadline=watch_since + spec.training_timeout_hours * 3600,
            first_poll_after=0,  # no check came before this one
        )
        self.log.info("Watching training %s on %s (%s) from the triggerer", spec.run_name, spec.vm_name, target["host"])
        return {**await watch._watch(), "watch_since": watch_since}


class SliceTrainingStatusTrigger(HeldEventTrigger):
    """A slice's training: TrainingStatusTrigger's watch of host 0, and at each poll (host 0's
    pace) every other host's training_status.sh (its status only: host 0's log is the
    training's) and every host's instance in the Compute API, until host 0's watch ends or a host
    needs the worker. `hosts`: each host's TrainingStatusTrigger arguments (plain values), in
    worker order (the deadline, the unreachable bound and the pruning are host 0's watch's alone);
    `instance_ids`: each host's instance id when the slice formed, by name.

    Event: {"host_0": TrainingStatusTrigger's event or None, "hosts": {vm_name: event}}: host 0's
    event when its watch ended, and the events of the hosts that need the worker:
      {"status": "training", "output": [...]}   another host's training died (training_status.sh's
          state=failed: exited non-zero, killed, or never started): the tail the worker names,
          the status line last
      {"status": "refused", "kind": "host_key" | "login", "message": ...}   as host 0's
      {"status": "lost", "state": ...}   the Compute API says the host (host 0 too) is gone,
          re-created by its group, or not RUNNING (slice_hosts.host_state)
    Another host that does not answer a poll is not a death: host 0's stall check still runs (a
    silent host stops every host's steps). The reads still under way when the event leaves are
    cancelled, their connections closed.
    """

    def __init__(self, *, hosts: list[dict[str, Any]], instance_ids: dict[str, str], first_event_after: float = 0):
        super().__init__()
        self.hosts = [dict(host) for host in hosts]
        self.instance_ids = dict(instance_ids)
        self.first_event_after = float(first_event_after)

    def _kwargs(self) -> dict[str, Any]:
        return {"hosts": self.hosts, "instance_ids": self.instance_ids, "first_event_after": self.first_event_after}

    async def _watch(self) -> dict[str, Any]:
        host_0 = TrainingStatusTrigger(**self.hosts[0])
        watches = {
            asyncio.ensure_future(host_0._watch()): "host_0",
            asyncio.ensure_future(self._watch_every_host(host_0)): "hosts",
        }
        event: dict[str, Any] = {"host_0": None, "hosts": {}}
        try:
            done, _ = await asyncio.wait(watches, return_when=asyncio.FIRST_COMPLETED)
            for watch in done:
                event[watches[watch]] = watch.result()
        finally:
            await cancel_all(watches)
        return event

    async def _watch_every_host(self, host_0: TrainingStatusTrigger) -> dict[str, dict[str, Any]]:
        """Every host's instance and every other host's training, at host 0's pace, until a host
        needs the worker: those hosts' events, by name."""
        others = [TrainingStatusTrigger(**host) for host in self.hosts[1:]]
        pause = host_0.first_poll_after
        while True:
            await asyncio.sleep(pause)
            pause = host_0.poll_interval
            states = await asyncio.gather(*(asyncio.to_thread(self._instance_state, host) for host in self.hosts))
            if lost := {host["vm_name"]: {"status": "lost", "state": state}
                        for host, state in zip(self.hosts, states) if state not in (None, "RUNNING")}:
                return lost
            events = await asyncio.gather(*(self._other_host(host) for host in others))
            if dead := {host.vm_name: event for host, event in zip(others, events) if event}:
                return dead

    def _instance_state(self, host: dict[str, Any]) -> str | None:
        """What the Compute API says of a host (slice_hosts.host_state); None when it could not be
        read this time (the next poll reads again). Blocking: run in a thread."""
        from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
        from maxtext_sft.vm.slice_hosts import host_state

        name = host["vm_name"]
        try:
            return host_state(ComputeEngineEndpointHook(gcp_conn_id=host["gcp_conn_id"]), vm_name=name,
                              zone=host["zone"], project_id=host["project_id"], instance_id=self.instance_ids.get(name, ""))
        except Exception as error:  # noqa: BLE001 - a read that fails says nothing about the host
            self.log.warning("Could not read the status of VM %s: %s", name, error)
            return None

    async def _other_host(self, host: TrainingStatusTrigger) -> dict[str, Any] | None:
        """Another host's event if it needs the worker (its training died, or SSH refused the
        check), else None: its training runs or ended on its own, or it did not answer this time."""
        try:
            _, output = await host._read()
        except unanswered_errors() as error:
            if refused := host._refusal(error):
                return refused
            self.log.warning("Could not check training on host %s this time: %s", host.vm_name, error_text(error))
            return None
        ordered = status_last(output)
        if ordered is None or not training_died(status_fields(ordered[-1])):
            return None
        return {"status": "training", "output": tail_for_the_worker(ordered)}
