"""What the training task's log shows of MaxText's log (vm/training_watch.py, TrainingLogFilter),
on a real one: tests/fixtures/maxtext-0.2.2-train.log is MaxText 0.2.2's train.log as
start_training.sh keeps it on a VM of the local cloud (the real image, at toy size, on CPU) after
a failed start and a restart: the first run died loading a checkpoint that was not there (its
traceback), the second trained 5 steps with an evaluation before the first and after the last.
Trimmed: each run's config dump cut to its first 25 lines (of 723), and Orbax's lines about the
checkpoints of steps 2 to 4; the first run's home folder renamed /home/maxtext."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path

from maxtext_sft.vm.training_watch import (
    TrainingLogFilter,
    TrainingStatusTrigger,
    full_log_note,
    log_training_lines,
)

LOG = Path(__file__).resolve().parents[1] / "fixtures" / "maxtext-0.2.2-train.log"


def fixture_lines() -> list[str]:
    """The log's lines as training_status.sh prints them: \\n-separated, tqdm's \\r kept."""
    return log_text().split("\n")


def log_text() -> str:
    with LOG.open(encoding="utf-8", newline="") as log:  # no newline translation: a \r stays
        return log.read()


def test_the_fixture_is_what_it_says():
    text = log_text()
    assert text.count("Config param ") == 50
    assert text.count("Traceback (most recent call last):") == 2
    assert text.count("\r") > 0 and text.count("completed step: ") == 5
    assert text.count("FutureWarning: ") > 20


def test_the_config_dump_and_start_up_noise_stay_out():
    shown = TrainingLogFilter().shown(fixture_lines())
    assert not [line for line in shown if "Config param" in line]
    for noise in ("oneDNN custom operations", "cpu_feature_guard", "[transformers]", "orbax", "Training: ",
                  "warnings.warn(", "Per train step", "System Information"):
        assert not [line for line in shown if noise in line], noise
    assert len(shown) < len(fixture_lines()) / 8


def test_steps_and_evaluations_are_shown_once_each_without_the_progress_bar():
    shown = TrainingLogFilter().shown(fixture_lines())
    steps = [line for line in shown if "completed step: " in line]
    # A step line that followed tqdm's bar on the same line is shown from its own record on.
    assert all(re.match(r"I1205 \S+ \d+ metric_logger.py:196\] completed step: \d+, ", line) for line in steps), steps
    assert [int(re.search(r"completed step: (\d+)", line).group(1)) for line in steps] == [1, 2, 3, 4, 5]
    evals = [re.search(r"eval metrics after step: (\d+), loss=([0-9.]+)", line) for line in shown]
    assert [(m.group(1), m.group(2)) for m in evals if m] == [("0", "12.470"), ("5", "12.407")]
    assert sum("Running evaluation on train step" in line for line in shown) == 2
    assert sum("Train loop finished in" in line for line in shown) == 1


def test_warnings_and_errors_are_shown_once_each():
    shown = TrainingLogFilter().shown(fixture_lines())
    # ~40 of these in the log, from each process (the trainer, the data loader's workers), one
    # module named in each: one place, one category, shown once.
    assert sum("_python_version_support.py:273: FutureWarning" in line for line in shown) == 1
    assert sum("RuntimeWarning: kwargs are not supported in scan" in line for line in shown) == 1
    assert sum("UserWarning: resource_tracker" in line for line in shown) == 1
    # absl/glog's W and E lines (C++ ones too), once per message.
    assert sum("failed call to cuInit" in line for line in shown) == 1
    assert sum("PackAndBatchOperation is deprecated" in line for line in shown) == 1
    assert sum("pyconfig.py:100] No config file provided" in line for line in shown) == 1
    assert any(line.startswith("E1205") and "google_auth_provider.cc" in line for line in shown)
    # MaxText logs this error at INFO.
    assert any("] ERROR: No valid Orbax checkpoint found" in line for line in shown)


def test_a_traceback_is_shown_whole_with_its_chained_exception():
    lines = fixture_lines()
    shown = TrainingLogFilter().shown(lines)
    start = lines.index("Traceback (most recent call last):")
    end = next(i for i, line in enumerate(lines) if line.startswith("ValueError: Checkpoint loading failed"))
    expected = [line for line in lines[start : end + 1] if line]  # the blank lines between the two aside
    at = shown.index(expected[0])
    assert shown[at : at + len(expected)] == expected
    assert "The above exception was the direct cause of the following exception:" in expected


def test_a_traceback_split_across_two_polls_stays_whole():
    lines = fixture_lines()
    start = lines.index("Traceback (most recent call last):")
    end = next(i for i, line in enumerate(lines) if line.startswith("ValueError: Checkpoint loading failed"))
    cut = start + 9  # within the second traceback's frames
    shown = TrainingLogFilter()
    both = shown.shown(lines[:cut]) + shown.shown(lines[cut:])
    assert both == TrainingLogFilter().shown(lines)
    assert lines[end] in both and lines[cut] in both


def test_a_crash_in_native_code_shows_its_thread_stacks():
    # PYTHONFAULTHANDLER=1 (start_training.sh): what Python 3.11 printed for a segmentation fault.
    crash = [
        "I1205 21:51:51.129091 140475398304448 metric_logger.py:196] completed step: 1, seconds: 33.310, loss: 12.447",
        "Fatal Python error: Segmentation fault",
        "",
        "Thread 0x00007f1c2effd6c0 (most recent call first):",
        '  File "/usr/lib/python3.11/threading.py", line 327 in wait',
        "",
        "Current thread 0x00007f1ce984eb80 (most recent call first):",
        '  File "/usr/lib/python3.11/ctypes/__init__.py", line 519 in string_at',
        '  File "<string>", line 1 in <module>',
        "I1205 21:51:52.000000 140475398304448 orbax.py:1] not shown",
    ]
    assert TrainingLogFilter().shown(crash) == [line for line in crash[:-1] if line]


def test_the_pipelines_own_warnings_and_a_dead_process_are_shown():
    lines = [
        "WARNING: could not copy the metrics to gs://b/run/training-metrics.jsonl (see /home/x/metrics.upload.log)",
        "/home/maxtext/maxtext_venv/bin/python3: No module named maxtext.trainers.post_train.sft.train_sft",
        "bash: line 3:   812 Killed                  python3 -m maxtext.trainers.post_train.sft.train_sft",
        "jaxlib._jax.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2G.",
        "Some other line",
        "  indented continuation",
    ]
    assert TrainingLogFilter().shown(lines) == lines[:4]


class Recorder(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def recorded_logger(name: str) -> tuple[logging.Logger, Recorder]:
    log = logging.getLogger(f"test_training_log.{name}")
    log.propagate = False
    recorder = Recorder()
    log.handlers[:] = [recorder]
    log.setLevel(logging.INFO)
    return log, recorder


def test_log_training_lines_logs_each_step_once_with_its_loss_and_not_the_failures_tail():
    log, recorder = recorded_logger("tail")
    lines = fixture_lines()
    step_5 = next(line for line in lines if "completed step: 5," in line)
    log_training_lines(log, [*lines, "--- tail of /home/maxtext/maxtext-sft-runs/r/train.log", step_5])
    progress = [line for line in recorder.lines if line.startswith("training progress: ")]
    assert progress == [f"training progress: step {n}, loss {loss}"
                        for n, loss in enumerate(["12.447", "12.474", "12.394", "12.414", "12.409"], 1)]
    assert not [line for line in recorder.lines if line.startswith("--- tail")]


def test_the_status_trigger_names_the_full_log_first_then_shows_the_filtered_lines():
    """Its watch, with the SSH read replaced by the fixture's lines and a status line."""

    class Canned(TrainingStatusTrigger):
        async def _read(self):
            return 0, [*fixture_lines(), "MAXTEXT_SFT_STATUS state=succeeded exit_code=0 last_step=5 last_loss=12.409 "
                       "out_of_data=no idle_seconds=1"]

    note = full_log_note("vm-1", "~/maxtext-sft-runs/run-1/train.log", "gs://bucket/runs/run-1/training.log")
    trigger = Canned(
        command="bash training_status.sh", run_name="run-1", stall_timeout_seconds=900, full_log=note,
        ssh_conn_id="ssh", host="127.0.0.2", host_keys={}, vm_name="vm-1", project_id="p", zone="z",
        gcp_conn_id="gcp", poll_interval=1, deadline=time.time() + 60, first_poll_after=0,
    )
    trigger._log, recorder = recorded_logger("trigger")  # LoggingMixin's logger
    event = asyncio.run(trigger._watch())
    assert event["status"] == "training" and event["last_step"] == 5
    assert recorder.lines[0] == note
    assert "at ~/maxtext-sft-runs/run-1/train.log" in note and "gs://bucket/runs/run-1/training.log" in note
    first_step = next(i for i, line in enumerate(recorder.lines) if "completed step: " in line)
    assert first_step < 50
    assert not [line for line in recorder.lines if "Config param" in line]
    assert TrainingStatusTrigger(**trigger.serialize()[1]).full_log == note


