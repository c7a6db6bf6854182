"""The Fine-tunes page (plugins/fine_tunes_plugin.py) in Airflow's UI, driven by headless Chromium,
and the task links, after runs of two fine-tune DAGs through the real scheduler: one of
maxtext_sft (its outputs in the bucket, published to the Hub) and two of the declared job (one
triggered, its outputs copied to the worker and not published; one started by its schedule, which
fails). The page lists them newest first, its job filter narrows the rows, every successful row's
loss plot loads; without a login the page sends the browser to the login page. The screenshots land in
test-artifacts/ (fine-tunes-page.png: the page in the UI's frame at 1600x1000)."""

from __future__ import annotations

import requests
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import Select, WebDriverWait

import pytest
from localcloud.connections import LOCAL_BUCKET, LOCAL_OUTPUTS_CONF, LOCAL_PROJECT, LOCAL_RUN_CONF
from tests.dags.conftest import wait_for_run_end, wait_until
from tests.dags.test_trigger_form import ARTIFACTS, PASSWORD, UI_TIMEOUT, USER, chromium, log_in, save_artifact

pytestmark = pytest.mark.e2e

JOB = "ultrachat_gemma3_nightly"  # include/jobs/ultrachat-gemma3-nightly.yaml
STEPS = 6


def rows_shown(driver) -> list[tuple[str, str]]:
    return [(row.get_attribute("data-dag-id"), row.get_attribute("data-run-id"))
            for row in driver.find_elements(By.CSS_SELECTOR, "#fine-tunes tbody tr[data-run-id]")]


def plots_loaded(driver) -> list[int]:
    """Each row's plot's natural width once every image has finished loading (0: it failed)."""
    WebDriverWait(driver, UI_TIMEOUT).until(lambda d: d.execute_script(
        "return [...document.querySelectorAll('img.loss')].every(img => img.complete)"))
    return driver.execute_script("return [...document.querySelectorAll('img.loss')].map(img => img.naturalWidth)")


def cell_text(driver, run_id: str, column: int) -> str:
    return driver.find_element(By.CSS_SELECTOR, f'tr[data-run-id="{run_id}"] td:nth-child({column})').text


