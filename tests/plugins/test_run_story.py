"""What a finished run's note and notification say (maxtext_sft.results.story)."""

from __future__ import annotations

from maxtext_sft.results.story import failure_message, failure_note, run_url, short_error, success_note

PREFLIGHT = (
    "AirflowFailException: Preflight failed, no VM was created:\n"
    "reservation: reservation no-such-reservation in local-project/us-east5-b does not exist (Params reservation)"
)
VERDICT = (
    "AirflowFailException: The fine-tune did not complete (preflight=failed); the VM may still exist\n"
    f"Cause:\npreflight: {PREFLIGHT}"
)


def test_the_note_names_the_first_failed_task_and_its_error_not_the_verdict():
    note = failure_note([("preflight", PREFLIGHT), ("delete_vm", "SSHException: gone\nlog tail"),
                         ("check_run_outcome", VERDICT)])
    assert note == (
        "Failed at preflight: Preflight failed, no VM was created: reservation: reservation no-such-reservation "
        "in local-project/us-east5-b does not exist (Params reservation)\nAlso failed: delete_vm."
    )


def test_the_verdict_is_the_cause_only_when_nothing_else_failed():
    assert failure_note([("check_run_outcome", VERDICT)]).startswith(
        "Failed at check_run_outcome: The fine-tune did not complete (preflight=failed)"
    )
    assert failure_note([("wait_for_ssh", None)]) == "Failed at wait_for_ssh: no error was recorded (see the task's log)"
    assert failure_note([], "timed_out") == "Failed (timed_out): no task failed; the run was stopped or timed out."


def test_a_long_error_is_cut_and_a_note_fits_airflows_column():
    assert len(short_error("E: " + "x" * 5000)) == 300
    assert len(failure_note([(f"task_{n}", "E: " + "x" * 500) for n in range(200)])) == 1000
    assert short_error("ValueError: bad\n  File 'x.py', line 1") == "ValueError: bad"  # a log tail is left out


def test_the_success_note_says_steps_loss_and_where_the_model_went():
    summary = {"final_step": 20, "final_loss": 1.234567, "published": {"repo_id": "team/m", "branch": "main"},
               "outputs": {"hf_export": "gs://b/run/hf-export"}}
    assert success_note(summary) == "Succeeded: 20 steps, final loss 1.235, published to team/m@main, model at gs://b/run/hf-export."
    assert success_note({"final_step": 3, "final_loss": None, "published": None}) == "Succeeded: 3 steps, not published."
    assert success_note(None) == "Succeeded: not published."
    gated = {"final_step": 5, "eval_loss": {"base": 2.5, "tuned": 2.6},
             "published": {"published": False, "reason": "the tuned model's eval loss 2.6 is not below the base model's 2.5"}}
    assert success_note(gated) == (
        "Succeeded: 5 steps, eval loss 2.5 -> 2.6, not published: the tuned model's eval loss 2.6 is not below the "
        "base model's 2.5."
    )


def test_the_message_leads_with_the_cause_and_links_the_runs_page():
    url = run_url("http://airflow:8080/", "team_job", "manual__2026-11-02T00:00:00+00:00")
    assert url == "http://airflow:8080/dags/team_job/runs/manual__2026-11-02T00%3A00%3A00%2B00%3A00"
    subject, body = failure_message("team_job", "manual__x", url, [("preflight", PREFLIGHT), ("check_run_outcome", VERDICT)], "task_failure")
    assert subject.startswith("[team_job] Fine-tune run failed at preflight: Preflight failed, no VM was created: reservation")
    assert body.splitlines()[1:4] == ["DAG: team_job", "Run: manual__x", f"Run page: {url}"]
    assert body.endswith(VERDICT)
