"""The VM side of instances: the worker threads that carry an insert, delete or stop to DONE (the
sandbox VM made, started, stopped or destroyed; the faults that delay or fail them; a flex-start
instance's wait for capacity), VM time limits (scheduling.maxRunDuration / terminationTime),
terminations by the cloud itself (preemption of Spot VMs; a power-off from inside the guest,
guest_power.py), and the control calls on VMs.

Owns: InstanceLifecycle (no tables of its own: it changes the instances of instances.py).
Imports operations, instances, faults, error_catalog, guest, guest_power, disk_images, scheduling
and vm.
"""

from __future__ import annotations

import copy
import logging
import threading
import time

from . import disk_images, errors, guest_power
from .disk_images import skel
from .error_catalog import INSTANCE_ERRORS, OPERATION_ERROR_MESSAGES, error_values, fill
from .errors import ApiError
from .faults import InsertFaults
from .guest import GuestAccounts
from .instances import Instance
from .operations import Operations, new_operation_name
from .resources import now_rfc3339, rfc3339
from .scheduling import FLEX_START_MIN_PENDING_SECONDS, is_spot
from .vm import SandboxVM, pid_namespace

log = logging.getLogger(__name__)

# A preempted Spot VM's guest gets an ACPI G2 Soft Off and 30 seconds to shut down before the
# G3 Mechanical Off (the discovery document's Scheduling.skipGuestOsShutdown: "30 seconds for Spot
# VMs"; Compute Engine's "Spot VMs" page, preemption process).
PREEMPTION_SOFT_OFF_SECONDS = 30.0


