"""Compute Engine hook whose API endpoint can be set on the Google connection.

The provider's `ComputeEngineHook` always talks to compute.googleapis.com. A deployment that
uses a private endpoint (Private Service Connect, a regional endpoint, a proxy), and the local
cloud in tests, set the connection extra `compute_api_endpoint` in gcloud's format for
`api_endpoint_overrides/compute`, e.g. `https://compute-myendpoint.p.googleapis.com/compute/v1/`.
"""

from __future__ import annotations

import base64
import binascii
import json
import threading
import time
from functools import cached_property

from google.api_core.client_options import ClientOptions
from googleapiclient.discovery import build_from_document
from googleapiclient.errors import HttpError

from airflow.providers.google.cloud.hooks.compute import (
    TIME_TO_SLEEP_IN_SECONDS,
    ComputeEngineHook,
    GceOperationStatus,
)
from maxtext_sft.cloud.errors import OperationFailed
from maxtext_sft.cloud.endpoints import endpoint_override

API_PATH = "compute/v1/"
# Host key types a VM's guest agent publishes under the guest attributes' hostkeys/ namespace.
HOST_KEY_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ssh-rsa")


def reservation_owner(reservation: str, project_id: str) -> tuple[str, str]:
    """(owner project, name) of a reservation Param: a bare name is the run's project's; the path
    projects/OWNER/reservations/NAME (what a shared reservation is consumed by) names its owner."""
    owner, sep, name = reservation.removeprefix("projects/").partition("/reservations/")
    return (owner, name) if reservation.startswith("projects/") and sep else (project_id, reservation)


def reservation_counts(reservation: dict) -> tuple[int, int]:
    """(count, inUseCount) of a specific reservation resource (REST JSON)."""
    specific = reservation.get("specificReservation") or {}
    # int64 fields arrive as JSON strings.
    return int(specific.get("count", 0)), int(specific.get("inUseCount", 0))


def _metadata_value(resource: dict, key: str) -> str | None:
    """A metadata item's value of an instance (or project, as {"metadata": ...}), or None."""
    for item in (resource.get("metadata") or {}).get("items") or []:
        if item.get("key") == key:
            return item.get("value", "")
    return None


_parsed_documents = threading.local()


def compute_discovery_document(api_version: str) -> dict:
    """The Compute API's discovery document that googleapiclient ships, parsed once per thread.

    `build()` reads and parses the 5 MB document anew for every client (measured: 70 ms of CPU),
    and a task or trigger makes a client per hook, several per poll. Per thread, because the
    client library writes into a document's method descriptions as it builds their methods.
    """
    documents = _parsed_documents.__dict__
    if api_version not in documents:
        # Imported here, as googleapiclient itself does: a DAG file's parse imports this module.
        from googleapiclient.discovery_cache import get_static_doc

        text = get_static_doc("compute", api_version)
        if text is None:
            raise ValueError(f"googleapiclient ships no discovery document for compute {api_version}")
        documents[api_version] = json.loads(text)
    return documents[api_version]


def endpoint_hook_for(operator) -> ComputeEngineEndpointHook:
    """The hook for one of the provider's Compute Engine operators, from its own settings."""
    return ComputeEngineEndpointHook(
        gcp_conn_id=operator.gcp_conn_id,
        api_version=operator.api_version,
        impersonation_chain=operator.impersonation_chain,
    )


