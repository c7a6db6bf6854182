"""What the steps on a multi-host slice's hosts share (SliceScriptOperator, the slice sensors): like `gcloud compute ssh --worker=all`, a step runs on
every host at once (install, training) or on host 0 only (conversion, export: they read and write
the output location, which every host shares).

A slice's lost host is not recovered, unlike a single VM (VmScriptOperator makes it again): the
hosts' JAX processes form one program, so one host gone ends the training on all of them, and a
new host would need the whole slice restarted. The task fails naming the host; the teardown
deletes the group, and clearing the run trains again on a new slice.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from google.api_core.exceptions import NotFound

from airflow.sdk.exceptions import AirflowException, AirflowFailException
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.run.spec import RunSpec

NOT_RECOVERED = "a slice's lost host is not recovered: the run fails and its teardown deletes the group"


class HostLog:
    """A task log whose lines name the host they come from (several hosts write at once)."""

    def __init__(self, log: Any, host: str):
        self._log, self._host = log, host

    def __getattr__(self, level: str):
        method = getattr(self._log, level)
        return lambda message, *args, **kwargs: method(f"[{self._host}] {message}", *args, **kwargs)


def host_state(hook: ComputeEngineEndpointHook, *, vm_name: str, zone: str, project_id: str, instance_id: str) -> str:
    """What the Compute API says of a slice's host: its status (RUNNING while it trains), or that it
    is gone: deleted, or deleted and re-created by its group under the same name (another
    instance than `instance_id`, the one the slice formed with: a blank disk, no training)."""
    try:
        instance = hook.get_instance(resource_id=vm_name, zone=zone, project_id=project_id)
    except NotFound:
        return "gone (deleted outside this run's teardown)"
    if instance_id and str(instance.id) != instance_id:
        return f"gone: deleted outside this run's teardown, and re-created by its group as instance {instance.id}"
    return instance.status


def check_hosts_running(specs: list[RunSpec], gcp_conn_id: str) -> None:
    """Fail, naming the host, unless every one of them is RUNNING and still the instance the slice
    formed with (`host_state`)."""
    hook = ComputeEngineEndpointHook(gcp_conn_id=gcp_conn_id)
    for spec in specs:
        status = host_state(hook, vm_name=spec.vm_name, zone=spec.zone, project_id=spec.project_id, instance_id=spec.host_id)
        if status != "RUNNING":
            raise AirflowFailException(f"Host {spec.host_index} ({spec.vm_name}) of slice {spec.group_name} is {status}: {NOT_RECOVERED}")


def on_every_host(specs: list[RunSpec], work, what: str) -> list:
    """`work(spec)` on every host at once; the results in worker order. Every host's failure is
    named (not only the first), after all of them ended."""
    from maxtext_sft.vm.access import pinned_record  # imported when used: access imports this module's neighbours

    pinned_record()  # read in the task's own thread, for the hosts' threads (vm.access)
    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        futures = [pool.submit(work, spec) for spec in specs]
        outcomes = []
        for spec, future in zip(specs, futures):
            try:
                outcomes.append((spec, future.result(), None))
            except Exception as error:  # noqa: BLE001 - collected, raised below with every host's
                outcomes.append((spec, None, error))
    failed = [(spec, error) for spec, _, error in outcomes if error is not None]
    if failed:
        causes = "\n".join(f"host {spec.host_index} ({spec.vm_name}): {error}" for spec, error in failed)
        fatal = any(isinstance(error, AirflowFailException) for _, error in failed)
        raise (AirflowFailException if fatal else AirflowException)(
            f"{what} failed on {len(failed)} of {len(specs)} hosts:\n{causes}"
        )
    return [result for _, result, _ in outcomes]
