"""`make run` and its DAG= (localcloud/run_pipeline.py): which DAG, which MaxText and which run conf
a command line makes, without running it (tests/dags/test_pipeline_slice.py runs the slice DAG, and
tests/dags/test_pipeline_real_maxtext.py what `make run` runs)."""

from __future__ import annotations

import subprocess

import pytest

from localcloud.connections import LOCAL_RUN_CONF, LOCAL_SLICE_CONF, LOCAL_SLICE_HOSTS, LOCAL_SLICE_MACHINE_TYPE
from localcloud.compute.first_boot import FirstBoot
from localcloud.run_pipeline import lifecycle_request, parse_args, run_conf
from tests.conftest import REPO


def test_the_slice_dag_runs_on_the_stand_in_with_its_reservation_and_an_output_location():
    args = parse_args(["--dag", "maxtext_sft_slice", "--conf", '{"steps": 6}'])
    assert (args.dag, args.maxtext, args.rehearsal) == ("maxtext_sft_slice", "fast", False)
    conf = run_conf(args, real_image=None)
    assert conf == {**LOCAL_RUN_CONF, **LOCAL_SLICE_CONF, "steps": 6}
    assert conf["reservation"] != LOCAL_RUN_CONF["reservation"]  # run_pipeline adds the slice's own
    assert conf["output_location"].startswith("gs://")


def test_the_slice_conf_is_a_valid_v6e_16_of_the_reservations_machines():
    from tests.plugins.test_slice_spec import make_slice_spec

    spec = make_slice_spec(**run_conf(parse_args(["--dag", "maxtext_sft_slice"]), real_image=None))
    assert (spec.hosts, spec.tpu["machine_type"]) == (LOCAL_SLICE_HOSTS, LOCAL_SLICE_MACHINE_TYPE)
    assert spec.reservation == LOCAL_SLICE_CONF["reservation"]


def test_the_slice_refuses_the_real_maxtext(capsys):
    with pytest.raises(SystemExit) as refused:
        parse_args(["--dag", "maxtext_sft_slice", "--maxtext", "real"])
    assert refused.value.code == 2
    assert "runs with --maxtext fast" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "dag", "maxtext"),
    [
        ([], "maxtext_sft", "real"),
        (["--maxtext", "fast"], "maxtext_sft", "fast"),
        (["--rehearsal"], "maxtext_sft_rehearsal", "real"),
        (["--dag", "maxtext_sft_rehearsal", "--maxtext", "fast"], "maxtext_sft_rehearsal", "fast"),
    ],
)
def test_the_other_dags_default_to_the_real_maxtext(argv, dag, maxtext):
    args = parse_args(argv)
    assert (args.dag, args.maxtext, args.rehearsal) == (dag, maxtext, dag == "maxtext_sft_rehearsal")


def test_make_runs_vms_go_through_a_first_boot_unless_told_not_to(capsys):
    assert parse_args([]).first_boot == FirstBoot(cloud_init_seconds=60, dpkg_lock_seconds=180)
    assert parse_args(["--first-boot", "0,0"]).first_boot == FirstBoot()
    with pytest.raises(SystemExit):
        parse_args(["--first-boot", "60"])
    assert "--first-boot takes CLOUD_INIT_S,DPKG_LOCK_S" in capsys.readouterr().err


@pytest.mark.parametrize("conf", ["[1]", "{steps: 3}"])
def test_a_conf_that_is_not_a_json_object_is_refused(conf):
    with pytest.raises(SystemExit):
        parse_args(["--conf", conf])


