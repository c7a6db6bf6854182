"""The trigger form in Airflow's UI, driven by headless Chromium: a user logs in, finds every Param
of maxtext_sft with its description in its section, triggers a run with a conf, and the run
succeeds. Screenshots land in test-artifacts/ (kept on failure too).

The selectors are Airflow 3.3's React UI (Chakra): `trigger-dag-button`, `config-form` and its
accordion items, `element_<param>` inputs, `trigger-dag-submit`, the grid's `data-run-id`."""

from __future__ import annotations

import contextlib
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
from maxtext_sft.params import pipeline_params
from tests.conftest import REPO
from tests.dags.conftest import wait_for_run_end, wait_until

pytestmark = pytest.mark.e2e

ARTIFACTS = REPO / "test-artifacts"
USER, PASSWORD = "admin", "trigger-form-password"
RUN_CONF = {**LOCAL_RUN_CONF, "steps": 10}
CHROMIUM_FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
    "--no-first-run", "--window-size=1400,1000",
    # Chromium's own calls home are refused by this closed network; these keep it from trying.
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
)
UI_TIMEOUT = 30  # seconds for the UI to show something (generous: the machine is shared)


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


def expected_sections(dag_params: dict) -> dict[str, dict[str, str]]:
    """{section: {param: description}} from the DAG's params as the REST API serves them."""
    sections: dict[str, dict[str, str]] = {}
    for name, param in dag_params.items():
        sections.setdefault(param["schema"]["section"], {})[name] = param["description"]
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


def shown_params(section) -> dict[str, str]:
    """{param: description} of the fields an open section shows (label's first line: the name)."""
    shown = {}
    for field in section.find_elements(By.CSS_SELECTOR, '[data-part="item-content"] [data-scope="field"][data-part="root"]'):
        label = field.find_element(By.CSS_SELECTOR, '[data-part="label"]')
        helpers = [h.text for h in field.find_elements(By.CSS_SELECTOR, '[data-part="helper-text"]') if h.is_displayed()]
        if label.is_displayed():
            shown[label.text.splitlines()[0].strip()] = helpers[0] if helpers else None
    return shown


def fill_param(section, name: str, value) -> None:
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise TypeError(f"{name}: only text and integer fields are typed into the form, not {value!r}")
    field = section.find_element(By.NAME, f"element_{name}")
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(str(value), Keys.TAB)  # number inputs take their value on blur
    assert field.get_attribute("value") == str(value), name


def log_in(driver, airflow) -> None:
    driver.get(f"{airflow.url}/dags/{airflow.dag_id}")
    wait = WebDriverWait(driver, UI_TIMEOUT)
    wait.until(EC.url_contains("/auth/login"))  # a user must log in: not every user is an admin
    wait.until(EC.visibility_of_element_located((By.NAME, "username"))).send_keys(USER)
    driver.find_element(By.NAME, "password").send_keys(PASSWORD)
    wait.until(EC.element_to_be_clickable((By.CSS_SELECTOR, 'button[type="submit"]'))).click()
    wait.until(EC.url_to_be(f"{airflow.url}/dags/{airflow.dag_id}"))


def test_the_trigger_form_shows_every_param_in_its_section_and_starts_a_run(start_airflow, local_cloud, tmp_path):
    airflow = start_airflow(users={USER: PASSWORD})
    with pytest.raises(AirflowError, match="403"):
        airflow.get("/auth/token", auth=False)  # no token without a password
    dag_params = airflow.get(f"/api/v2/dags/{airflow.dag_id}/details")["params"]
    assert set(dag_params) == set(pipeline_params())
    sections = expected_sections(dag_params)
    for name in ("trigger-form", "trigger-form-submitted", "trigger-form-failure"):
        for suffix in (".png", ".html"):
            (ARTIFACTS / f"{name}{suffix}").unlink(missing_ok=True)  # no stale picture from an earlier run

    with chromium(tmp_path / "chromium-profile") as driver:
        try:
            log_in(driver, airflow)
            wait = WebDriverWait(driver, UI_TIMEOUT)
            wait.until(EC.element_to_be_clickable((By.CSS_SELECTOR, '[data-testid="trigger-dag-button"]'))).click()
            wait.until(EC.visibility_of_element_located((By.CSS_SELECTOR, '[data-testid="config-form"]')))
            assert set(form_sections(driver)) == {*sections, "Advanced Options"}

            for title, params in sections.items():
                section = open_section(driver, title)
                assert shown_params(section) == params, title
                for name in params.keys() & RUN_CONF.keys():
                    fill_param(section, name, RUN_CONF[name])
            open_section(driver, "Advanced Options")  # the JSON conf the form will send, in the picture
            save_artifact(driver, "trigger-form")

            driver.find_element(By.CSS_SELECTOR, '[data-testid="trigger-dag-submit"]').click()
            # The toast first: it goes away after a few seconds.
            wait.until(EC.text_to_be_present_in_element((By.TAG_NAME, "body"), "Dag Run Triggered"))
            wait.until(EC.url_contains(f"/dags/{airflow.dag_id}/runs/"))
            run_id = urllib.parse.unquote(driver.current_url.rsplit("/runs/", 1)[1].split("?")[0])
            wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, f'[data-run-id="{run_id}"]')))  # in the grid
            save_artifact(driver, "trigger-form-submitted")
        except BaseException:
            save_artifact(driver, "trigger-form-failure")
            raise

    def started():
        run = airflow.run(run_id)
        return run if run["state"] in ("queued", "running") else None

    run = wait_until(started, 60, "the run to be queued or running")
    assert run["conf"].items() >= RUN_CONF.items()
    assert run["run_type"] == "manual"

    final = wait_for_run_end(airflow, run_id, timeout=420)
    states = airflow.task_states(run_id)
    assert final["state"] == "success", states
    assert set(states.values()) == {"success"}, states
    assert local_cloud.vms() == []
