"""The janitor: delete this package's VMs whose DAG run is over, or whose lifetime has passed.

A backstop for when a run's own teardown could not run (the scheduler died, a worker was lost,
a run was deleted). It only ever looks at instances labelled `managed-by=airflow-maxtext-sft`;
an instance without that label is never touched. Two ways to run it:

- the DAG `maxtext_sft_janitor` (dags/maxtext_sft_janitor.py), every few minutes, asking
  Airflow about runs through the Task SDK;
- a command for cron or Cloud Scheduler, which works while Airflow is down:

      python -m maxtext_sft.tasks.janitor --project P [--airflow-url URL [--airflow-login FILE]] [--dry-run]

  With `--airflow-url` it asks the REST API about runs, with the token in AIRFLOW_API_TOKEN or
  one it gets from Airflow's `POST /auth/token` with the login in FILE (JSON: username,
  password); without it, or when the API does not answer, only the expiry label (`expires-at`,
  set at create time) decides.
  Credentials and a private API endpoint come from the Airflow connection
  `google_cloud_default` given as AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT (or `--gcp-conn-id`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from maxtext_sft.cloud.instances import EXPIRY_LABEL
from maxtext_sft.run.names import PACKAGE_LABEL
from maxtext_sft.run.slice_body import SLICE_GROUP_KEY

log = logging.getLogger(__name__)

LIVE_RUN_STATES = frozenset({"queued", "running"})
# A run state that could not be learnt (Airflow unreachable): the run may be alive.
UNKNOWN = "unknown"


@dataclass(frozen=True)
class Condemned:
    name: str
    zone: str
    reason: str
    dag_id: str | None = None  # the run the VM was created for, when its metadata says
    run_id: str | None = None
    group: str | None = None  # a slice's host: its managed instance group, deleted instead


def _metadata(instance: dict) -> dict[str, str]:
    return {item["key"]: item.get("value", "") for item in instance.get("metadata", {}).get("items", [])}


def condemned(instances: Iterable[dict], run_state: Callable[[str, str], str | None], now: float) -> list[Condemned]:
    """Which of `instances` (REST-shaped dicts) to delete, and why.

    `run_state(dag_id, run_id)` returns the run's state, None when the run does not exist, or
    UNKNOWN when Airflow cannot say.
    """
    doomed = []
    for instance in instances:
        labels = instance.get("labels") or {}
        if labels.get("managed-by") != PACKAGE_LABEL:
            continue  # not ours: never touched
        name, zone = instance["name"], instance["zone"].rsplit("/", 1)[-1]
        metadata = _metadata(instance)
        dag_id, run_id = metadata.get("airflow-dag-id"), metadata.get("airflow-run-id")
        ids = {"dag_id": dag_id, "run_id": run_id, "group": metadata.get(SLICE_GROUP_KEY)}
        expires = labels.get(EXPIRY_LABEL, "")
        if expires.isdigit() and now > int(expires):
            ended = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(expires)))
            doomed.append(Condemned(name, zone, f"its lifetime ended at {ended}", **ids))
            continue
        if not dag_id or not run_id:
            continue  # ours, but we cannot tell its run: only its lifetime can condemn it
        state = run_state(dag_id, run_id)
        state = getattr(state, "value", state)  # tolerate a DagRunState enum
        if state is None:
            doomed.append(Condemned(name, zone, f"its DAG run {dag_id}/{run_id} no longer exists", **ids))
        elif state != UNKNOWN and state not in LIVE_RUN_STATES:
            doomed.append(Condemned(name, zone, f"its DAG run {dag_id}/{run_id} is {state}", **ids))
    return doomed


def list_instances(hook, project_id: str) -> list[dict]:
    """Every instance of the package in the project, all zones (REST-shaped dicts)."""
    from google.cloud.compute_v1.types import Instance

    client = hook.get_compute_instance_client()
    found = []
    request = {"project": project_id, "filter": f'labels.managed-by = "{PACKAGE_LABEL}"'}
    for _, scoped in client.aggregated_list(request=request):
        found.extend(Instance.to_dict(instance) for instance in scoped.instances)
    return found


def sweep(hook, project_id: str, run_state: Callable[[str, str], str | None], *, dry_run: bool = False) -> list[Condemned]:
    """Delete the condemned instances (404 = already gone); return what was deleted and why."""
    from google.api_core.exceptions import NotFound

    doomed = condemned(list_instances(hook, project_id), run_state, time.time())
    groups_deleted: set[tuple[str, str]] = set()
    for vm in doomed:
        what = f"the slice {vm.group} of host {vm.name}" if vm.group else vm.name
        if dry_run:
            log.warning("would delete %s (%s): %s", what, vm.zone, vm.reason)
            continue
        if vm.group:
            if (vm.zone, vm.group) not in groups_deleted:
                log.warning("deleting %s (%s): %s", what, vm.zone, vm.reason)
                delete_slice(hook, project_id, vm.zone, vm.group)
                groups_deleted.add((vm.zone, vm.group))
            continue
        log.warning("deleting %s (%s): %s", what, vm.zone, vm.reason)
        try:
            hook.delete_instance(resource_id=vm.name, zone=vm.zone, project_id=project_id, request_id=None)
        except NotFound:
            log.info("%s was already gone", vm.name)
    if not doomed:
        log.info("no VM to delete")
    return doomed


def delete_slice(hook, project_id: str, zone: str, group: str) -> None:
    """Delete a slice's group (and with it its hosts), then the template and the workload policy
    it names (Compute Engine keeps both while the group uses them); what is gone is skipped."""
    from google.api_core.exceptions import NotFound

    try:
        manager = hook.get_instance_group_manager(resource_id=group, zone=zone, project_id=project_id)
    except NotFound:
        log.info("group %s was already gone", group)
        return
    hook.delete_instance_group_manager(resource_id=group, zone=zone, project_id=project_id)
    try:
        hook.delete_instance_template(resource_id=manager.instance_template.rsplit("/", 1)[-1], project_id=project_id)
    except NotFound:
        pass
    policy = manager.resource_policies.workload_policy  # projects/P/regions/R/resourcePolicies/NAME
    if policy:
        parts = policy.split("/")
        hook.delete_resource_policy(name=parts[-1], region=parts[parts.index("regions") + 1], project_id=project_id)


def rest_api_run_state(base_url: str, token: str | None) -> Callable[[str, str], str | None]:
    """run_state via Airflow's REST API; UNKNOWN when it does not answer."""

    def run_state(dag_id: str, run_id: str) -> str | None:
        quote = urllib.parse.quote
        request = urllib.request.Request(f"{base_url.rstrip('/')}/api/v2/dags/{quote(dag_id)}/dagRuns/{quote(run_id, safe='')}")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.load(response)["state"]
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            log.warning("Airflow API answered %s for %s/%s: keeping its VM", error.code, dag_id, run_id)
        except OSError as error:
            log.warning("Airflow API unreachable (%s): only lifetimes decide", error)
        return UNKNOWN

    return run_state