class ComputeEngineEndpointHook(ComputeEngineHook):
    """`ComputeEngineHook` that honours the connection extra `compute_api_endpoint`.

    The hook uses two clients: google-cloud-compute (insert, get, delete), whose endpoint is the
    host root, and the discovery client (operations, metadata, addresses), whose endpoint is the
    full `.../compute/v1/` base URL. Both are derived from the one extra.
    """

    @cached_property
    def compute_api_endpoint(self) -> str | None:
        return endpoint_override(self, "compute_api_endpoint", API_PATH)

    def get_conn(self):
        """The discovery client, as the provider's hook builds it (its static document, the
        connection's credentials) but from the thread's parsed document, at the extra's endpoint."""
        if not self._conn:
            if self.compute_api_endpoint:
                options = ClientOptions(api_endpoint=self.compute_api_endpoint)
            else:
                options = super().get_client_options()
            self._conn = build_from_document(
                compute_discovery_document(self.api_version), http=self._authorize(), client_options=options
            )
        return self._conn

    def get_client_options(self, api_endpoint_override: str | None = None) -> ClientOptions:
        """The Cloud client libraries' options (the provider's instance, template and group
        clients all take them): the endpoint's host root, when the connection sets one."""
        if self.compute_api_endpoint and not api_endpoint_override:
            api_endpoint_override = self.compute_api_endpoint[: -len(API_PATH)].rstrip("/")
        return super().get_client_options(api_endpoint_override=api_endpoint_override)

    def _wait_for_operation_to_complete(
        self, project_id: str, operation_name: str, zone: str | None = None, region: str | None = None
    ) -> None:
        """The provider's wait, polling the operation until DONE; a failed one raises
        OperationFailed, which carries the operation's `error.errors[]` (code and message of each)
        instead of only the provider's text of them, so callers classify data, not a string."""
        service = self.get_conn()
        while True:
            self.log.info("Waiting for Operation to complete...")
            if region is not None:  # the provider's hook reads no regional operations
                operation = (
                    service.regionOperations()
                    .get(project=project_id, region=region, operation=operation_name)
                    .execute(num_retries=self.num_retries)
                )
            elif zone is None:
                operation = self._check_global_operation_status(
                    service=service, operation_name=operation_name, project_id=project_id, num_retries=self.num_retries
                )
            else:
                operation = self._check_zone_operation_status(
                    service, operation_name, project_id, zone, self.num_retries
                )
            if operation.get("status") == GceOperationStatus.DONE:
                if operation.get("error"):
                    raise OperationFailed(operation)
                return
            time.sleep(TIME_TO_SLEEP_IN_SECONDS)

    def get_host_keys(self, resource_id: str, zone: str, project_id: str) -> dict[str, str]:
        """The VM's SSH host keys as its guest agent publishes them: {key type: base64 key}.

        Empty until the guest agent has published them (the API answers 404 until then). Needs
        the instance metadata `enable-guest-attributes=TRUE`. A value is cut at its first
        whitespace and must be plain base64, so nothing else can ride along into known_hosts.
        """
        answer = self._unless_missing(
            self.get_conn().instances().getGuestAttributes(
                project=project_id, zone=zone, instance=resource_id, queryPath="hostkeys/"
            )
        )
        keys = {}
        for item in (answer or {}).get("queryValue", {}).get("items", []):
            if item.get("namespace") != "hostkeys" or item.get("key") not in HOST_KEY_TYPES:
                continue
            value = (item.get("value") or "").split()
            try:
                if value and base64.b64encode(base64.b64decode(value[0], validate=True)).decode() == value[0]:
                    keys[item["key"]] = value[0]
            except binascii.Error:
                continue
        return keys

    def os_login_enabled(self, resource_id: str, zone: str, project_id: str) -> bool | None:
        """Whether OS Login is on for the VM by metadata: its instance's `enable-oslogin` wins over
        the project's (Google's OS Login docs: instance metadata overrides project metadata).

        None when neither sets it or the project cannot be read (compute.projects.get); an
        organisation policy (constraints/compute.requireOsLogin) can enforce it unseen here.
        """
        instance = self._unless_missing(
            self.get_conn().instances().get(project=project_id, zone=zone, instance=resource_id)
        )
        value = _metadata_value(instance or {}, "enable-oslogin")
        if value is None:
            try:
                project = self.get_conn().projects().get(project=project_id).execute(num_retries=self.num_retries)
            except HttpError:
                return None
            value = _metadata_value({"metadata": project.get("commonInstanceMetadata")}, "enable-oslogin")
        return None if value is None else value.strip().upper() == "TRUE"

    def get_reservation(self, name: str, zone: str, project_id: str) -> dict | None:
        """The reservation resource (REST JSON), or None if the zone has none of that name. `name` is a
        reservation of `project_id`, or projects/OWNER/reservations/NAME: a shared one, read in the
        project that owns it (where it lives: a consumer project lists none of them)."""
        owner, bare = reservation_owner(name, project_id)
        return self._unless_missing(self.get_conn().reservations().get(project=owner, zone=zone, reservation=bare))

    def get_network(self, name: str, project_id: str) -> dict | None:
        """The VPC network resource (REST JSON), or None if the project has none of that name."""
        return self._unless_missing(self.get_conn().networks().get(project=project_id, network=name))

    def get_subnetwork(self, name: str, region: str, project_id: str) -> dict | None:
        """The subnetwork resource (REST JSON), or None if the region has none of that name."""
        return self._unless_missing(
            self.get_conn().subnetworks().get(project=project_id, region=region, subnetwork=name)
        )

    def reservation_capacity(self, name: str, zone: str, project_id: str) -> tuple[int, int] | None:
        """(count, inUseCount) of a specific reservation, or None if the zone has none of that name.

        inUseCount counts every VM consuming it, whichever DAG, run or person created it.
        """
        reservation = self.get_reservation(name=name, zone=zone, project_id=project_id)
        return None if reservation is None else reservation_counts(reservation)

    # Images (the provider's hook has no image methods): the discovery client, REST JSON.

    def get_image_from_family(self, family: str, project_id: str) -> dict | None:
        """The newest usable image of a family (images.getFromFamily), or None if it has none."""
        return self._unless_missing(self.get_conn().images().getFromFamily(project=project_id, family=family))

    def get_image(self, name: str, project_id: str) -> dict | None:
        return self._unless_missing(self.get_conn().images().get(project=project_id, image=name))

    def list_images(self, project_id: str) -> list[dict]:
        """Every image of the project (all pages)."""
        images, request = [], self.get_conn().images().list(project=project_id)
        while request is not None:
            page = request.execute(num_retries=self.num_retries)
            images.extend(page.get("items", []))
            request = self.get_conn().images().list_next(request, page)
        return images

    def insert_image(self, body: dict, project_id: str, request_id: str | None = None) -> None:
        """images.insert, then its global operation until DONE (OperationFailed if it failed)."""
        operation = (
            self.get_conn()
            .images()
            .insert(project=project_id, body=body, requestId=request_id)
            .execute(num_retries=self.num_retries)
        )
        self._wait_for_operation_to_complete(project_id=project_id, operation_name=operation["name"], zone=None)

    # Workload policies and a group's hosts (the provider's hook has neither): the discovery
    # client, REST JSON.

    def insert_resource_policy(self, body: dict, region: str, project_id: str, request_id: str | None = None) -> None:
        """resourcePolicies.insert, then its regional operation until DONE (OperationFailed if it failed)."""
        operation = (
            self.get_conn()
            .resourcePolicies()
            .insert(project=project_id, region=region, body=body, requestId=request_id)
            .execute(num_retries=self.num_retries)
        )
        self._wait_for_operation_to_complete(project_id=project_id, operation_name=operation["name"], region=region)

    def get_resource_policy(self, name: str, region: str, project_id: str) -> dict | None:
        return self._unless_missing(
            self.get_conn().resourcePolicies().get(project=project_id, region=region, resourcePolicy=name)
        )

    def delete_resource_policy(self, name: str, region: str, project_id: str) -> bool:
        """Delete the policy and wait for it; False when there was none."""
        operation = self._unless_missing(
            self.get_conn().resourcePolicies().delete(project=project_id, region=region, resourcePolicy=name)
        )
        if operation is None:
            return False
        self._wait_for_operation_to_complete(project_id=project_id, operation_name=operation["name"], region=region)
        return True

    def list_managed_instances(self, group: str, zone: str, project_id: str) -> list[dict] | None:
        """The group's managed instances (all pages: name, currentAction, instanceStatus,
        lastAttempt), or None when the zone has no such group."""
        managers = self.get_conn().instanceGroupManagers()
        request = managers.listManagedInstances(project=project_id, zone=zone, instanceGroupManager=group)
        found: list[dict] = []
        while request is not None:
            page = self._unless_missing(request)
            if page is None:
                return None
            found.extend(page.get("managedInstances", []))
            request = managers.listManagedInstances_next(request, page)
        return found

    # Flex-start and preemption: the discovery client, REST JSON.

    def start_insert_instance(self, body: dict, zone: str, project_id: str, request_id: str | None = None) -> str:
        """instances.insert without waiting for its operation; returns the operation's name. A
        flex-start insert's operation stays RUNNING while the request waits in the queue (the
        instance PENDING, up to its requestValidForDuration), so the caller waits elsewhere."""
        operation = self.get_compute_instance_client().insert(
            request={"instance_resource": body, "request_id": request_id, "project": project_id, "zone": zone}
        )
        return operation.name

    def get_zone_operation(self, name: str, zone: str, project_id: str) -> dict | None:
        """The zone operation (REST JSON), or None when it is gone."""
        return self._unless_missing(self.get_conn().zoneOperations().get(project=project_id, zone=zone, operation=name))

    def instance_status(self, resource_id: str, zone: str, project_id: str) -> str | None:
        """The instance's status (PENDING, RUNNING, ...), None when there is none of that name."""
        instance = self._unless_missing(self.get_conn().instances().get(project=project_id, zone=zone, instance=resource_id))
        return None if instance is None else instance.get("status")

    def preemptions(self, resource_id: str, zone: str, project_id: str) -> list[dict]:
        """The zone's `compute.instances.preempted` operations of instances named `resource_id`
        (every VM the run made under that name), oldest first. Compute Engine's "Detect if a Spot
        VM was preempted" lists them with the filter operationType="compute.instances.preempted"."""
        operations = self.get_conn().zoneOperations()
        request = operations.list(
            project=project_id, zone=zone, filter='operationType="compute.instances.preempted"'
        )
        found: list[dict] = []
        while request is not None:
            page = request.execute(num_retries=self.num_retries)
            found.extend(
                op for op in page.get("items", []) if op.get("targetLink", "").rsplit("/", 1)[-1] == resource_id
            )
            request = operations.list_next(request, page)
        return sorted(found, key=lambda op: op.get("insertTime", ""))

    def _unless_missing(self, request) -> dict | None:
        """Execute a discovery-client request; None when the API answers 404."""
        try:
            return request.execute(num_retries=self.num_retries)
        except HttpError as error:
            if error.resp.status == 404:
                return None
            raise


async def vm_lost(gcp_conn_id: str, vm_name: str, project_id: str, zone: str, log) -> bool:
    """For a trigger whose VM does not answer: whether the Compute API says it is gone or stopped
    (TERMINATED). Read in a thread (the client blocks); a read that fails says nothing (False)."""
    import asyncio

    from google.api_core.exceptions import NotFound

    def status() -> str | None:
        try:
            return ComputeEngineEndpointHook(gcp_conn_id=gcp_conn_id).get_instance(
                resource_id=vm_name, project_id=project_id, zone=zone
            ).status
        except NotFound:
            return None

    try:
        found = await asyncio.to_thread(status)
    except Exception as error:  # noqa: BLE001 - the next poll asks again
        log.warning("Could not read the status of VM %s: %s", vm_name, error)
        return False
    if found in (None, "TERMINATED"):
        log.warning("VM %s is %s", vm_name, found or "gone")
        return True
    return False