def test_the_fine_tunes_page_lists_every_run_of_every_fine_tune_dag(start_airflow, local_cloud, tmp_path):
    airflow = start_airflow(users={USER: PASSWORD})
    for name in ("fine-tunes-page", "fine-tunes-page-filtered", "fine-tunes-page-failure"):
        for suffix in (".png", ".html"):
            (ARTIFACTS / f"{name}{suffix}").unlink(missing_ok=True)  # no stale picture from an earlier run

    # Every DAG fine_tune_dag builds carries the tag the page finds them by; the bake DAG does not.
    def tagged() -> set[str]:
        return {dag["dag_id"] for dag in airflow.get("/api/v2/dags?tags=fine-tune&limit=100")["dags"]}

    # start() waits for maxtext_sft's parse only; the dag-processor parses the other files after it.
    fine_tune_dags = {"maxtext_sft", "maxtext_sft_rehearsal", "maxtext_sft_slice", JOB}
    wait_until(lambda: fine_tune_dags <= tagged(), 120, "the other fine-tune DAGs to be parsed")
    assert tagged() == fine_tune_dags

    # Without a login the page sends the browser to log in; the plots answer 401.
    page = f"{airflow.url}/fine-tunes/"
    refused = requests.get(page, allow_redirects=False, timeout=30)
    assert refused.status_code == 303 and "/auth/login" in refused.headers["location"], refused.text[:300]
    assert requests.get(f"{page}loss.png", params={"dag_id": "maxtext_sft", "run_id": "x"}, timeout=30).status_code == 401

    local = {**LOCAL_RUN_CONF, "steps": STEPS}
    airflow.request("PATCH", f"/api/v2/dags/{JOB}?update_mask=is_paused", {"is_paused": False})
    published = airflow.trigger({**local, **LOCAL_OUTPUTS_CONF})
    # The job's file has no hub_repo_id; without an output location its outputs are copied to the worker.
    job_run = airflow.trigger({**local, "output_location": None}, dag_id=JOB)
    for dag_id, run_id in (("maxtext_sft", published), (JOB, job_run)):
        final = wait_for_run_end(airflow, run_id, timeout=600, dag_id=dag_id)
        assert final["state"] == "success", airflow.task_states(run_id, dag_id)
    # Unpausing the job also let its schedule start a run (it fails: the job's reservation is not in
    # the local cloud): the page lists it too, by when it was due. Every run, newest first:
    every_run = []
    for dag_id in ("maxtext_sft", JOB):
        for run in airflow.get(f"/api/v2/dags/{dag_id}/dagRuns?limit=100")["dag_runs"]:
            wait_for_run_end(airflow, run["dag_run_id"], timeout=300, dag_id=dag_id)
            every_run.append((run["run_after"], dag_id, run["dag_run_id"]))
    newest_first = [(dag_id, run_id) for _, dag_id, run_id in sorted(every_run, reverse=True)]
    assert [run for run in newest_first if run[1] in (published, job_run)] == [(JOB, job_run), ("maxtext_sft", published)]

    # The task links, as the API server serves them: from what each task returned.
    def links(task_id: str) -> dict:
        return airflow.get(f"/api/v2/dags/maxtext_sft/dagRuns/{published}/taskInstances/{task_id}/links")["extra_links"]

    vm_name = airflow.xcom(published, "create_vm")["name"]
    assert links("create_vm") == {"VM in Cloud console": (
        f"https://console.cloud.google.com/compute/instancesDetail/zones/{LOCAL_RUN_CONF.get('zone', 'us-east5-b')}"
        f"/instances/{vm_name}?project={LOCAL_PROJECT}")}
    record = airflow.xcom(published, "collect_outputs")
    run_folder = record["run_record"].removeprefix("gs://").rsplit("/", 1)[0]
    assert links("collect_outputs") == {
        "Run folder in Cloud console": f"https://console.cloud.google.com/storage/browser/{run_folder}"}
    commit = airflow.xcom(published, "publish_to_hub")
    hub_commit = f"https://huggingface.co/{commit['repo_id']}/commit/{commit['commit']}"
    assert links("publish_to_hub") == {"Hub commit": hub_commit}

    with chromium(tmp_path / "chromium-profile") as driver:
        driver.set_window_size(1600, 1000)
        try:
            log_in(driver, airflow)
            wait = WebDriverWait(driver, UI_TIMEOUT)
            # In the UI: the navigation's plugin page frames the app.
            driver.get(f"{airflow.url}/plugin/fine-tunes")
            frame = wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, 'iframe[title="Fine-tunes"]')))
            driver.switch_to.frame(frame)
            wait.until(lambda d: len(rows_shown(d)) == len(newest_first))
            assert rows_shown(driver) == newest_first
            assert [width > 0 for width in plots_loaded(driver)] == [True, True]  # the successful runs
            driver.switch_to.default_content()
            save_artifact(driver, "fine-tunes-page")

            # The app on its own: the cells, then the filter.
            driver.get(page)
            wait.until(lambda d: len(rows_shown(d)) == len(newest_first))
            assert cell_text(driver, published, 4) == f"{STEPS} of {STEPS}"
            assert cell_text(driver, published, 5) == f"{float(record['final_loss']):.4g}"
            evals = record["eval_loss"]
            assert cell_text(driver, published, 6) == f"{evals['base']:.4g} → {evals['tuned']:.4g}"
            assert "h, $" in cell_text(driver, published, 7)
            published_link = driver.find_element(By.CSS_SELECTOR, f'tr[data-run-id="{published}"] td:nth-child(8) a')
            assert published_link.get_attribute("href") == hub_commit
            output_links = {a.text: a.get_attribute("href") for a in driver.find_elements(
                By.CSS_SELECTOR, f'tr[data-run-id="{published}"] td:nth-child(9) a')}
            assert output_links["export"].startswith(f"https://console.cloud.google.com/storage/browser/{LOCAL_BUCKET}/")
            assert output_links["run in Airflow"].endswith(f"/dags/maxtext_sft/runs/{requests.utils.quote(published, safe='')}")
            assert cell_text(driver, job_run, 8) == "not published: hub_repo_id is not set"
            assert "run record: " in cell_text(driver, job_run, 9)  # on the worker: a path, no link
            job_links = driver.find_elements(By.CSS_SELECTOR, f'tr[data-run-id="{job_run}"] td:nth-child(9) a')
            assert [a.text for a in job_links] == ["run in Airflow"]  # the worker's paths are no links

            # The filter leaves the job's runs (the triggered one and the scheduled one), newest first.
            job_rows = [run for run in newest_first if run[0] == JOB]
            Select(driver.find_element(By.ID, "job-filter")).select_by_value(JOB)
            wait.until(lambda d: f"dag_id={JOB}" in d.current_url and len(rows_shown(d)) == len(job_rows))
            assert rows_shown(driver) == job_rows and len(job_rows) < len(newest_first)
            assert [width > 0 for width in plots_loaded(driver)] == [True]  # the scheduled run failed: no plot
            save_artifact(driver, "fine-tunes-page-filtered")
        except BaseException:
            save_artifact(driver, "fine-tunes-page-failure")
            raise
    assert local_cloud.vms() == []