def test_the_status_line_is_logged_when_it_changes_not_at_every_poll():
    status = "MAXTEXT_SFT_STATUS state={} exit_code={} last_step={} last_loss={} out_of_data=no idle_seconds=1"
    polls = [[status.format("running", "none", "none", "none")]] * 3 + [
        ["I1205 21:51:51.129091 1 metric_logger.py:196] completed step: 1, seconds: 33.310, loss: 12.447",
         status.format("running", "none", 1, 12.447)],
        [status.format("running", "none", 1, 12.447)],
        [status.format("succeeded", 0, 1, 12.447)],
    ]

    class Canned(TrainingStatusTrigger):
        async def _read(self):
            return 0, polls.pop(0)

    trigger = Canned(
        command="bash training_status.sh", run_name="run-1", stall_timeout_seconds=900,
        ssh_conn_id="ssh", host="127.0.0.2", host_keys={}, vm_name="vm-1", project_id="p", zone="z",
        gcp_conn_id="gcp", poll_interval=0, deadline=time.time() + 60, first_poll_after=0,
    )
    trigger._log, recorder = recorded_logger("status")
    assert asyncio.run(trigger._watch())["last_step"] == 1
    assert [line for line in recorder.lines if line.startswith("Training run-1:")] == [
        "Training run-1: state running, last step none, loss none",
        "Training run-1: state running, last step 1, loss 12.447",
    ]
