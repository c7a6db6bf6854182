"""Multi-host TPU slices: resource policies, instance templates and managed instance groups.

On Compute Engine a multi-host TPU slice (v6e-16: 4 hosts of ct6e-standard-4t, topology 4x4) is
a zonal managed instance group (MIG) whose instances come from an instance template, with a
workload resource policy (HIGH_THROUGHPUT, an accelerator topology) attached; its target size is
the number of hosts. This module serves the three collections of compute v1 that make one, with
the paths, bodies and responses of the discovery document google-api-python-client ships
(schema.py validates the bodies):
- resourcePolicies (regional): insert, get, delete; regional operations;
- instanceTemplates (global) and regionInstanceTemplates: insert, get, delete; global/regional
  operations;
- instanceGroupManagers (zonal): insert, get, listManagedInstances, delete; zonal operations.

A group's instances are the emulator's ordinary instances (sandboxed sshd VMs), inserted from
the template's properties through instances.insert's own code path, so reservations, faults,
the guest agent and instances.get/list treat them like any other. Like a MIG, the group keeps
trying to create a member whose creation failed (ManagedInstance.currentAction stays CREATING,
its `lastAttempt.errors` holds the failed attempt's errors) and re-creates a member whose
instance vanished, until the group is deleted; deleting the group deletes its instances first.

recreateInstances flags members for recreation (its operation DONE once flagged, as the discovery
document says) and the group deletes each and creates it again under its name, currentAction
RECREATING until the new instance runs. A member whose instance stops running by no act of the
group (TERMINATED: a preemption, a host error, a stop) is repaired the same way, as MIGs repair a
failed VM by default ("About repairing VMs in a MIG"; the discovery document's
instanceLifecyclePolicy.defaultActionOnFailure: REPAIR, the default, or DO_NOTHING).

Not emulated: resize, updates, abandon and the other IGM methods, regional MIGs, health-check
autohealing, list of the three collections, checks that the policy's topology matches the
group's size and machine type, and the `created-by`/`instance-template` metadata a MIG adds.

Owns: SliceResources (the slices tables: policies, templates, groups), Group, Member. Imports
operations, resources, schema and errors; makes and deletes members through the emulator's own
instances.insert and instances.delete (instances.py), never by importing them. Its routes are
in server.py's table.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import secrets
import string
import threading
import time

from . import errors
from .errors import ApiError
from .operations import Operations, new_operation_name
from .resources import (
    Link, Request, check_labels, check_metadata, new_fingerprint, new_id, now_rfc3339, query_arg, relative_url,
    validated_body, zonal_list,
)
from .schema import load_schemas

# How long a group waits before trying again to create a member whose creation failed (a MIG
# retries until it succeeds: ManagedInstance.currentAction CREATING, discovery document).
RETRY_SECONDS = 2.0

# Member names: `<baseInstanceName>-<4 characters>`, the way a MIG names the instances it
# creates (e.g. "my-group-x7k2"; Compute Engine's MIG docs, "Instance names").
_SUFFIX_ALPHABET = string.ascii_lowercase + string.digits


def _in_use(kind: str, path: str, user: str) -> ApiError:
    """Deleting a resource another one references: "Error 400: The instance_template resource
    'projects/P/global/instanceTemplates/T' is already being used by
    'projects/P/zones/Z/instanceGroupManagers/M', resourceInUseByAnotherResource"
    (hashicorp/terraform-provider-google#1601, #6277; terraform-google-modules/terraform-google-vm#45
    shows the same wording for other kinds: instance_group_manager, health_check)."""
    return ApiError(
        400, "resourceInUseByAnotherResource", f"The {kind} resource '{path}' is already being used by '{user}'"
    )


@dataclasses.dataclass
class Member:
    """One managed instance: its name is fixed when the group plans it, the instance may not
    exist yet (being created, or its creation failed and will be retried)."""

    name: str
    operation: dict | None = None  # the latest instances.insert operation for it
    errors: list[dict] | None = None  # the latest failed attempt's errors
    retry_at: float = 0.0
    # Flagged for recreation (recreateInstances, or a repair of its failed instance): its instance
    # is deleted, then created again under the same name; currentAction RECREATING meanwhile.
    recreating: bool = False
    replacing: str | None = None  # the id of the instance it replaces, until that one is deleted


@dataclasses.dataclass
class Group:
    project: str
    zone: str
    name: str
    resource: dict
    template_key: tuple[str, str, str]
    policy_key: tuple[str, str, str] | None
    members: list[Member]
    deleting: bool = False

    @property
    def path(self) -> str:
        return f"projects/{self.project}/zones/{self.zone}/instanceGroupManagers/{self.name}"


class SliceState:
    """What the three collections hold, keyed like the emulator's own tables."""

    def __init__(self) -> None:
        self.policies: dict[tuple[str, str, str], dict] = {}  # (project, region, name) → resource
        # (project, "global" | "regions/R", name) → resource
        self.templates: dict[tuple[str, str, str], dict] = {}
        self.groups: dict[tuple[str, str, str], Group] = {}