class InstanceLifecycle(Operations):
    def _run_stop(self, inst: Instance, op: dict, stopping: bool) -> None:
        self._op_running(op)
        if stopping:
            self._finish_termination(inst, "STOP")
        self._op_done(op)

    def _run_insert(self, inst: Instance, op: dict, faults: InsertFaults) -> None:
        self._op_running(op)
        if faults.hang is not None:
            self._hang(faults.hang, faults.hang_epoch)
        if faults.fail is not None:
            fault = faults.fail
            preset = INSTANCE_ERRORS.get(fault.get("preset", ""))
            code = fault.get("code") or (preset.code if preset else "ZONE_RESOURCE_POOL_EXHAUSTED")
            if preset and preset.code != code:
                preset = None  # an explicit code overrides the preset's message and status too
            if message := fault.get("message") or (preset and preset.message):
                message = fill(message, **error_values(inst.project, inst.zone, inst.resource))
            else:
                message = self._operation_message(code, inst)
            with self.lock:
                if fault.get("leave_instance"):
                    # A stopped instance keeps its internal IP but loses its ephemeral external IP.
                    inst.resource["status"] = "TERMINATED"
                    for access in inst.resource["networkInterfaces"][0].get("accessConfigs") or []:
                        access.pop("natIP", None)
                else:
                    self.instances.pop((inst.project, inst.zone, inst.name), None)
                    self.leases.release(inst.ip)
            self._op_done(op, (code, message), fault.get("http_status") or (preset and preset.status))
            return
        if inst.capacity_wait is not None and not self._wait_for_capacity(inst, op):
            return
        refuse_for = faults.ssh_refused["seconds"] if faults.ssh_refused else None
        hang_for = faults.ssh_banner_timeout["seconds"] if faults.ssh_banner_timeout else None
        try:
            with inst.work_lock:
                with self.lock:
                    if inst.deleting or self.closing:
                        raise RuntimeError("instance deleted while being created")
                    inst.resource["status"] = "STAGING"
                    metadata = copy.deepcopy(inst.resource["metadata"])
                    project_metadata = copy.deepcopy(self._project_metadata(inst.project))
                # The image's own environment (its /etc/environment) over the cloud-wide one.
                env = {**self.vm_env, **disk_images.image_environment(inst.image_dir)}
                env["PATH"] = guest_power.session_path(env)
                vm = SandboxVM(self.state_dir, inst.name, inst.ip, env=env, fqdn=inst.fqdn,
                               first_boot=self.first_boot.boot_args)
                inst.vm = vm
                vm.prepare()
                disk_images.restore(inst.image_dir, vm.root)  # what an image of a boot disk holds
                if faults.first_boot_host_keys is None:  # else after the first-boot key change (guest_agent.py)
                    GuestAccounts(vm.root, skel(inst.image_dir)).apply_metadata(
                        metadata, project_metadata, self.os_login.accounts()
                    )
                if refuse_for is None:  # ssh_refused: sshd starts later (see _sshd_faults)
                    vm.start()
                    vm.wait_ready(self.vm_ready_timeout)
                    if hang_for is not None:
                        vm.pause_sshd()
                with self.changed:
                    running_since = self._mark_running(inst) if not inst.deleting else None
        except Exception as exc:
            log.exception("insert of %s failed", inst.path)
            with self.lock:
                if not inst.deleting:
                    inst.resource["status"] = "TERMINATED"
            if inst.vm is not None:
                try:
                    inst.vm.stop()
                except Exception:
                    log.exception("stopping failed VM %s", inst.name)
            self._op_done(op, ("INTERNAL_ERROR", f"localcloud: VM failed to start: {exc}"))
            return
        self._op_done(op)
        if running_since is not None and faults.first_boot_host_keys is not None:
            self._first_boot_host_keys(inst, vm, faults.first_boot_host_keys, running_since)  # guest_agent.py
        if running_since is not None and (refuse_for is not None or hang_for is not None):
            threading.Thread(
                target=self._sshd_faults, args=(inst, vm, refuse_for, hang_for, running_since), daemon=True
            ).start()

    def _wait_for_capacity(self, inst: Instance, op: dict) -> bool:
        """flex_start_wait: capacity comes `inst.capacity_wait` seconds after the insert. While it
        waits the instance is PENDING and its insert operation RUNNING ("Flex-start creation blocks
        until capacity is granted or the request expires", as gcloud users see it); then it goes
        PROVISIONING (True: the insert goes on). Past its requestValidForDuration "you encounter an
        error and Compute Engine deletes the Flex-start VM" (the instance life-cycle page): False,
        the instance is gone and the operation DONE with an error. Which error the API gives then
        is not published; the emulator gives the zone's stockout (ZONE_RESOURCE_POOL_EXHAUSTED,
        503), the documented error for "resources aren't available". Under 90 s of
        requestValidForDuration (or none) the VM never waits: "Compute Engine only allocates
        resources if they are immediately available", so it fails at once."""
        valid_for = inst.request_valid_for or 0.0
        if valid_for >= FLEX_START_MIN_PENDING_SECONDS:
            deadline = time.monotonic() + min(inst.capacity_wait, valid_for)
            if inst.expires_unserved:  # the fault's early end of the request's validity
                valid_for = min(valid_for, inst.capacity_wait) - 0.001
            with self.changed:
                while not self.closing and not inst.deleting:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.changed.wait(left)
                if self.closing or inst.deleting:
                    return True  # deleted while waiting: the insert fails as for any deleted instance
                if inst.capacity_wait <= valid_for:
                    inst.resource["status"] = "PROVISIONING"
                    self.changed.notify_all()
                    return True
        log.info("%s: no flex-start capacity within %s s", inst.path, valid_for)
        with self.changed:
            if self.instances.get((inst.project, inst.zone, inst.name)) is inst:
                self.instances.pop((inst.project, inst.zone, inst.name))
                self.leases.release(inst.ip)
            self.changed.notify_all()
        code = "ZONE_RESOURCE_POOL_EXHAUSTED"
        self._op_done(op, (code, self._operation_message(code, inst)), 503)
        return False

    def _mark_running(self, inst: Instance) -> float:
        """RUNNING from now (under the lock); arms the instance's time limit. Returns the time."""
        now = time.time()
        inst.resource["status"] = "RUNNING"
        inst.resource["lastStartTimestamp"] = rfc3339(now)
        inst.resource["cpuPlatform"] = "Intel Emerald Rapids"
        if inst.termination_action and (inst.run_duration is not None or inst.termination_time is not None):
            # Compute Engine counts a maxRunDuration from each start; it reports the planned time in
            # resourceStatus.scheduling.terminationTimestamp while the instance runs.
            inst.terminate_at = now + inst.run_duration if inst.run_duration is not None else inst.termination_time
            status = inst.resource.setdefault("resourceStatus", {}).setdefault("scheduling", {})
            status["terminationTimestamp"] = rfc3339(inst.terminate_at)
        self.changed.notify_all()
        return now

    def _operation_message(self, code: str, inst: Instance) -> str:
        template = OPERATION_ERROR_MESSAGES.get(code, "localcloud: injected operation error {code}.")
        return fill(template, code=code, **error_values(inst.project, inst.zone, inst.resource))

    def _hang(self, rule: dict, epoch: int) -> None:
        """Keep the calling operation RUNNING for the rule's `seconds`, or until operation_hangs
        is cleared (a POST of faults without it), whichever comes first."""
        seconds = rule.get("seconds")
        deadline = None if seconds is None else time.monotonic() + seconds
        with self.changed:
            while not self.closing and self.faults.cleared("operation_hangs") == epoch:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self.changed.wait(left)

    def _current(self, inst: Instance, vm: SandboxVM) -> bool:
        """Whether `vm` is still the running VM of the live instance `inst` (under the lock)."""
        key = (inst.project, inst.zone, inst.name)
        return self.instances.get(key) is inst and inst.vm is vm and inst.status == "RUNNING" and not inst.deleting

    def _wait_while_current(self, inst: Instance, vm: SandboxVM, until: float) -> bool:
        with self.changed:
            while not self.closing and self._current(inst, vm):
                left = until - time.time()
                if left <= 0:
                    return True
                self.changed.wait(left)
            return False

    def _sshd_faults(
        self, inst: Instance, vm: SandboxVM, refuse_for: float | None, hang_for: float | None, since: float
    ) -> None:
        """ssh_refused: start sshd `refuse_for` seconds after RUNNING; ssh_banner_timeout: let a
        frozen sshd go on `hang_for` seconds after it became reachable."""
        try:
            if refuse_for is not None:
                if not self._wait_while_current(inst, vm, since + refuse_for):
                    return
                with inst.work_lock:
                    with self.lock:
                        if not self._current(inst, vm):
                            return
                    vm.start()
                    vm.wait_ready(self.vm_ready_timeout)
                    if hang_for is not None:
                        vm.pause_sshd()
                since = time.time()
            if hang_for is not None:
                self._wait_while_current(inst, vm, since + hang_for)
                with inst.work_lock:
                    vm.resume_sshd()  # a no-op once the VM is gone
        except Exception:
            log.exception("late sshd of %s failed", inst.path)

    def _run_delete(
        self,
        inst: Instance,
        op: dict,
        hang: dict | None = None,
        hang_epoch: int = 0,
        fail: dict | None = None,
        previous_status: str = "RUNNING",
    ) -> None:
        self._op_running(op)
        if hang is not None:
            self._hang(hang, hang_epoch)
        if fail is not None:
            # The delete failed: the instance stays as it was, its VM still running.
            code = fail.get("code", "INTERNAL_ERROR")
            with self.changed:
                inst.deleting = False
                if inst.status == "STOPPING":
                    inst.resource["status"] = previous_status
                self.changed.notify_all()
            self._op_done(op, (code, fail.get("message") or self._operation_message(code, inst)), fail.get("http_status"))
            return
        with inst.work_lock:
            if inst.vm is not None:
                inst.vm.destroy(self.state_dir / "deleted", keep_shm=self.keep_deleted_shm)
            inst.vm = None
        with self.lock:
            if self.instances.get((inst.project, inst.zone, inst.name)) is inst:
                self.instances.pop((inst.project, inst.zone, inst.name))
                self.leases.release(inst.ip)
        self._op_done(op)

    # ----- time limits and the cloud's own terminations -------------------------------------

    def _time_limit_loop(self) -> None:
        """Carry out each RUNNING instance's termination action at its time limit, promptly
        (Compute Engine may take up to 30 s more; this acts within a fraction of a second)."""
        with self.changed:
            while not self.closing:
                now = time.time()
                soonest = None
                for inst in list(self.instances.values()):
                    if inst.terminate_at is None or inst.deleting or inst.status != "RUNNING":
                        continue
                    if inst.terminate_at <= now:
                        action = inst.termination_action or "STOP"
                        log.info("%s reached its time limit: %s", inst.path, action)
                        self._begin_termination(inst, action)
                        threading.Thread(target=self._finish_termination, args=(inst, action), daemon=True).start()
                    elif soonest is None or inst.terminate_at < soonest:
                        soonest = inst.terminate_at
                self.changed.wait(None if soonest is None else max(soonest - now, 0.01))

    def _begin_termination(self, inst: Instance, action: str) -> None:
        """The first half of a termination by the cloud (under the lock): STOPPING."""
        inst.terminate_at = None
        scheduling_status = (inst.resource.get("resourceStatus") or {}).get("scheduling") or {}
        scheduling_status.pop("terminationTimestamp", None)
        inst.resource["status"] = "STOPPING"
        if action == "DELETE":
            inst.deleting = True
        self.changed.notify_all()

    def _finish_termination(self, inst: Instance, action: str) -> None:
        """DELETE: the VM's processes die and the instance is gone, as by instances.delete.
        STOP: the VM's processes die, the instance stays TERMINATED (its files, internal IP and
        configuration kept; the ephemeral external IP released)."""
        try:
            with inst.work_lock:
                if action == "DELETE":
                    if inst.vm is not None:
                        inst.vm.destroy(self.state_dir / "deleted", keep_shm=self.keep_deleted_shm)
                    inst.vm = None
                elif inst.vm is not None:
                    inst.vm.stop()
        finally:
            with self.changed:
                key = (inst.project, inst.zone, inst.name)
                if action == "DELETE":
                    if self.instances.get(key) is inst:
                        self.instances.pop(key)
                        self.leases.release(inst.ip)
                elif not inst.deleting:
                    inst.resource["status"] = "TERMINATED"
                    inst.resource["lastStopTimestamp"] = now_rfc3339()
                    for access in inst.resource["networkInterfaces"][0].get("accessConfigs") or []:
                        access.pop("natIP", None)
                self.changed.notify_all()

    def _guest_power_off(self, pid: int, uid: int) -> tuple[str | None, object]:
        """A shutdown from inside a VM (guest_power.py): the caller's PID namespace names the VM;
        root or a google-sudoers member of that VM may power it off. On Compute Engine that stops
        the instance (STOPPING, then TERMINATED: files kept, external IP and reservation unit
        given back), whatever its instanceTerminationAction, which is for its time limit."""
        pidns = pid_namespace(pid)
        with self.changed:
            found = [i for i in self.instances.values() if i.vm is not None and pidns and i.vm.pidns == pidns]
            if not found:
                return "localcloud: the caller is in no VM of this emulator", None
            [inst] = found
            if not guest_power.may_power_off(inst.vm.root / "etc", uid):
                log.info("%s: power-off by uid %d refused (not root, not in google-sudoers)", inst.path, uid)
                return "must be superuser.", None
            if inst.deleting or inst.status != "RUNNING":
                return None, None  # already on its way down
            log.info("%s: powered off from the guest (uid %d): STOP", inst.path, uid)
            self._begin_termination(inst, "STOP")

        def finish() -> None:
            threading.Thread(target=self._finish_termination, args=(inst, "STOP"), daemon=True).start()

        return None, finish

    def _named_instance(self, name: str, project: str | None, zone: str | None) -> Instance:
        """The one instance named `name` (in `project` and `zone` when given), under the lock."""
        found = [
            i for i in self.instances.values() if i.name == name and project in (None, i.project) and zone in (None, i.zone)
        ]
        if not found:
            raise ApiError(404, "notFound", f"localcloud: no instance named '{name}'.")
        if len(found) > 1:
            raise errors.invalid(f"Several instances are named '{name}': give project and zone.")
        return found[0]

    def terminate(self, name: str, action: str, project: str | None = None, zone: str | None = None) -> dict:
        """Terminate an instance the way the cloud itself does (preemption, its time limit):
        no API call, no operation; returns when done."""
        if action not in ("DELETE", "STOP"):
            raise errors.invalid(f"Unknown action '{action}': DELETE or STOP.")
        with self.changed:
            inst = self._named_instance(name, project, zone)
            if inst.deleting:
                raise errors.not_ready(inst.path)
            if action == "STOP" and inst.status != "RUNNING":
                raise errors.invalid(f"Instance '{inst.path}' is {inst.status}: only a RUNNING instance stops.")
            self._begin_termination(inst, action)
        self._finish_termination(inst, action)
        with self.lock:
            status = "DELETED" if action == "DELETE" else inst.status
        return {"name": inst.name, "project": inst.project, "zone": inst.zone, "action": action, "status": status}

    def preempt(
        self,
        name: str,
        project: str | None = None,
        zone: str | None = None,
        soft_off_seconds: float = PREEMPTION_SOFT_OFF_SECONDS,
    ) -> dict:
        """Preempt a RUNNING Spot (or preemptible) VM as Compute Engine does (its "Spot VMs" page,
        preemption process): the zone's operations get a DONE compute.instances.preempted
        operation, the instance goes STOPPING while its guest has `soft_off_seconds` of ACPI G2
        soft off (its processes keep running), then it is TERMINATED (instanceTerminationAction
        STOP, the default) or deleted (DELETE). Returns at once, before the soft off ends.

        The operation's fields are those of a real one (GoogleCloudPlatform/gcpdiag,
        test-data/gce5/json-dumps/global-operations.json): name systemevent-..., user "system",
        statusMessage "Instance was preempted.", progress 100, status DONE, insertTime =
        startTime = endTime, targetLink, targetId, zone, selfLink, id, kind."""
        if not isinstance(soft_off_seconds, (int, float)) or isinstance(soft_off_seconds, bool) or not (
            0 <= soft_off_seconds <= 3600
        ):
            raise errors.invalid("soft_off_seconds must be a number of seconds from 0 to 3600.")
        with self.changed:
            inst = self._named_instance(name, project, zone)
            scheduling = inst.resource["scheduling"]
            if not is_spot(scheduling):
                raise errors.invalid(
                    f"Instance '{inst.path}' has provisioningModel {scheduling.get('provisioningModel')}: "
                    "only a Spot or preemptible instance is preempted."
                )
            if inst.deleting or inst.status != "RUNNING":
                raise errors.invalid(f"Instance '{inst.path}' is {inst.status}: only a RUNNING instance is preempted.")
            action = inst.termination_action or "STOP"
            op = self._register_operation(
                inst.project,
                inst.zone,
                "compute.instances.preempted",
                inst.path,
                inst.resource["id"],
                None,
                name=new_operation_name("systemevent"),
                user="system",
            )
            op.update(
                status="DONE",
                progress=100,
                startTime=op["insertTime"],
                endTime=op["insertTime"],
                statusMessage="Instance was preempted.",
            )
            inst.preempted = True
            log.info("%s preempted: %s after %s s of soft off", inst.path, action, soft_off_seconds)
            self._begin_termination(inst, action)
            answer = {
                "name": inst.name,
                "project": inst.project,
                "zone": inst.zone,
                "action": action,
                "status": inst.status,
                "operation": op["name"],
                "soft_off_seconds": soft_off_seconds,
            }

        def soft_off_then_off() -> None:
            # The soft off ends early if the emulator closes or (STOP) the API deletes the instance.
            deadline = time.monotonic() + soft_off_seconds
            with self.changed:
                while not self.closing and not (action == "STOP" and inst.deleting):
                    if (left := deadline - time.monotonic()) <= 0:
                        break
                    self.changed.wait(left)
            self._finish_termination(inst, action)

        threading.Thread(target=soft_off_then_off, name=f"preempt-{inst.name}", daemon=True).start()
        return answer

    # The system events with which Compute Engine itself ends a VM on a host's failure or its
    # maintenance (a VM with onHostMaintenance TERMINATE, as a TPU VM has): operationType values in
    # the zone's operations list that GoogleCloudPlatform/gcpdiag's VM-termination runbook filters
    # on (gcpdiag/runbook/gce/vm_termination.py, TERMINATION_OPERATION_FILTER).
    HOST_EVENTS = ("compute.instances.hostError", "compute.instances.terminateOnHostMaintenance")

    def host_event(self, name: str, event: str, project: str | None = None, zone: str | None = None) -> dict:
        """End a RUNNING instance by a host event: a DONE system-event operation of type `event`
        in its zone (name systemevent-..., user "system", as a preemption's), then the instance
        TERMINATED, its processes gone. No statusMessage: none of a real one was found. Returns
        when done: {name, project, zone, status, operation}."""
        if event not in self.HOST_EVENTS:
            raise errors.invalid(f"Unknown host event '{event}': one of {', '.join(self.HOST_EVENTS)}.")
        with self.changed:
            inst = self._named_instance(name, project, zone)
            if inst.deleting or inst.status != "RUNNING":
                raise errors.invalid(f"Instance '{inst.path}' is {inst.status}: only a RUNNING instance is ended.")
            op = self._register_operation(
                inst.project, inst.zone, event, inst.path, inst.resource["id"], None,
                name=new_operation_name("systemevent"), user="system",
            )
            op.update(status="DONE", progress=100, startTime=op["insertTime"], endTime=op["insertTime"])
            self._begin_termination(inst, "STOP")
        self._finish_termination(inst, "STOP")
        with self.lock:
            return {"name": inst.name, "project": inst.project, "zone": inst.zone, "status": inst.status,
                    "operation": op["name"]}

    def pause_sshd(self, name: str, paused: bool) -> dict:
        """Freeze (SIGSTOP) or resume the sshd of a running VM: the ssh_banner_timeout fault, but
        from now on and until resumed, for tests that must hold an SSH connect at a chosen time."""
        with self.lock:
            found = [i for i in self.instances.values() if i.name == name and i.vm is not None and not i.deleting]
            if len(found) != 1:
                raise ApiError(404, "notFound", f"localcloud: no single running VM named '{name}'.")
            [inst] = found
        with inst.work_lock:
            done = inst.vm.pause_sshd() if paused else inst.vm.resume_sshd()
        if not done:
            raise ApiError(409, "conflict", f"localcloud: VM '{name}' has no sshd to signal.")
        return {"name": name, "paused": paused}

    def set_faults(self, settings: object) -> dict:
        current = self.faults.replace(settings if settings is not None else {})
        with self.changed:
            self.changed.notify_all()  # a hang may end (operation_hangs cleared)
        return current

    # ----- emulator control ----------------------------------------------------------------

    def vms(self) -> list[dict]:
        """The VMs that run: live sshd processes, and RUNNING instances whose sshd has not
        started yet (ssh_refused; their `pid` and `sshd_pid` are null)."""
        with self.lock:
            instances = [(inst, inst.vm, inst.status) for inst in self.instances.values()]
        result = []
        for inst, vm, status in instances:
            if vm is None or not (vm.alive() or (status == "RUNNING" and vm.proc is None)):
                continue
            users = GuestAccounts(vm.root, None).managed_users()
            result.append(
                {
                    "name": inst.name,
                    "project": inst.project,
                    "zone": inst.zone,
                    "ip": inst.ip,
                    "pid": vm.pid,
                    "sshd_pid": vm.ns_init_pid,
                    "status": inst.status,
                    "preempted": inst.preempted,
                    "users": sorted(users),
                    "first_boot": vm.first_boot_state(),  # vm.py: cloud-init's state, dpkg's lock holder
                }
            )
        return result

    def shutdown(self) -> None:
        """Delete every VM (used on SIGTERM/SIGINT)."""
        self.guest_power.close()
        with self.changed:
            self.closing = True
            self.changed.notify_all()
            instances = list(self.instances.values())

        def destroy(inst: Instance) -> None:
            with inst.work_lock:
                if inst.vm is not None:
                    inst.vm.destroy(self.state_dir / "deleted", keep_shm=self.keep_deleted_shm)
                    inst.vm = None

        threads = [threading.Thread(target=destroy, args=(i,)) for i in instances]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with self.lock:
            for inst in self.instances.values():
                self.leases.release(inst.ip)
            self.instances.clear()
