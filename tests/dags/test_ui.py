"""Airflow's UI, driven by headless Chromium, on one Airflow whose user must log in.

The trigger form: a user logs in, finds every Param of maxtext_sft under its title with its help
text in its section, sees a field a run needs (the zone) marked required and Trigger disabled while
it is empty, triggers a run with a conf, and the run succeeds; its graph shows the runbook's
phases. A declared job's form shows the reservation its file sets.

The Fine-tunes page (plugins/fine_tunes_plugin.py) and the task links, after runs of two fine-tune
DAGs through the real scheduler: one of maxtext_sft (its outputs in the bucket, published to the
Hub) and two of the declared job (one triggered, its outputs copied to the worker and not
published; one started by its schedule, which fails), beside any other run of this Airflow (the
trigger form's). The page lists every run newest first, its job filter narrows the rows, every
successful row's loss plot loads, a failed run's row gives its cause in its note's words;
without a login the page sends the browser to the login page.

Screenshots land in test-artifacts/ (kept on failure too; fine-tunes-page.png: the page in the UI's
frame at 1600x1000).

The selectors are Airflow 3.3's React UI (Chakra): `trigger-dag-button`, `config-form` and its
accordion items, each field's root, label (the Param's title), required indicator, helper and
error text, `element_<param>` inputs, `trigger-dag-submit`, the grid's `data-run-id`, the graph
view's button (`value="graph"`) and its React Flow nodes."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import urllib.parse
from pathlib import Path

import pytest
import requests
from selenium import webdriver
from selenium.common.exceptions import ElementClickInterceptedException, StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import Select, WebDriverWait

from localcloud.airflow_harness import AirflowError
from localcloud.connections import LOCAL_BUCKET, LOCAL_OUTPUTS_CONF, LOCAL_PROJECT, LOCAL_RUN_CONF
from maxtext_sft.run.dag_params import pipeline_params
from maxtext_sft.builders.pipeline import PHASES
from tests.conftest import REPO
from tests.dags.conftest import module_airflow, wait_for_run_end, wait_until

pytestmark = pytest.mark.e2e

ARTIFACTS = REPO / "test-artifacts"
USER, PASSWORD = "admin", "trigger-form-password"
RUN_CONF = {**LOCAL_RUN_CONF, "steps": 10}
CHROMIUM_FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
    "--no-first-run", "--window-size=1600,1000",
    # Chromium's own calls home are refused by this closed network; these keep it from trying.
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
)
UI_TIMEOUT = 30  # seconds for the UI to show something (generous: the machine is shared)
REQUIRED = "This field is required"  # Airflow's message under an empty required field (English UI)
JOB_DAG_ID = "ultrachat_gemma3_nightly"  # include/jobs/ultrachat-gemma3-nightly.yaml: its file sets the reservation
PAGE_STEPS = 6  # the Fine-tunes page's runs


@pytest.fixture(scope="module")
def airflow(tmp_path_factory, pipeline_connections, postgres_server, migrated_database):
    """One Airflow for this file's tests, with a user who logs in (not every user is an admin):
    its start-up is paid once, and the Fine-tunes page lists the trigger form's run too."""
    with module_airflow(tmp_path_factory, pipeline_connections, postgres_server, migrated_database,
                        users={USER: PASSWORD}) as instance:
        yield instance


def _pids_with_argument(argument: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if argument.encode() in Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0"):
                    found.append(int(name))
            except OSError:
                pass
    return found


@contextlib.contextmanager
def chromium(profile: Path):
    """Headless Chromium through the system's chromedriver (Selenium Manager downloads nothing);
    quit at the end, and no process of its profile left."""
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path="/usr/bin/chromedriver"), options=options)
    chromedriver = driver.service.process
    try:
        yield driver
    finally:
        driver.quit()
        profile_flag = f"--user-data-dir={profile}"
        try:
            wait_until(lambda: not _pids_with_argument(profile_flag) and chromedriver.poll() is not None, 30,
                       "Chromium and chromedriver to exit")
        finally:
            for pid in _pids_with_argument(profile_flag):
                os.kill(pid, signal.SIGKILL)  # only what this test's browser left


def save_artifact(driver, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))
    (ARTIFACTS / f"{name}.html").write_text(driver.page_source)


