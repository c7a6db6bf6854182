"""The extra links of the pipeline's tasks: buttons on a task instance's page in Airflow's UI.

Airflow 3 computes an operator's links in the task process when the task ends (task_runner's
finalize calls get_link and stores the URL as the XCom `_link_<class name>`); the API server
shows that stored URL. So each link here derives from the return value its task already pushed,
never from values known at parse time; a task that returned nothing gets no link ("").
The plugin (plugins/fine_tunes_plugin.py) registers them too, as Airflow's docs ask.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from airflow.sdk import BaseOperatorLink
from maxtext_sft.results.fine_tunes import hub_commit_url, published_commit, run_folder_uri, storage_folder_console_url, vm_console_url

# An instance's selfLink (the API's selfLink, or self_link as Instance.to_dict spells it).
INSTANCE_LINK = re.compile(r"/projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/instances/(?P<name>[^/?]+)$")
ZONE_LINK = re.compile(r"/projects/(?P<project>[^/]+)/zones/(?P<zone>[^/?]+)$")


def _return_value(ti_key) -> Any:
    from airflow.sdk.execution_time.xcom import XCom  # imported when used: the plugin is loaded everywhere

    return XCom.get_value(ti_key=ti_key, key="return_value")


def instance_console_url(instance: Any) -> str:
    """create_vm's return value (the instance as a dict) -> the VM's page in the console, or ""."""
    if not isinstance(instance, Mapping):
        return ""
    self_link = instance.get("self_link") or instance.get("selfLink") or ""
    if match := INSTANCE_LINK.search(self_link):
        return vm_console_url(match["project"], match["zone"], match["name"])
    if (match := ZONE_LINK.search(instance.get("zone") or "")) and instance.get("name"):
        return vm_console_url(match["project"], match["zone"], instance["name"])
    return ""


def outputs_console_url(record: Any) -> str:
    """collect_outputs' run record -> its run folder in the console, or "" when it is not in gs://."""
    return storage_folder_console_url(run_folder_uri(record if isinstance(record, Mapping) else None)) or ""


def published_commit_url(published: Any) -> str:
    """publish_to_hub's return value -> the Hub commit it made (or found), or "" when none."""
    commit = published_commit(published if isinstance(published, Mapping) else None)
    return (hub_commit_url(*commit) or "") if commit else ""


class VmConsoleLink(BaseOperatorLink):
    name = "VM in Cloud console"

    def get_link(self, operator, *, ti_key) -> str:
        return instance_console_url(_return_value(ti_key))


class RunFolderConsoleLink(BaseOperatorLink):
    name = "Run folder in Cloud console"

    def get_link(self, operator, *, ti_key) -> str:
        return outputs_console_url(_return_value(ti_key))


class HubCommitLink(BaseOperatorLink):
    name = "Hub commit"

    def get_link(self, operator, *, ti_key) -> str:
        return published_commit_url(_return_value(ti_key))