def test_make_run_passes_dag_and_installs_only_sshd_and_sudo():
    """What `make run DAG=maxtext_sft_slice` would run (make -n prints, runs nothing)."""
    printed = subprocess.run(["make", "-n", "run", "DAG=maxtext_sft_slice"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout
    assert "-m localcloud.run_pipeline --dag maxtext_sft_slice  --conf '{}'" in printed
    assert "for deb in openssh-server sudo; do" in printed  # not the test suite's PostgreSQL, Redis, Chromium
    printed = subprocess.run(["make", "-n", "run", "MAXTEXT=fast"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout
    assert "-m localcloud.run_pipeline --dag maxtext_sft --maxtext fast --conf '{}'" in printed


def test_the_lifecycle_is_inserts_and_deletes_of_machines_and_slice_resources():
    zone = "/compute/v1/projects/p/zones/z"
    assert lifecycle_request("POST", f"{zone}/instances")
    assert lifecycle_request("DELETE", f"{zone}/instances/vm-1")
    assert lifecycle_request("POST", f"{zone}/instanceGroupManagers")
    assert lifecycle_request("POST", "/compute/v1/projects/p/global/instanceTemplates")
    assert lifecycle_request("DELETE", "/compute/v1/projects/p/regions/r/resourcePolicies/pol")
    assert not lifecycle_request("POST", f"{zone}/instanceGroupManagers/g/listManagedInstances")
    assert not lifecycle_request("POST", f"{zone}/instances/vm-1/setMetadata")
    assert not lifecycle_request("GET", f"{zone}/instances/vm-1")
    assert not lifecycle_request("POST", "/compute/v1/projects/p/zones/z/reservations")


class ScriptedAirflow:
    """The REST reads Progress makes, answered from a script of looks: (task states, training log)."""

    def __init__(self, looks):
        self.looks = list(looks)
        self.log_reads = 0

    def run(self, run_id, dag_id=None):
        return {"state": "success" if len(self.looks) == 1 else "running"}

    def task_instances(self, run_id, dag_id=None):
        states, self.log = self.looks.pop(0)
        return [{"task_id": task, "state": state, "try_number": 1, "duration": 1.5, "start_date": str(n)}
                for n, (task, state) in enumerate(states.items())]

    def task_log(self, run_id, task_id, try_number=1, dag_id=None, missing_ok=False):
        self.log_reads += 1
        return [{"event": line} for line in self.log]


def test_progress_prints_each_state_change_and_the_trainings_lines_once(capsys, monkeypatch):
    from localcloud import run_pipeline

    now = [0.0]
    monkeypatch.setattr(run_pipeline.time, "monotonic", lambda: now[0])
    step = "I1205 21:51:51.129091 1 metric_logger.py:196] completed step: 1, seconds: 33.310, loss: 12.447"
    progress_line = "training progress: step 1, loss 12.447"
    deferred = {"plan_run": "success", "wait_for_final_checkpoint": "deferred"}
    airflow = ScriptedAirflow([
        ({"plan_run": "running", "wait_for_final_checkpoint": None}, []),
        (deferred, ["Config param x: 1"]),
        (deferred, ["Config param x: 1"]),  # nothing new for 30 s
        (deferred, ["Config param x: 1", step, progress_line]),
        ({"plan_run": "success", "wait_for_final_checkpoint": "success"},
         ["Config param x: 1", step, progress_line, "eval metrics after step: 1, loss=12.4"]),
    ])
    progress = run_pipeline.Progress(airflow, started=0)
    for at in (0, 11, 45, 56):
        now[0] = at
        progress.poll("run", "maxtext_sft")
    now[0] = 58  # the training's log was read 2 s ago: read again because the task ended
    assert progress.poll("run", "maxtext_sft")["state"] == "success"
    printed = [line.split(" s  ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert printed == [
        "plan_run: running",
        "plan_run: success (1.5 s)",
        "wait_for_final_checkpoint: deferred",
        "still under way: wait_for_final_checkpoint (deferred)",
        "wait_for_final_checkpoint: training progress: step 1, loss 12.447",
        "wait_for_final_checkpoint: eval metrics after step: 1, loss=12.4",
        "wait_for_final_checkpoint: success (1.5 s)",
    ]
    assert airflow.log_reads == 4
    airflow.looks.append(({"wait_for_final_checkpoint": "success"}, []))
    now[0] = 100
    progress.poll("run", "maxtext_sft")  # an ended try's log is read once
    assert airflow.log_reads == 4