@dataclasses.dataclass(frozen=True)
class Expected:
    """What the form should show for one Param, from the DAG's params as the REST API serves them."""

    name: str
    description: str
    required: bool  # Airflow's form marks a field required when its schema's type does not allow null


def expected_sections(dag_params: dict) -> dict[str, dict[str, Expected]]:
    """{section: {title: Expected}}: the form's labels are titles, mapped back to Param names here."""
    sections: dict[str, dict[str, Expected]] = {}
    for name, param in dag_params.items():
        schema = param["schema"]
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        title = schema["title"]
        fields = sections.setdefault(schema["section"], {})
        assert title not in fields, f"{name} and {fields[title].name} share the title {title!r}"
        fields[title] = Expected(name, param["description"], "null" not in types)
    return sections


def form_sections(driver) -> dict[str, object]:
    """The trigger form's accordion items by their titles."""
    items = driver.find_elements(By.CSS_SELECTOR, '[data-testid="config-form"] > [data-part="item"]')
    return {item.find_element(By.CSS_SELECTOR, '[data-part="item-trigger"]').text.strip(): item for item in items}


def open_section(driver, title: str):
    """Open one accordion item (the form keeps one open at a time) and wait until its fields show."""
    item = form_sections(driver)[title]
    trigger = item.find_element(By.CSS_SELECTOR, '[data-part="item-trigger"]')

    def opened(_driver):
        if item.get_attribute("data-state") == "closed":
            driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", trigger)
            trigger.click()
        content = item.find_element(By.CSS_SELECTOR, '[data-part="item-content"]')
        return item if item.get_attribute("data-state") == "open" and content.is_displayed() else False

    ignored = (ElementClickInterceptedException, StaleElementReferenceException)  # the previous item closing
    return WebDriverWait(driver, UI_TIMEOUT, ignored_exceptions=ignored).until(opened)


def _visible_texts(field, part: str) -> list[str]:
    return [e.text for e in field.find_elements(By.CSS_SELECTOR, f'[data-part="{part}"]') if e.is_displayed()]


@dataclasses.dataclass(frozen=True)
class ShownField:
    """One field as the form shows it."""

    help_text: str | None
    required: bool  # the label's required indicator
    errors: tuple[str, ...]  # the field's error messages


def shown_fields(section) -> dict[str, ShownField]:
    """{title: ShownField} of the fields an open section shows; the title is the label without
    its required indicator."""
    shown = {}
    for field in section.find_elements(By.CSS_SELECTOR, '[data-part="item-content"] [data-scope="field"][data-part="root"]'):
        label = field.find_element(By.CSS_SELECTOR, '[data-part="label"]')
        if not label.is_displayed():
            continue
        # Chakra's Field.RequiredIndicator: an asterisk in the label, which is data-required.
        indicators = label.find_elements(By.CSS_SELECTOR, ".chakra-field__requiredIndicator")
        title = label.text
        for indicator in indicators:
            title = title.strip().removesuffix(indicator.text)
        required = bool(indicators) and label.get_attribute("data-required") is not None
        helpers = _visible_texts(field, "helper-text")
        shown[title.strip()] = ShownField(helpers[0] if helpers else None, required, tuple(_visible_texts(field, "error-text")))
    return shown


def field_of(section, name: str):
    return section.find_element(By.NAME, f"element_{name}")


def fill_param(section, name: str, value) -> None:
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise TypeError(f"{name}: only text and integer fields are typed into the form, not {value!r}")
    field = field_of(section, name)
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(str(value), Keys.TAB)  # number inputs take their value on blur
    assert field.get_attribute("value") == str(value), name


def empty_param(section, name: str) -> None:
    field = field_of(section, name)
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(Keys.BACKSPACE, Keys.TAB)
    assert field.get_attribute("value") == "", name


def submit_button(driver):
    return driver.find_element(By.CSS_SELECTOR, '[data-testid="trigger-dag-submit"]')


def wait_for_trigger_enabled(driver, enabled: bool) -> None:
    WebDriverWait(driver, UI_TIMEOUT).until(lambda d: submit_button(d).is_enabled() == enabled)


def open_trigger_form(driver, airflow, dag_id: str) -> None:
    wait = WebDriverWait(driver, UI_TIMEOUT)
    if not driver.current_url.endswith(f"/dags/{dag_id}"):
        driver.get(f"{airflow.url}/dags/{dag_id}")
    wait.until(EC.element_to_be_clickable((By.CSS_SELECTOR, '[data-testid="trigger-dag-button"]'))).click()
    wait.until(EC.visibility_of_element_located((By.CSS_SELECTOR, '[data-testid="config-form"]')))