def _template_path(key: tuple[str, str, str]) -> str:
    project, scope, name = key
    return f"projects/{project}/{scope}/instanceTemplates/{name}"


def _policy_path(key: tuple[str, str, str]) -> str:
    project, region, name = key
    return f"projects/{project}/regions/{region}/resourcePolicies/{name}"


class SliceResources(Operations):
    """The handlers, mixed into ComputeEmulator (its lock, operations and instances)."""

    def __init__(self) -> None:
        super().__init__()
        self.slices = SliceState()  # resource policies, instance templates, MIGs

    def list_autoscalers(self, project: str, zone: str, req: Request) -> dict:
        """autoscalers.list: always empty here (no autoscaler is emulated). gcloud's `managed
        delete` lists a zone's autoscalers first, to delete the group's own before the group."""
        return zonal_list("compute#autoscalerList", f"projects/{project}/zones/{zone}/autoscalers", [], req)

    # ----- resourcePolicies ----------------------------------------------------------------

    def insert_resource_policy(self, project: str, region: str, req: Request) -> dict:
        body = validated_body(req, "compute.resourcePolicies.insert", "ResourcePolicy", "resource_policy_resource")
        request_id = query_arg(req.query, "requestId")
        with self.lock:
            if replayed := self._replayed(project, request_id):
                return replayed
            key = (project, region, body["name"])
            if key in self.slices.policies:
                raise errors.already_exists(_policy_path(key))
            resource = copy.deepcopy(body)
            resource.update(
                kind="compute#resourcePolicy",
                id=new_id(),
                creationTimestamp=now_rfc3339(),
                region=Link(f"projects/{project}/regions/{region}"),
                selfLink=Link(_policy_path(key)),
                status="READY",
            )
            self.slices.policies[key] = resource
            op = self._register_operation(
                project, None, "insert", _policy_path(key), resource["id"], request_id, region=region
            )
        return self._sent(op)

    def _policy(self, key: tuple[str, str, str]) -> dict:
        found = self.slices.policies.get(key)
        if found is None:
            raise errors.not_found(_policy_path(key))
        return found

    def get_resource_policy(self, project: str, region: str, name: str, req: Request) -> dict:
        with self.lock:
            return copy.deepcopy(self._policy((project, region, name)))

    def delete_resource_policy(self, project: str, region: str, name: str, req: Request) -> dict:
        key = (project, region, name)
        return self._delete_unused(
            self.slices.policies, key, _policy_path(key), "resource_policy", lambda g: g.policy_key == key, region, req
        )

    def _delete_unused(self, store: dict, key: tuple, path: str, kind: str, used_by, region: str | None, req) -> dict:
        """Delete `store[key]` (a policy or a template) unless a group uses it (`used_by(group)`);
        the delete's operation, as sent."""
        request_id = query_arg(req.query, "requestId")
        project = key[0]
        with self.lock:
            if replayed := self._replayed(project, request_id):
                return replayed
            if key not in store:
                raise errors.not_found(path)
            if user := next((g for g in self.slices.groups.values() if used_by(g)), None):
                raise _in_use(kind, path, user.path)
            resource = store.pop(key)
            op = self._register_operation(project, None, "delete", path, resource["id"], request_id, region=region)
        return self._sent(op)

    # ----- instanceTemplates (global and regional) -----------------------------------------

    def insert_global_template(self, project: str, req: Request) -> dict:
        return self._insert_template(project, None, req)

    def insert_region_template(self, project: str, region: str, req: Request) -> dict:
        return self._insert_template(project, region, req)

    def get_global_template(self, project: str, name: str, req: Request) -> dict:
        with self.lock:
            return copy.deepcopy(self._template((project, "global", name)))

    def get_region_template(self, project: str, region: str, name: str, req: Request) -> dict:
        with self.lock:
            return copy.deepcopy(self._template((project, f"regions/{region}", name)))

    def delete_global_template(self, project: str, name: str, req: Request) -> dict:
        return self._delete_template(project, None, name, req)

    def delete_region_template(self, project: str, region: str, name: str, req: Request) -> dict:
        return self._delete_template(project, region, name, req)

    def _template(self, key: tuple[str, str, str]) -> dict:
        found = self.slices.templates.get(key)
        if found is None:
            raise errors.not_found(_template_path(key))
        return found

    def _insert_template(self, project: str, region: str | None, req: Request) -> dict:
        method = "compute.regionInstanceTemplates.insert" if region else "compute.instanceTemplates.insert"
        body = validated_body(req, method, "InstanceTemplate", "instance_template_resource")
        request_id = query_arg(req.query, "requestId")
        key = (project, f"regions/{region}" if region else "global", body["name"])
        with self.lock:
            if replayed := self._replayed(project, request_id):
                return replayed
            if key in self.slices.templates:
                raise errors.already_exists(_template_path(key))
            properties = body.get("properties") or {}
            check_labels(properties.get("labels") or {}, "resource.properties.labels")
            check_metadata(properties.get("metadata") or {}, "resource.properties.metadata")
            resource = copy.deepcopy(body)
            resource.update(
                kind="compute#instanceTemplate",
                id=new_id(),
                creationTimestamp=now_rfc3339(),
                selfLink=Link(_template_path(key)),
            )
            if region:
                resource["region"] = Link(f"projects/{project}/regions/{region}")
            self.slices.templates[key] = resource
            op = self._register_operation(
                project, None, "insert", _template_path(key), resource["id"], request_id, region=region
            )
        return self._sent(op)

    def _delete_template(self, project: str, region: str | None, name: str, req: Request) -> dict:
        key = (project, f"regions/{region}" if region else "global", name)
        return self._delete_unused(
            self.slices.templates, key, _template_path(key), "instance_template", lambda g: g.template_key == key,
            region, req,
        )

    # ----- instanceGroupManagers (zonal) ---------------------------------------------------

    def insert_group(self, project: str, zone: str, req: Request) -> dict:
        body = validated_body(
            req, "compute.instanceGroupManagers.insert", "InstanceGroupManager", "instance_group_manager_resource"
        )
        request_id = query_arg(req.query, "requestId")
        name = body["name"]
        path = f"projects/{project}/zones/{zone}/instanceGroupManagers/{name}"
        with self.lock:
            if replayed := self._replayed(project, request_id):
                return replayed
            if (project, zone, name) in self.slices.groups:
                raise errors.already_exists(path)
            template_ref = body.get("instanceTemplate") or next(
                (v.get("instanceTemplate") for v in body.get("versions") or [] if v.get("instanceTemplate")), None
            )
            if not template_ref:
                # "Required field 'instanceTemplate' not specified" (hashicorp/terraform#18781,
                # a MIG insert without a template).
                raise errors.required_field("instanceTemplate")
            template_key = self._reference(
                project, template_ref, r"(?P<scope>global|regions/[^/]+)/instanceTemplates/(?P<name>[^/]+)",
                "resource.instanceTemplate",
            )
            # A referenced template or policy that does not exist: the 404 notFound that a get of
            # it answers (mattes/gce-deploy-action#3 quotes it for a template). That the insert
            # answers it synchronously is this emulator's assumption (no capture of the real one).
            template = self._template(template_key)
            policy_ref = (body.get("resourcePolicies") or {}).get("workloadPolicy")
            policy_key = None
            if policy_ref:
                policy_key = self._reference(
                    project, policy_ref, r"regions/(?P<scope>[^/]+)/resourcePolicies/(?P<name>[^/]+)",
                    "resource.resourcePolicies.workloadPolicy",
                )
                self._policy(policy_key)
            if "targetSize" not in body:
                # kubernetes/kops#2132: "Required field 'resource.targetSize' not specified" (400
                # required), as the Go client omits a zero size.
                raise errors.ApiError(400, "required", "Required field 'resource.targetSize' not specified")
            target_size = int(body["targetSize"])
            if target_size < 0:
                # The API's invalid-value shape (errors.invalid_field_value); no capture of its
                # explanation for a negative size was found, so none is added.
                raise errors.invalid(f"Invalid value for field 'resource.targetSize': '{target_size}'.")
            base_name = body.get("baseInstanceName") or name
            resource = copy.deepcopy(body)
            resource.update(
                kind="compute#instanceGroupManager",
                id=new_id(),
                creationTimestamp=now_rfc3339(),
                zone=Link(f"projects/{project}/zones/{zone}"),
                selfLink=Link(path),
                instanceGroup=Link(f"projects/{project}/zones/{zone}/instanceGroups/{name}"),
                instanceTemplate=Link(_template_path(template_key)),
                versions=[{"instanceTemplate": Link(_template_path(template_key)), "targetSize": {"calculated": target_size}}],
                baseInstanceName=base_name,
                targetSize=target_size,
                fingerprint=new_fingerprint(),
                # The discovery document's default listing mode ("PAGELESS" unless set).
                listManagedInstancesResults=body.get("listManagedInstancesResults", "PAGELESS"),
            )
            if policy_key:
                resource["resourcePolicies"] = {"workloadPolicy": Link(_policy_path(policy_key))}
            taken = {k[2] for k in self.instances if k[:2] == (project, zone)}
            members = []
            for _ in range(target_size):
                while (member_name := f"{base_name}-{''.join(secrets.choice(_SUFFIX_ALPHABET) for _ in range(4))}") in taken:
                    pass
                taken.add(member_name)
                members.append(Member(member_name))
            group = Group(project, zone, name, resource, template_key, policy_key, members)
            self.slices.groups[(project, zone, name)] = group
            op = self._register_operation(project, zone, "insert", path, resource["id"], request_id)
            del template  # members read the template each attempt (it cannot change while used)
        # The insert's operation is DONE once the group exists; its instances are created after
        # (gcloud's `managed create` returns before them; `wait-until --stable` waits for them).
        answer = copy.deepcopy(op)  # as sent, before the worker can finish it
        self._finish_soon(op)
        threading.Thread(target=self._manage_group, args=(group,), name=f"mig-{name}", daemon=True).start()
        return answer

    def _reference(self, project: str, value: str, pattern: str, field: str) -> tuple[str, str, str]:
        """(project, scope, name) of a full or partial URL to a resource (the forms the discovery
        document lists for InstanceGroupManager.instanceTemplate and resourcePolicies)."""
        m = re.fullmatch(rf"(?:projects/(?P<project>[^/]+)/)?{pattern}", relative_url(value))
        if not m:
            # "Invalid value for field 'resource.instanceTemplate': 'template'. The URL is
            # malformed." (hashicorp/terraform#22083).
            raise errors.invalid_field_value(field, value, "The URL is malformed.")
        return (m.group("project") or project, m.group("scope"), m.group("name"))

    def _group(self, project: str, zone: str, name: str) -> Group:
        group = self.slices.groups.get((project, zone, name))
        if group is None:
            raise errors.not_found(f"projects/{project}/zones/{zone}/instanceGroupManagers/{name}")
        return group

    def _member_view(self, group: Group, member: Member) -> tuple[str, dict]:
        """A member's currentAction and its ManagedInstance (under the lock)."""
        inst = self.instances.get((group.project, group.zone, member.name))
        op = member.operation
        if group.deleting and inst is not None:
            action = "DELETING"
        elif member.recreating:
            action = "RECREATING"
        elif inst is not None and op is not None and op["status"] == "DONE" and "error" not in op:
            action = "NONE"
        else:
            action = "CREATING"
        view = {
            "instance": Link(f"projects/{group.project}/zones/{group.zone}/instances/{member.name}"),
            "name": member.name,
            "currentAction": action,
            "targetStatus": "RUNNING",
            "version": {"instanceTemplate": Link(_template_path(group.template_key))},
        }
        if inst is not None:
            view["id"] = inst.resource["id"]
            view["instanceStatus"] = inst.status
        if member.errors:
            # ManagedInstance.lastAttempt.errors.errors[]: {code, message} (discovery document);
            # Kubernetes cluster-autoscaler's GCE client reads instance-creation failures there
            # (cloudprovider/gce/autoscaling_gce_client.go), the codes of the emulator's catalog.
            view["lastAttempt"] = {"errors": {"errors": copy.deepcopy(member.errors)}}
        return action, view

    def get_group(self, project: str, zone: str, name: str, req: Request) -> dict:
        with self.lock:
            group = self._group(project, zone, name)
            actions = [self._member_view(group, m)[0] for m in group.members]
            resource = copy.deepcopy(group.resource)
        # InstanceGroupManagerActionsSummary: a count per action (discovery document).
        summary = {
            "abandoning": 0, "creating": 0, "creatingWithoutRetries": 0, "deleting": 0, "none": 0,
            "recreating": 0, "refreshing": 0, "restarting": 0, "resuming": 0, "starting": 0,
            "stopping": 0, "suspending": 0, "verifying": 0,
        }
        for action in actions:
            summary[action.lower()] += 1
        stable = all(action == "NONE" for action in actions)
        resource["currentActions"] = summary
        resource["status"] = {"isStable": stable, "versionTarget": {"isReached": stable}, "stateful": {
            "hasStatefulConfig": False, "perInstanceConfigs": {"allEffective": True}}}
        return resource

    def list_managed_instances(self, project: str, zone: str, name: str, req: Request) -> dict:
        with self.lock:
            group = self._group(project, zone, name)
            return {"managedInstances": [self._member_view(group, m)[1] for m in group.members]}

    def recreate_instances(self, project: str, zone: str, name: str, req: Request) -> dict:
        """instanceGroupManagers.recreateInstances: flag the named members; the group's loop
        deletes and creates each. The operation is DONE once they are flagged (the discovery
        document's description of the method)."""
        body = validated_body(
            req, "compute.instanceGroupManagers.recreateInstances", "InstanceGroupManagersRecreateInstancesRequest",
            "instance_group_managers_recreate_instances_request_resource",
        )
        request_id = query_arg(req.query, "requestId")
        with self.changed:
            if replayed := self._replayed(project, request_id):
                return replayed
            group = self._group(project, zone, name)
            if group.deleting:
                raise errors.not_ready(group.path)
            by_name = {m.name: m for m in group.members}
            flagged = []
            for i, url in enumerate(body.get("instances") or []):
                m = re.fullmatch(r"(?:projects/[^/]+/)?zones/(?P<zone>[^/]+)/instances/(?P<name>[^/]+)", relative_url(url))
                if not m or m.group("zone") != zone or m.group("name") not in by_name:
                    # The API's invalid-value shape (errors.invalid_field_value) without an
                    # explanation: no capture of the real refusal of a non-member was found.
                    raise errors.invalid(f"Invalid value for field 'resource.instances[{i}]': '{url}'.")
                flagged.append(by_name[m.group("name")])
            for member in flagged:
                inst = self.instances.get((project, zone, member.name))
                member.recreating, member.replacing = True, inst.resource["id"] if inst is not None else None
            op = self._register_operation(project, zone, "recreateInstances", group.path, group.resource["id"], request_id)
            self.changed.notify_all()
        answer = copy.deepcopy(op)  # as sent, before the worker can finish it
        self._finish_soon(op)
        return answer

    def delete_group(self, project: str, zone: str, name: str, req: Request) -> dict:
        request_id = query_arg(req.query, "requestId")
        with self.lock:
            if replayed := self._replayed(project, request_id):
                return replayed
            group = self._group(project, zone, name)
            if group.deleting:
                raise errors.not_ready(group.path)
            group.deleting = True
            op = self._register_operation(project, zone, "delete", group.path, group.resource["id"], request_id)
        answer = copy.deepcopy(op)  # as sent, before the worker can finish it
        self._finish_soon(op, lambda: self._delete_members(group))
        return answer

    def _delete_members(self, group: Group) -> None:
        """Delete every instance of the group (instances.delete's own path), wait until all are
        gone, then drop the group: its delete operation is DONE after its instances are."""
        keys = [(group.project, group.zone, m.name) for m in group.members]
        for key in keys:
            with self.lock:
                inst = self.instances.get(key)
                busy = inst is None or inst.deleting
            if not busy:
                try:
                    self.delete_instance(key[0], key[1], key[2], Request({}, None, ""))
                except ApiError:
                    pass  # gone or being deleted meanwhile
        with self.changed:
            done = self.changed.wait_for(
                lambda: self.closing or not any(k in self.instances for k in keys), self.operation_wait_timeout
            )
            if not done:
                raise RuntimeError(f"instances of {group.path} still exist")
            self.slices.groups.pop((group.project, group.zone, group.name), None)
            self.changed.notify_all()

    def _manage_group(self, group: Group) -> None:
        """The group's own loop: create each member that has no instance (first creation, a
        failed attempt after RETRY_SECONDS, or an instance that vanished) until it is deleted."""
        while True:
            with self.changed:
                if group.deleting or self.closing:
                    return
                now = time.time()
                due, doomed = [], []
                repair = (group.resource.get("instanceLifecyclePolicy") or {}).get("defaultActionOnFailure") != "DO_NOTHING"
                for member in group.members:
                    inst = self.instances.get((group.project, group.zone, member.name))
                    op = member.operation
                    if inst is not None and not inst.deleting and (
                        inst.resource["id"] == member.replacing or (repair and inst.status == "TERMINATED")
                    ):
                        if inst.resource["id"] != member.replacing:
                            # A repair, recorded as Compute Engine records one: a DONE
                            # compute.instances.repair.recreateInstance operation on the instance by
                            # "system" (gcpdiag's VM-termination runbook filters operations on that
                            # type; audit logs show the MIG's repairs by system@google.com).
                            event = self._register_operation(
                                group.project, group.zone, "compute.instances.repair.recreateInstance", inst.path,
                                inst.resource["id"], None, name=new_operation_name("systemevent"), user="system",
                            )
                            event.update(status="DONE", progress=100, startTime=event["insertTime"],
                                         endTime=event["insertTime"])
                        # Flagged, or failed: either way a recreation under the same name.
                        member.recreating, member.replacing = True, inst.resource["id"]
                        doomed.append(member)
                        continue
                    if inst is not None or (op is not None and op["status"] != "DONE"):
                        if (inst is not None and member.recreating and inst.resource["id"] != member.replacing
                                and inst.status == "RUNNING" and not inst.deleting):
                            member.recreating, member.replacing = False, None  # its new instance runs
                        continue
                    if op is not None and "error" in op:
                        if member.errors is None or member.errors is not op["error"]["errors"]:
                            member.errors = op["error"]["errors"]
                            member.retry_at = now + RETRY_SECONDS
                    if now >= member.retry_at:
                        due.append(member)
            for member in doomed:
                try:
                    self.delete_instance(group.project, group.zone, member.name, Request({}, None, ""))
                except ApiError:
                    pass  # being deleted already, or gone meanwhile: created again below once gone
            for member in due:
                self._create_member(group, member)
            with self.changed:
                if group.deleting or self.closing:
                    return
                self.changed.wait(RETRY_SECONDS / 4)

    def _create_member(self, group: Group, member: Member) -> None:
        """instances.insert of one member from the template's properties."""
        with self.lock:
            if group.deleting:
                return
            template = self.slices.templates.get(group.template_key)
            properties = copy.deepcopy((template or {}).get("properties") or {})
        # The template's properties that an Instance also has; machineType is a bare name in a
        # template (InstanceProperties.machineType, discovery document) and a zonal URL on an
        # instance; InstanceProperties.resourcePolicies are names, not the URLs an Instance holds.
        instance_fields = load_schemas()["Instance"]["properties"]
        body = {k: v for k, v in properties.items() if k in instance_fields and k != "resourcePolicies"}
        body["name"] = member.name
        if "machineType" in properties:
            body["machineType"] = f"zones/{group.zone}/machineTypes/{properties['machineType']}"
        try:
            op = self.insert_instance(group.project, group.zone, Request({}, body, ""))
        except ApiError as exc:
            # A synchronous refusal (an invalid template for this zone, an injected rejection):
            # recorded like a failed attempt. Its `code` is the API reason here, an emulator
            # choice: no capture shows what a MIG reports for these.
            with self.changed:
                member.operation = None
                member.errors = [{"code": exc.reason, "message": exc.message}]
                member.retry_at = time.time() + RETRY_SECONDS
                self.changed.notify_all()
            return
        with self.changed:
            member.operation = self._operation(group.project, group.zone, op["name"])
            self.changed.notify_all()
