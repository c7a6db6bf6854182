"""The rehearsal switch: its VM differs from the real run's in the named fields only; its Params;
its checks from the tasks' states and XComs."""

from __future__ import annotations

import pytest

from maxtext_sft.run.compute_body import REHEARSAL_FIELDS
from maxtext_sft.results.rehearsal import CHECKS, FAILED, NOT_RUN, PASSED, SKIPPED, rehearsal_checks
from maxtext_sft.results.summary import FAILURE_KEY, render_checks
from maxtext_sft.run.params import REHEARSAL_PARAMS, SpecError
from maxtext_sft.run.spec import RunSpec, build_run_spec
from tests.plugins.test_spec import RUN_ID, STARTED

CONF = {
    "reservation": "my-reservation",
    "output_location": "gs://team-bucket/sft",
    "hub_repo_id": "team/gemma3-sft",
    "service_account": "trainer@my-project.iam.gserviceaccount.com",
    "os_login": True,
}


def spec_for(conf: dict, *, rehearsal: bool) -> RunSpec:
    # The same DAG and run identity for both, so that only the switch can make them differ.
    return build_run_spec(
        conf,
        dag_id="maxtext_sft",
        run_id=RUN_ID,
        generation=0,
        started=STARTED,
        default_project_id="my-project",
        ssh_user="maxtext",
        ssh_public_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample",
        rehearsal=rehearsal,
    )


def differences(real, other, path: str = "") -> list[str]:
    """The paths (REHEARSAL_FIELDS' notation) at which two JSON values differ."""
    if isinstance(real, dict) and isinstance(other, dict):
        return [d for key in sorted(set(real) | set(other))
                for d in differences(real.get(key), other.get(key), f"{path}.{key}" if path else key)]
    if isinstance(real, list) and isinstance(other, list) and len(real) == len(other):
        return [d for i, (a, b) in enumerate(zip(real, other)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if real == other else [path]


@pytest.mark.parametrize("conf", [CONF, {"reservation": "r1"}, {**CONF, "use_internal_ip": True, "os_login": False}])
def test_the_rehearsal_sends_the_real_insert_body_but_for_the_switched_fields(conf):
    real = spec_for(conf, rehearsal=False).instance_body()
    rehearsal = spec_for(conf, rehearsal=True).instance_body()
    found = differences(real, rehearsal)
    # Each difference lies in one of the switched fields, and each switched field differs.
    under = {d: [f for f in REHEARSAL_FIELDS if d == f or d.startswith(f + ".")] for d in found}
    assert all(under.values()), {d: f for d, f in under.items() if not f}
    assert {f for fields in under.values() for f in fields} == set(REHEARSAL_FIELDS)
    assert rehearsal["machine_type"].endswith("/machineTypes/e2-standard-8")
    assert rehearsal["scheduling"]["provisioning_model"] == "STANDARD"
    assert rehearsal["reservation_affinity"] == {"consume_reservation_type": "NO_RESERVATION"}
    assert "/ubuntu-os-cloud/" in rehearsal["disks"][0]["initialize_params"]["source_image"]
    # What makes it safe to leave alone: it still deletes itself at the end of its lifetime.
    assert rehearsal["scheduling"]["instance_termination_action"] == "DELETE"
    assert rehearsal["scheduling"]["max_run_duration"] == real["scheduling"]["max_run_duration"]


def test_a_rehearsal_reads_the_reservation_but_does_not_gate_on_it():
    rehearsal, real = spec_for(CONF, rehearsal=True), spec_for(CONF, rehearsal=False)
    assert (rehearsal.reservation, rehearsal.consumed_reservation) == ("my-reservation", None)
    assert real.consumed_reservation == "my-reservation"
    # The spec survives XCom as a rehearsal's, and a real run's stays one.
    assert RunSpec.from_dict(rehearsal.to_dict()).rehearsal and not RunSpec.from_dict(real.to_dict()).rehearsal


def test_the_real_dag_refuses_the_rehearsals_params():
    with pytest.raises(SpecError, match="rehearsal_machine_type"):
        spec_for({**CONF, "rehearsal_machine_type": "e2-standard-4"}, rehearsal=False)
    assert spec_for({**CONF, "rehearsal_machine_type": "e2-standard-4"}, rehearsal=True).instance_body()[
        "machine_type"].endswith("/e2-standard-4")
    assert {p.name for p in REHEARSAL_PARAMS} == {
        "rehearsal_machine_type", "rehearsal_image_project", "rehearsal_image_family"}


ALL_TASKS = {task for check in CHECKS for task in check.tasks}


def checks(states: dict, xcoms: dict | None = None, *, spec: dict | None = None, left: str | None = ""):
    xcoms = xcoms or {}
    return {
        row["check"]: (row["result"], row["detail"])
        for row in rehearsal_checks(
            states=states,
            xcom=lambda task_id, key: xcoms.get((task_id, key)),
            spec=spec if spec is not None else {**CONF, "vm_name": "vm-1", "zone": "us-east5-b"},
            instance_left=left,
        )
    }


def test_every_check_of_a_good_rehearsal_passes_with_what_it_saw():
    found = checks(
        dict.fromkeys(ALL_TASKS, "success"),
        {
            ("check_vm_access", None): {"bucket": "ok: wrote a probe", "model": "ok: read config.json",
                                        "dataset": "ok: read the file"},
            ("preflight", None): ["reservation: exists"],
            ("publish_to_hub", None): {"repo_id": "team/gemma3-sft", "commit": "abc"},
        },
    )
    assert {result for result, _ in found.values()} == {PASSED}
    assert found["bucket from the VM"][1] == "ok: wrote a probe"
    assert found["hub from the VM"][1] == "ok: read config.json; ok: read the file"
    assert found["hub publish"][1] == "team/gemma3-sft at commit abc"
    assert "OS Login" in found["ssh"][1]


def test_a_failed_task_fails_its_check_with_its_error_and_the_rest_did_not_run():
    states = {**dict.fromkeys(ALL_TASKS, "upstream_failed"), "plan_run": "success", "preflight": "success",
              "create_vm": "failed", "delete_vm": "success"}
    found = checks(states, {("create_vm", FAILURE_KEY): "AirflowFailException: permission denied (forbidden: "
                                                      "Required 'compute.instances.create' permission)\nmore"})
    assert found["compute insert"][0] == FAILED
    assert "compute.instances.create" in found["compute insert"][1]
    assert found["ssh"][0] == found["maxtext at toy size"][0] == NOT_RUN
    assert found["delete"][0] == PASSED


def test_what_was_not_asked_is_skipped_and_a_vm_left_behind_fails_the_delete():
    found = checks(dict.fromkeys(ALL_TASKS, "success"), spec={"reservation": "r", "vm_name": "vm-1"}, left="RUNNING")
    assert found["bucket from the VM"][0] == found["hub publish"][0] == SKIPPED
    assert found["delete"] == (FAILED, "the instance is still there after the delete (status RUNNING)")
    lines = render_checks(rehearsal_checks(
        states={}, xcom=lambda *_: None, spec={}, instance_left=None))
    assert lines[0] == "Rehearsal checks:" and len(lines) == 1 + len(CHECKS)