def check_a_required_field(driver, section, name: str, title: str, value: str) -> None:
    """A field a run needs, emptied: marked required with Airflow's message and Trigger disabled
    (a screenshot of that); filled again, both clear."""
    def state():
        return shown_fields(section)[title], submit_button(driver).is_enabled()

    shown, enabled = state()
    assert shown.required and shown.errors == () and enabled, (shown, enabled)
    empty_param(section, name)
    wait_for_trigger_enabled(driver, False)
    shown, _ = state()
    assert shown.required and shown.errors == (REQUIRED,), shown
    save_artifact(driver, "trigger-form-required")
    fill_param(section, name, value)
    wait_for_trigger_enabled(driver, True)
    assert shown_fields(section)[title].errors == ()


def check_declared_job_form(driver, airflow, job_params: dict) -> None:
    """A declared job's form opens with its file's reservation filled in: not in error, and
    Trigger enabled (nothing is submitted: the job stays paused)."""
    open_trigger_form(driver, airflow, JOB_DAG_ID)
    reservation = job_params["reservation"]
    section = open_section(driver, reservation["schema"]["section"])
    assert field_of(section, "reservation").get_attribute("value") == reservation["value"]
    shown = shown_fields(section)[reservation["schema"]["title"]]
    assert not shown.required and shown.errors == (), shown  # needed only with the capacity 'reservation'
    wait_for_trigger_enabled(driver, True)
    save_artifact(driver, "trigger-form-declared-job")


def check_graph_view(driver, airflow, run_id: str) -> None:
    """The run's graph shows the task groups of the runbook's phases by name."""
    driver.get(f"{airflow.url}/dags/{airflow.dag_id}/runs/{urllib.parse.quote(run_id)}")
    wait = WebDriverWait(driver, UI_TIMEOUT, ignored_exceptions=(StaleElementReferenceException,))
    wait.until(EC.element_to_be_clickable((By.CSS_SELECTOR, 'button[value="graph"]'))).click()

    def phases_shown(_driver):
        nodes = driver.find_elements(By.CSS_SELECTOR, ".react-flow__node")
        first_lines = {node.text.strip().splitlines()[0] for node in nodes if node.text.strip()}
        return first_lines if set(PHASES) <= first_lines else False

    wait.until(phases_shown)
    save_artifact(driver, "graph-view")


def log_in(driver, airflow) -> None:
    driver.get(f"{airflow.url}/dags/{airflow.dag_id}")
    wait = WebDriverWait(driver, UI_TIMEOUT)
    wait.until(EC.url_contains("/auth/login"))  # a user must log in: not every user is an admin
    wait.until(EC.visibility_of_element_located((By.NAME, "username"))).send_keys(USER)
    driver.find_element(By.NAME, "password").send_keys(PASSWORD)
    wait.until(EC.element_to_be_clickable((By.CSS_SELECTOR, 'button[type="submit"]'))).click()
    wait.until(EC.url_to_be(f"{airflow.url}/dags/{airflow.dag_id}"))


