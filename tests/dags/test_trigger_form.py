"""The trigger form in Airflow's UI, driven by headless Chromium: a user logs in, finds every Param
of maxtext_sft under its title with its help text in its section, sees a field a run needs (the
zone) marked required and Trigger disabled while it is empty, triggers a run with a conf, and the
run succeeds; its graph shows the runbook's phases. A declared job's form shows the reservation
its file sets. Screenshots land in test-artifacts/ (kept on failure too).

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
from selenium import webdriver
from selenium.common.exceptions import ElementClickInterceptedException, StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

from localcloud.airflow_harness import AirflowError
from localcloud.connections import LOCAL_RUN_CONF
from maxtext_sft.run.dag_params import pipeline_params
from maxtext_sft.builders.pipeline import PHASES
from tests.conftest import REPO
from tests.dags.conftest import wait_for_run_end, wait_until

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
JOB_DAG_ID = "ultrachat_gemma3_nightly"  # a declared job whose file sets the reservation


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


def test_the_trigger_form_shows_every_param_requires_what_a_run_needs_and_starts_a_run(
    start_airflow, local_cloud, tmp_path
):
    airflow = start_airflow(users={USER: PASSWORD})
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