def login_token(base_url: str, login_file: str) -> str | None:
    """A token from Airflow's `POST /auth/token` (the simple and FAB auth managers) for the login
    in `login_file`; None, logged, when Airflow refuses it or does not answer (then only lifetimes
    and a token from the environment decide). The password is read from the file, never argv."""
    with open(login_file, "rb") as login:
        body = login.read()
    request = urllib.request.Request(f"{base_url.rstrip('/')}/auth/token", data=body,
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)["access_token"]
    except urllib.error.HTTPError as error:
        log.warning("Airflow refused the login in %s (%s): its API answers without a token", login_file, error.code)
    except OSError as error:
        log.warning("Airflow API unreachable (%s): only lifetimes decide", error)
    return None


def main(argv: list[str] | None = None) -> int:
    import os

    parser = argparse.ArgumentParser(prog="python -m maxtext_sft.tasks.janitor", description=__doc__.splitlines()[0])
    parser.add_argument("--project", required=True)
    parser.add_argument("--gcp-conn-id", default="google_cloud_default")
    parser.add_argument("--airflow-url", help="Airflow's base URL for the REST API (token: AIRFLOW_API_TOKEN)")
    parser.add_argument("--airflow-login", metavar="FILE",
                        help='a JSON file {"username": ..., "password": ...}: the token from POST /auth/token instead')
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.airflow_login and not args.airflow_url:
        parser.error("--airflow-login needs --airflow-url")
    from maxtext_sft.cloud.compute import ComputeEngineEndpointHook

    # After Airflow's import set up its own logging: this command logs plainly to stderr.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", force=True)

    if args.airflow_url:
        token = os.environ.get("AIRFLOW_API_TOKEN")
        if args.airflow_login:
            token = login_token(args.airflow_url, args.airflow_login) or token
        run_state = rest_api_run_state(args.airflow_url, token)
    else:
        run_state = lambda dag_id, run_id: UNKNOWN  # noqa: E731 - Airflow not asked: lifetimes decide
    deleted = sweep(ComputeEngineEndpointHook(gcp_conn_id=args.gcp_conn_id), args.project, run_state, dry_run=args.dry_run)
    print(json.dumps([vm.__dict__ for vm in deleted]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