def test_the_trigger_form_shows_every_param_requires_what_a_run_needs_and_starts_a_run(airflow, local_cloud, tmp_path):
    with pytest.raises(AirflowError, match="403"):
        airflow.get("/auth/token", auth=False)  # no token without a password
    dag_params = airflow.get(f"/api/v2/dags/{airflow.dag_id}/details")["params"]
    assert set(dag_params) == set(pipeline_params())
    sections = expected_sections(dag_params)
    zone_section, zone_title = (dag_params["zone"]["schema"][key] for key in ("section", "title"))
    assert sections[zone_section][zone_title].required
    # The reservation may be left empty (another capacity type); the capacity is chosen from a list.
    reservation_title = dag_params["reservation"]["schema"]["title"]
    assert not sections[dag_params["reservation"]["schema"]["section"]][reservation_title].required
    assert dag_params["capacity"]["schema"]["enum"] == ["reservation", "flex-start", "spot", "on-demand"]
    # Outside the form the same schema refuses a run without a zone when it is created.
    with pytest.raises(AirflowError, match="400.*zone"):
        airflow.trigger({**RUN_CONF, "zone": None})
    job_params = wait_until(
        lambda: airflow.get(f"/api/v2/dags/{JOB_DAG_ID}/details", missing_ok=True), 120, f"{JOB_DAG_ID} to be parsed"
    )["params"]
    for name in ("trigger-form", "trigger-form-required", "trigger-form-declared-job", "trigger-form-submitted",
                 "trigger-form-failure", "graph-view"):
        for suffix in (".png", ".html"):
            (ARTIFACTS / f"{name}{suffix}").unlink(missing_ok=True)  # no stale picture from an earlier run

    with chromium(tmp_path / "chromium-profile") as driver:
        try:
            log_in(driver, airflow)
            open_trigger_form(driver, airflow, airflow.dag_id)
            assert set(form_sections(driver)) == {*sections, "Advanced Options"}
            wait_for_trigger_enabled(driver, True)  # every field a run needs has a default

            for title, expected in sections.items():
                section = open_section(driver, title)
                shown = shown_fields(section)
                assert {t: f.help_text for t, f in shown.items()} == {t: e.description for t, e in expected.items()}, title
                assert {t: f.required for t, f in shown.items()} == {t: e.required for t, e in expected.items()}, title
                if title == zone_section:
                    check_a_required_field(driver, section, "zone", zone_title, RUN_CONF.get("zone", "us-east5-b"))
                for param in expected.values():
                    if param.name in RUN_CONF:
                        fill_param(section, param.name, RUN_CONF[param.name])
                assert all(not f.errors for f in shown_fields(section).values()), title
            wait_for_trigger_enabled(driver, True)
            open_section(driver, "Advanced Options")  # the JSON conf the form will send, in the picture
            save_artifact(driver, "trigger-form")

            submit_button(driver).click()
            wait = WebDriverWait(driver, UI_TIMEOUT)
            # The form opens the new run's page once the API has created it. Not the "Dag Run Triggered"
            # toast: it is gone after a few seconds, and a busy machine's browser missed it (CI at 534bb45).
            wait.until(EC.url_contains(f"/dags/{airflow.dag_id}/runs/"))
            run_id = urllib.parse.unquote(driver.current_url.rsplit("/runs/", 1)[1].split("?")[0])
            wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, f'[data-run-id="{run_id}"]')))  # in the grid
            save_artifact(driver, "trigger-form-submitted")

            def started():
                run = airflow.run(run_id)
                return run if run["state"] in ("queued", "running") else None

            run = wait_until(started, 60, "the run to be queued or running")
            assert run["conf"].items() >= RUN_CONF.items()
            assert run["run_type"] == "manual"

            check_declared_job_form(driver, airflow, job_params)  # while the run runs

            final = wait_for_run_end(airflow, run_id, timeout=420)
            states = airflow.task_states(run_id)
            assert final["state"] == "success", states
            assert set(states.values()) == {"success"}, states
            # The run's note (the run-notes listener, set as the scheduler ended the run) says how it went.
            summary = airflow.xcom(run_id, "summarize_run")
            evals = summary["eval_loss"]
            assert final["note"].startswith(
                f"Succeeded: {RUN_CONF['steps']} steps, final loss {float(summary['final_loss']):.4g}, "
                f"eval loss {evals['base']:.4g} -> {evals['tuned']:.4g}, not published: hub_repo_id is not set"
            ), final["note"]
            check_graph_view(driver, airflow, run_id)
        except BaseException:
            save_artifact(driver, "trigger-form-failure")
            raise
    assert local_cloud.vms() == []


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


def test_the_fine_tunes_page_lists_every_run_of_every_fine_tune_dag(airflow, local_cloud, tmp_path):
    for name in ("fine-tunes-page", "fine-tunes-page-filtered", "fine-tunes-page-failure"):
        for suffix in (".png", ".html"):
            (ARTIFACTS / f"{name}{suffix}").unlink(missing_ok=True)  # no stale picture from an earlier run

    # Every DAG fine_tune_dag builds carries the tag the page finds them by; the bake DAG does not.
    def tagged() -> set[str]:
        return {dag["dag_id"] for dag in airflow.get("/api/v2/dags?tags=fine-tune&limit=100")["dags"]}

    # start() waits for maxtext_sft's parse only; the dag-processor parses the other files after it.
    fine_tune_dags = {"maxtext_sft", "maxtext_sft_rehearsal", "maxtext_sft_slice", JOB_DAG_ID}
    wait_until(lambda: fine_tune_dags <= tagged(), 120, "the other fine-tune DAGs to be parsed")
    assert tagged() == fine_tune_dags

    # Without a login the page sends the browser to log in; the plots answer 401.
    page = f"{airflow.url}/fine-tunes/"
    refused = requests.get(page, allow_redirects=False, timeout=30)
    assert refused.status_code == 303 and "/auth/login" in refused.headers["location"], refused.text[:300]
    assert requests.get(f"{page}loss.png", params={"dag_id": "maxtext_sft", "run_id": "x"}, timeout=30).status_code == 401

    local = {**LOCAL_RUN_CONF, "steps": PAGE_STEPS}
    airflow.request("PATCH", f"/api/v2/dags/{JOB_DAG_ID}?update_mask=is_paused", {"is_paused": False})
    published = airflow.trigger({**local, **LOCAL_OUTPUTS_CONF})
    # The job's file has no hub_repo_id; without an output location its outputs are copied to the worker.
    job_run = airflow.trigger({**local, "output_location": None}, dag_id=JOB_DAG_ID)
    for dag_id, run_id in (("maxtext_sft", published), (JOB_DAG_ID, job_run)):
        final = wait_for_run_end(airflow, run_id, timeout=600, dag_id=dag_id)
        assert final["state"] == "success", airflow.task_states(run_id, dag_id)
    # Unpausing the job also let its schedule start a run (it fails: the job's reservation is not in
    # the local cloud): the page lists it too, by when it was due. Every run (this Airflow's other
    # runs too: the trigger form's), newest first:
    every_run, succeeded = [], set()
    for dag_id in ("maxtext_sft", JOB_DAG_ID):
        for run in airflow.get(f"/api/v2/dags/{dag_id}/dagRuns?limit=100")["dag_runs"]:
            if wait_for_run_end(airflow, run["dag_run_id"], timeout=300, dag_id=dag_id)["state"] == "success":
                succeeded.add(run["dag_run_id"])
            every_run.append((run["run_after"], dag_id, run["dag_run_id"]))
    newest_first = [(dag_id, run_id) for _, dag_id, run_id in sorted(every_run, reverse=True)]
    assert [run for run in newest_first if run[1] in (published, job_run)] == [(JOB_DAG_ID, job_run), ("maxtext_sft", published)]

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
            assert [width > 0 for width in plots_loaded(driver)] == [True] * len(succeeded)  # the successful runs
            driver.switch_to.default_content()
            save_artifact(driver, "fine-tunes-page")

            # The app on its own: the cells, then the filter.
            driver.get(page)
            wait.until(lambda d: len(rows_shown(d)) == len(newest_first))
            assert cell_text(driver, published, 4) == f"{PAGE_STEPS} of {PAGE_STEPS}"
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
            job_rows = [run for run in newest_first if run[0] == JOB_DAG_ID]
            Select(driver.find_element(By.ID, "job-filter")).select_by_value(JOB_DAG_ID)
            wait.until(lambda d: f"dag_id={JOB_DAG_ID}" in d.current_url and len(rows_shown(d)) == len(job_rows))
            assert rows_shown(driver) == job_rows and len(job_rows) < len(newest_first)
            assert [width > 0 for width in plots_loaded(driver)] == [True]  # the scheduled run failed: no plot
            # The failed run says why, in the words of the note its failure listener wrote.
            [scheduled] = [run_id for _, run_id in job_rows if run_id != job_run]
            note = airflow.get(f"/api/v2/dags/{JOB_DAG_ID}/dagRuns/{requests.utils.quote(scheduled, safe='')}")["note"]
            assert note and note.startswith("Failed at "), note
            cause = driver.find_element(By.CSS_SELECTOR, f'tr[data-run-id="{scheduled}"] .cause').text
            assert cause == note.strip(), (cause, note)
            assert not driver.find_elements(By.CSS_SELECTOR, f'tr[data-run-id="{job_run}"] .cause')
            save_artifact(driver, "fine-tunes-page-filtered")
        except BaseException:
            save_artifact(driver, "fine-tunes-page-failure")
            raise
    assert local_cloud.vms() == []
