"""Sensors that watch the run's VM: SSH reachability, and the training started on it."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from google.api_core.exceptions import NotFound

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowFailException, AirflowSensorTimeout
from airflow.triggers.base import StartTriggerArgs
from maxtext_sft.cloud.storage import ORBAX_COMMIT_MARKER, StorageEndpointHook
from maxtext_sft.vm.ssh_common import HostKeyMismatch, LoginRefused
from maxtext_sft.results.loss_curve import final_loss_text
from maxtext_sft.tasks.base import RunTaskOperator
from maxtext_sft.vm.slice_hosts import NOT_RECOVERED, HostLog, check_hosts_running, on_every_host
from maxtext_sft.run.spec import RunSpec
from maxtext_sft.cloud.trigger_start import xcom_arg_template
from maxtext_sft.vm.access import (
    LOGIN_GRACE_SECONDS,
    PINNED_KEYS,
    HostKeysNotPublished,
    SshLoginProbe,
    instance_id,
    ssh_target,
    start_autostop,
    transient_ssh_errors,
    unreachable_reason,
    vm_ssh_hook,
)
from maxtext_sft.cloud.capacity import CAPACITY_FIRST_READ_SECONDS, CAPACITY_POLL_SECONDS
from maxtext_sft.vm.ssh_ready import SliceSshReadyTrigger, SshReadyTrigger
from maxtext_sft.vm.trigger_ssh import vm_ssh_kwargs
from maxtext_sft.vm.training_watch import (
    STATUS_LINE,
    SliceTrainingStatusTrigger,
    TrainingStartTrigger,
    TrainingStatusTrigger,
    log_training_lines,
    prune_checkpoints,
    spec_full_log_note,
    status_last,
    training_died,
    training_watch_kwargs,
)
from maxtext_sft.vm.training_watch import number as _number
from maxtext_sft.vm.training_watch import status_fields as _status_fields
from maxtext_sft.vm.training_watch import tail_start as _tail_start
from maxtext_sft.vm.recovery import VmRecovery
from maxtext_sft.vm.remake import SSH_WAIT_SECONDS, VmRemake
from maxtext_sft.vm.steps import STEPS, remote_command, script_files

VM_GONE = "deleted outside this run's teardown (preempted, its lifetime ended, or deleted by hand)"


def _vm_ssh_trigger_args(sensor, spec: RunSpec, target: dict[str, Any]) -> dict[str, Any]:
    """What a sensor gives every trigger that SSHes to `spec`'s VM (vm/trigger_ssh.py): `target`,
    its connections, its pace."""
    # An event waits out the executor's report of this deferral, as the capacity trigger's first
    # read does (apache/airflow#72716): [maxtext_sft] capacity_first_read_seconds.
    return vm_ssh_kwargs(spec, target, ssh_conn_id=sensor.ssh_conn_id, gcp_conn_id=sensor.gcp_conn_id,
                         poll_interval=sensor.poke_interval, first_event_after=sensor.capacity_first_read_seconds)


def _check_again_after(sensor, error: BaseException, seconds: float) -> None:
    """With no SSH target for the VM now (`error`): back to the sensor's `resume_check` after
    `seconds`, deferred."""
    from airflow.providers.standard.triggers.temporal import TimeDeltaTrigger  # not at parse time

    sensor.log.info("VM %s has no SSH target now (%s): checking again in %.0f s", sensor.run_spec.vm_name, error,
                    seconds)
    sensor.defer(trigger=TimeDeltaTrigger(timedelta(seconds=seconds)), method_name="resume_check")


class _KeptState:
    """What a sensor keeps across its task processes (pokes, deferrals, retries): clocks' starts
    and the like, in the task state store."""

    def _state(self, context, name: str) -> tuple[Any, str]:
        """(store, key) of what the sensor keeps across pokes under `name` (a clock's start, the
        last step seen): the task state store, which outlives reschedules and retries (a key per
        generation of the run), or this object when the poke runs outside a task run (no store)."""
        store = context.get("task_state_store")
        if store is None:
            store = self.__dict__.setdefault("_local_clocks", _LocalStore())
        generation = getattr(context.get("dag_run"), "clear_number", 0) or 0
        return store, f"{name}_g{generation}"

    def _clock_start(self, context, name: str, at: float | None = None) -> float:
        """When clock `name` started; it starts now (or `at`) if it was not running."""
        store, key = self._state(context, name)
        since = store.get(key)
        if since is None:
            since = time.time() if at is None else at
            store.set(key, since)
        return since

    def _stop_clock(self, context, name: str) -> None:
        store, key = self._state(context, name)
        if store.get(key) is not None:
            store.delete(key)

    def _try_key(self, context, name: str) -> str:
        """`name` for this try alone: a retry starts its own (as a poke-mode sensor's wait does)."""
        return f"{name}_try{getattr(context.get('ti'), 'try_number', 0)}"


class _LocalStore(dict):
    """The task state store's get/set/delete, in memory."""

    def set(self, key: str, value: Any) -> None:
        self[key] = value

    def delete(self, key: str) -> None:
        self.pop(key, None)


class VmSshReadySensor(_KeptState, RunTaskOperator, BaseSensorOperator):
    """Wait until the VM accepts an SSH login as the pipeline's (non-root) user, then start its
    autostop. Done at once when the VM is gone or stopped (this task cleared after the run
    deleted it, or its autostop stopped it): the step after this makes it again.

    Deferrable (the default): the worker checks once; while the VM does not answer, the logins
    go on on the triggerer (`SshReadyTrigger`), which hands back to the worker only what needs it
    (the login works: the worker starts the autostop; a login refused or a host key not the VM's;
    ssh_ready_timeout_seconds passed; the VM gone or stopped). With deferrable=False it pokes,
    holding its worker slot. What a wait keeps across its task processes (when it began, when
    each host first refused the login, the host keys read last, the hosts ready and their keys) is
    in the task state store, per try.

    A host is ready once its host keys have settled (vm.access.host_keys_settled): they are pinned,
    and its XCom hands them on ({"host_keys": {vm_name: keys}, "instance_ids": {vm_name: id}}): the
    run's later tasks refuse a VM whose keys changed since (vm.access.check_pinned_host_keys)."""

    pins_host_keys = True  # vm.access.pinned_host_keys finds the run's pinned keys in this task's XCom

    def __init__(
        self, *, capacity_first_read_seconds: float = CAPACITY_FIRST_READ_SECONDS, deferrable: bool = True, **kwargs
    ):
        super().__init__(**kwargs)
        self.capacity_first_read_seconds = capacity_first_read_seconds
        self.deferrable = deferrable
        self._probes: dict[str, SshLoginProbe] = {}  # one per host for this task process

    def poke(self, context) -> bool | PokeReturnValue:
        spec = self.run_spec
        status = VmRemake(spec, gcp_conn_id=self.gcp_conn_id, ssh_conn_id=self.ssh_conn_id, log=self.log).status()
        if status in (None, "TERMINATED"):
            self.log.warning("VM %s is %s: the next step makes it again", spec.vm_name, status or "gone")
            return True
        try:
            return self._logins(context, [spec], lambda _: self.log) and self._pins(context)
        except NotFound:  # deleted while this poke ran: as above
            self.log.warning("VM %s does not exist (%s): the next step makes it again", spec.vm_name, VM_GONE)
            return True

    def _pin(self, context, spec: RunSpec, host_keys: dict[str, str]) -> None:
        """Keep `spec`'s settled host keys, and which instance showed them, for this wait's XCom."""
        store, key = self._state(context, self._try_key(context, "ssh_pinned"))
        pinned = dict(store.get(key) or {})
        pinned[spec.vm_name] = {"host_keys": dict(host_keys), "instance_id": instance_id(spec, self.gcp_conn_id)}
        store.set(key, pinned)

    def _pins(self, context) -> PokeReturnValue:
        """Done, with the pinned host keys of every host as the XCom."""
        store, key = self._state(context, self._try_key(context, "ssh_pinned"))
        pinned = store.get(key) or {}
        return PokeReturnValue(True, {
            PINNED_KEYS: {name: entry["host_keys"] for name, entry in pinned.items()},
            "instance_ids": {name: entry["instance_id"] for name, entry in pinned.items()},
        })

    def _logins(self, context, specs: list[RunSpec], log_of: Callable[[RunSpec], Any]) -> bool:
        """Try the login on every host of `specs` not ready yet, start the autostop of each one it
        works on (logging to `log_of(spec)`); whether all are ready. Fails past
        ssh_ready_timeout_seconds, naming each host's last error."""
        store, key = self._state(context, self._try_key(context, "ssh_ready_hosts"))
        ready = list(store.get(key) or [])
        for spec in specs:
            if spec.vm_name in ready:
                continue
            host_log = log_of(spec)
            probe = self._probe(context, spec, host_log)
            try:
                logged_in = probe()
            finally:
                self._keep_last_keys(context, spec)
            if logged_in:
                self._pin(context, spec, probe.pinned or {})
                start_autostop(spec, self.gcp_conn_id, self.ssh_conn_id, host_log)
                ready.append(spec.vm_name)
                store.set(key, ready)
            else:
                self._keep_first_refusal(context, spec)
        waiting = [spec for spec in specs if spec.vm_name not in ready]
        if waiting:
            self._fail_past_the_bound(context, waiting)
        return not waiting

    def _waiting_hosts(self, context) -> list[RunSpec]:
        store, key = self._state(context, self._try_key(context, "ssh_ready_hosts"))
        ready = store.get(key) or []
        return [spec for spec in self.host_specs if spec.vm_name not in ready]

    def _probe(self, context, spec: RunSpec, log=None) -> SshLoginProbe:
        """One probe per host for this wait (it keeps when a login was first refused, and the task
        state store for the next task process of a deferred wait); the wait's clock starts with
        the first."""
        if spec.vm_name not in self._probes:
            store, key = self._state(context, self._try_key(context, f"login_refused_since_{spec.vm_name}"))
            keys_store, keys_key = self._state(context, self._try_key(context, f"host_keys_read_{spec.vm_name}"))
            self._probes[spec.vm_name] = SshLoginProbe(
                spec, self.gcp_conn_id, self.ssh_conn_id, log or self.log, first_refused=store.get(key),
                last_keys=keys_store.get(keys_key),
            )
            self._wait_started(context)
        return self._probes[spec.vm_name]

    def _keep_last_keys(self, context, spec: RunSpec) -> None:
        """The host keys `spec`'s VM published at the probe's last read whose login met one of
        them, for this wait's next read, in its next task process too."""
        probe = self._probe(context, spec)
        store, key = self._state(context, self._try_key(context, f"host_keys_read_{spec.vm_name}"))
        if probe.last_keys and store.get(key) != probe.last_keys:
            store.set(key, probe.last_keys)
        elif not probe.last_keys and store.get(key) is not None:  # sshd showed another key since
            store.delete(key)

    def _wait_started(self, context) -> float:
        """When this try's wait began (epoch seconds): its first check."""
        return self._clock_start(context, self._try_key(context, "ssh_wait_since"))

    def _keep_first_refusal(self, context, spec: RunSpec, first_refused: float | None = None) -> None:
        probe = self._probe(context, spec)
        probe.first_refused = probe.first_refused or first_refused
        store, key = self._state(context, self._try_key(context, f"login_refused_since_{spec.vm_name}"))
        if probe.first_refused is not None and store.get(key) is None:
            store.set(key, probe.first_refused)

    def _fail_past_the_bound(self, context, waiting: list[RunSpec], errors: dict[str, dict] | None = None) -> None:
        """Fail once the wait is over ssh_ready_timeout_seconds, naming each waiting host's last
        error (a trigger's, in `errors` by host, or its probe's)."""
        waited = time.time() - self._wait_started(context)
        if waited < self.run_spec.ssh_ready_timeout_seconds:
            return
        reasons = []
        for spec in waiting:
            if error := (errors or {}).get(spec.vm_name):
                reasons.append(unreachable_reason(spec, waited, error["error_type"], error["error"]))
            else:
                reasons.append(self._probe(context, spec).unreachable_reason(waited))
        raise AirflowFailException("; ".join(reasons))

    def execute(self, context):
        if not self.deferrable:
            return super().execute(context)
        return self._check(context)

    # ----- deferrable: a check on the worker, then the triggerer's logins until one needs the worker -----

    def _check(self, context) -> dict | None:
        """One check on the worker, as a poke; while a host does not answer, defer. Returns the
        pinned host keys (the XCom)."""
        done = self.poke(context)
        waiting = self._waiting_hosts(context) if not done else []
        if waiting and all(self._probe(context, spec).awaiting_second_read for spec in waiting):
            # Every host took the login with keys read once: the second read, a poll later, pins
            # them; cheaper here than a deferral and its event's hold.
            time.sleep(self.poke_interval)
            done = self.poke(context)
        if not done:
            self._defer_to_ssh_trigger(context)
        return done.xcom_value if isinstance(done, PokeReturnValue) else None

    def _host_trigger(self, context, spec: RunSpec) -> SshReadyTrigger | None:
        """The SSH ready trigger of one waiting host (None: it is gone)."""
        probe = self._probe(context, spec)
        try:
            target = ssh_target(spec, self.gcp_conn_id, host_keys_required=False)
        except NotFound:  # deleted since the check
            self.log.warning("VM %s does not exist (%s)", spec.vm_name, VM_GONE)
            return None
        except transient_ssh_errors() as error:
            # Not answering the Compute API just now: the worker checks again after a pause, one
            # that waits out the executor's report of the deferral as the trigger's events do.
            _check_again_after(self, error, max(self.poke_interval, self.capacity_first_read_seconds))
        # The host keys read last (none yet: {}): the trigger reads them at every poll, and pins them
        # once they stay the same.
        target = {**target, "host_keys": probe.last_keys or {}}
        return SshReadyTrigger(
            **_vm_ssh_trigger_args(self, spec, target),
            deadline=self._wait_started(context) + self.run_spec.ssh_ready_timeout_seconds,
            refused_until=probe.first_refused + LOGIN_GRACE_SECONDS if probe.first_refused is not None else None,
            first_refused=probe.first_refused,
        )

    def _defer_to_ssh_trigger(self, context) -> None:
        if trigger := self._host_trigger(context, self.run_spec):
            self.defer(trigger=trigger, method_name="resume_after_login")
        self.log.warning("VM %s is gone: the next step makes it again", self.run_spec.vm_name)

    def resume_check(self, context, event=None):
        """After a pause with no SSH target: check on the worker again."""
        return self._check(context)

    def resume_after_login(self, context, event: dict):
        """Back from the SSH trigger with what needs the worker (see vm/ssh_ready.py)."""
        spec = self.run_spec
        if event["status"] == "ready":
            try:
                self._pin(context, spec, event["host_keys"])
                start_autostop(spec, self.gcp_conn_id, self.ssh_conn_id, self.log)
            except NotFound:  # deleted since the login: as a check that finds it gone, done
                self.log.warning("VM %s does not exist (%s): the next step makes it again", spec.vm_name, VM_GONE)
                return None
            return self._pins(context).xcom_value
        return self._judge(context, {spec.vm_name: event})

    def _judge(self, context, events: dict[str, dict]) -> None:
        """What the hosts' events that need the worker (by host) say: the bound (fail, naming each
        host's last error), a host key not the VM's (fail), a refused login (judged as the probe
        judges one: OS Login, the grace); otherwise (the grace, the VM gone or stopped) the worker
        checks again."""
        specs = {spec.vm_name: spec for spec in self.host_specs}
        if bound := {name: event for name, event in events.items() if event["status"] == "unreachable"}:
            self._fail_past_the_bound(context, [specs[name] for name in bound], bound)
        for name, event in events.items():
            if event["status"] != "refused":
                continue
            if event["kind"] == "host_key":
                raise HostKeyMismatch(event["message"])
            self._keep_first_refusal(context, specs[name], event["first_refused"])
            self._probe(context, specs[name]).judge_refusal(LoginRefused(event["message"]))  # raises past the grace
        return self._check(context)


class TrainingCheckpointSensor(_KeptState, RunTaskOperator, BaseSensorOperator):
    """Wait for the final checkpoint of the training started by start_training.sh.

    Each check is one short SSH call that returns the new training log lines (copied into this
    task's log), the training process's state and exit code. With an output location, completion
    is taken from storage: the final step's Orbax commit marker, which is written after every
    other file of the step. Deferrable (the default): each try starts on the triggerer
    (`TrainingStartTrigger`, start_from_trigger; a slice's, or a spec given as a value, with one
    check on the worker), and the checks go on there (`TrainingStatusTrigger`), which hands back
    to the worker only what needs
    it (the training ended, stalled or never started; the VM unanswering, gone or stopped; the
    timeout), so no worker slot is held and no task process started between checks. With
    deferrable=False it pokes in reschedule mode, a task process per poke. A
    training process that ended without its final checkpoint fails the sensor at once, with the
    log's tail. A VM lost mid-training (gone, or answering no SSH for unreachable_timeout_seconds)
    is recreated and the training resumed from the latest durable checkpoint, a bounded number
    of times, once its reservation has a machine free (`VmRecovery`). With an output location
    each poke also deletes the committed checkpoints older than the newest `checkpoints_kept`.
    """

    def __init__(
        self,
        *,
        ssh_conn_id: str,
        hf_conn_id: str,
        capacity_poll_seconds: float = CAPACITY_POLL_SECONDS,
        capacity_first_read_seconds: float = CAPACITY_FIRST_READ_SECONDS,
        deferrable: bool = True,
        **kwargs,
    ):
        kwargs.setdefault("mode", "reschedule")
        super().__init__(ssh_conn_id=ssh_conn_id, hf_conn_id=hf_conn_id, **kwargs)
        self.capacity_poll_seconds = capacity_poll_seconds
        self.capacity_first_read_seconds = capacity_first_read_seconds
        self.deferrable = deferrable
        if deferrable and self.hosts is None:
            self._start_on_the_triggerer()

    def _start_on_the_triggerer(self) -> None:
        """Each try starts as `TrainingStartTrigger`, put on the triggerer by the scheduler: no task
        process while the training runs, until the worker is needed (start_from_trigger). The spec
        goes as a template of plan_run's XCom (cloud/trigger_start.py). A spec given as a value, or a
        slice's (its hosts are create_slice's XCom), starts with a check on the worker."""
        if (spec := xcom_arg_template(self.spec)) is None:
            return
        self.start_from_trigger = True
        self.start_trigger_args = StartTriggerArgs(
            trigger_cls=f"{TrainingStartTrigger.__module__}.{TrainingStartTrigger.__qualname__}",
            trigger_kwargs={"spec": spec, "ssh_conn_id": self.ssh_conn_id, "gcp_conn_id": self.gcp_conn_id},
            next_method="resume_after_status",
            next_kwargs=None,
            timeout=None,
        )

    def _recovery(self, spec: RunSpec) -> VmRecovery:
        return VmRecovery(
            spec, gcp_conn_id=self.gcp_conn_id, ssh_conn_id=self.ssh_conn_id, hf_conn_id=self.hf_conn_id, log=self.log
        )

    def _recover(self, context, spec: RunSpec, reason: str, *, replace: bool = False) -> None:
        """Recover the lost VM, or wait while there is no machine for it, at most
        max_capacity_wait_minutes from the first poke that found none: deferred to the capacity
        trigger (no worker slot held, none of the pokes' either), or, without a reservation to
        read, rescheduled."""
        store, key = self._state(context, "last_step")
        waiting, since_key = self._state(context, "capacity_wait_since")
        recovery = self._recovery(spec)
        if recovery.recover(reason, replace=replace, lost_after_step=store.get(key), waited_since=waiting.get(since_key)):
            self._stop_clock(context, "capacity_wait_since")
            self._clock_start(context, "new_vm_since")
            return
        since = self._clock_start(context, "capacity_wait_since")
        deadline = since + spec.max_capacity_wait_minutes * 60
        if time.time() >= deadline:
            raise AirflowFailException(
                f"{reason}; no machine was free to recreate it for {(time.time() - since) / 60:.0f} minutes "
                f"(max_capacity_wait_minutes={spec.max_capacity_wait_minutes}, {spec.machine_source})"
            )
        trigger = recovery.remake.capacity_wait_trigger(
            deadline, poll_seconds=self.capacity_poll_seconds, first_read_seconds=self.capacity_first_read_seconds
        )
        if trigger is not None:
            self.log.info("Waiting (deferred, no worker slot) for a free machine: %s", spec.machine_source)
            self.defer(trigger=trigger, method_name="resume_after_capacity_wait")

    def resume_after_capacity_wait(self, context, event: dict | None = None):
        """Back from the capacity trigger (a machine free, or its deadline): check again, which
        recreates the VM or fails past max_capacity_wait_minutes."""
        self.log.info("Back from the capacity wait: %s", event)
        return self.execute(context)

    def _recover_gone_vm(self, context, spec: RunSpec) -> None:
        self._recover(context, spec, f"VM {spec.vm_name} no longer exists: {VM_GONE}")

    def _vm_gone(self, context, spec: RunSpec) -> bool | PokeReturnValue:
        """The poke's answer when the VM is gone: done if its training had finished, else recovered."""
        if finished := self._finished_in_storage(spec):
            return finished
        self._recover_gone_vm(context, spec)
        return False

    def _vm_status(self, spec: RunSpec) -> str | None:
        return VmRemake(spec, gcp_conn_id=self.gcp_conn_id, ssh_conn_id=self.ssh_conn_id, log=self.log).status()

    def _finished_in_storage(self, spec: RunSpec) -> PokeReturnValue | None:
        """With the VM lost, the training may still have finished: its final step committed in
        storage (a VM stopped by its autostop after the training ended, or deleted since). Then
        nothing is recovered; the final loss is read from the step lines start_training.sh copied
        to storage as the training exited (None if they are not there)."""
        if not spec.durable:
            return None
        storage = StorageEndpointHook(gcp_conn_id=self.gcp_conn_id)
        if not storage.uri_exists(spec.final_commit_marker_uri):
            return None
        final_loss = None
        if storage.uri_exists(spec.training_steps_uri):
            final_loss = final_loss_text(storage.read_text(spec.training_steps_uri).splitlines(), spec.steps)
        result = {
            "final_step": spec.steps,
            "final_loss": final_loss,
            "final_checkpoint": spec.final_checkpoint_path,
            "vm_recoveries": self._recovery(spec).count(),
        }
        self.log.warning(
            "VM %s is lost, but the training had finished: %s is committed; final loss %s (from %s)",
            spec.vm_name, spec.final_commit_marker_uri, final_loss, spec.training_steps_uri,
        )
        return PokeReturnValue(is_done=True, xcom_value=result)

    def _take_spec_timings(self) -> None:
        """The check interval and the timeout are the run's (poke_interval_seconds,
        training_timeout_hours): set at every start of a task process, a resume from a trigger too."""
        spec = self.run_spec
        self.poke_interval = float(spec.poke_interval_seconds)
        self.timeout = timedelta(hours=spec.training_timeout_hours).total_seconds()

    def execute(self, context):
        self._take_spec_timings()
        if not self.deferrable:
            return super().execute(context)
        return self._check(context)

    # ----- deferrable: a check on the worker, then the triggerer's until one needs the worker -----

    def _deadline(self, context) -> float:
        """When this try's wait times out (training_timeout_hours): from its first check, as a
        reschedule-mode sensor's timeout runs from its try's first poke."""
        return self._clock_start(context, self._try_key(context, "watch_since")) + self.timeout

    def _timed_out(self, context) -> AirflowSensorTimeout:
        spec = self.run_spec
        return AirflowSensorTimeout(
            f"Training {spec.run_name} on {spec.vm_name} not finished after {self.timeout:.0f} s "
            f"(training_timeout_hours={spec.training_timeout_hours})"
        )

    def _check(self, context):
        """One check on the worker, as a poke (it uploads the step scripts the trigger runs), then
        the wait goes on on the triggerer."""
        if time.time() >= self._deadline(context):
            raise self._timed_out(context)
        return self._done_or_defer(context, self.poke(context))

    def _done_or_defer(self, context, result):
        if isinstance(result, PokeReturnValue):
            if result.is_done:
                return result.xcom_value
        elif result:
            return None
        self._defer_to_status_trigger(context)

    def _defer_to_status_trigger(self, context) -> None:
        self.defer(trigger=self._status_trigger(context, self.run_spec), method_name="resume_after_status")

    def _status_trigger(self, context, spec: RunSpec) -> TrainingStatusTrigger:
        """The status trigger of `spec`'s VM, to the wait's deadline and the VM's unreachable bound."""
        try:
            target = ssh_target(spec, self.gcp_conn_id)
        except (NotFound, HostKeysNotPublished, *transient_ssh_errors()) as error:
            # Gone, or booting, since the check: the next check on the worker finds out which.
            _check_again_after(self, error, self.poke_interval)
        return TrainingStatusTrigger(
            **_vm_ssh_trigger_args(self, spec, target),
            **training_watch_kwargs(spec),
            deadline=self._deadline(context),
            unreachable_deadline=self._unreachable_deadline(context, spec),
        )

    def resume_check(self, context, event: dict | None = None):
        """After a pause with no SSH target: check on the worker again."""
        self._take_spec_timings()
        return self._check(context)

    def resume_after_status(self, context, event: dict):
        """Back from the status trigger with what needs the worker (see vm/training_watch.py)."""
        self._take_spec_timings()
        if (since := event.get("watch_since")) is not None:  # the try began on the triggerer
            self._clock_start(context, self._try_key(context, "watch_since"), at=since)
        answer = self._answer_to(context, event)
        if answer is None:  # no status line, no SSH target: the worker's own check
            return self._check(context)
        return self._done_or_defer(context, answer)

    def _answer_to(self, context, event: dict) -> bool | PokeReturnValue | None:
        """What a status event says, as a poke's answer; None for one the worker's own check answers
        (no status, no SSH target)."""
        spec = self.run_spec
        if event.get("answered"):
            self._stop_clock(context, "unreachable_since")
            self._stop_clock(context, "new_vm_since")
        self._note_last_step(context, event.get("last_step"))
        kind = event["status"]
        if kind == "timeout":
            raise self._timed_out(context)
        if kind == "refused":
            raise (HostKeyMismatch if event["kind"] == "host_key" else LoginRefused)(event["message"])
        if kind == "check":
            self.log.warning("The triggerer found no SSH target for VM %s (%s): checking from the worker",
                             spec.vm_name, event["error"])
            return None
        if kind == "no_status":
            self.log.warning("training_status.sh gave no status on the triggerer (exit %s): %s; checking from the "
                             "worker, which uploads the step scripts", event["exit_status"], event["output"])
            return None
        if kind == "unreachable":
            return self._unreachable(context, spec, event["error"])
        return self._judge(context, spec, event["exit_status"], event["output"], logged=True)

    def _unreachable_deadline(self, context, spec: RunSpec) -> float | None:
        """Until when an unanswering VM is polled without the worker: the bound `_unreachable`
        started (a recreated VM's boot, or unreachable_timeout_seconds), None if none runs."""
        store, key = self._state(context, "new_vm_since")
        if (booting_since := store.get(key)) is not None:
            return booting_since + SSH_WAIT_SECONDS
        store, key = self._state(context, "unreachable_since")
        if (since := store.get(key)) is not None:
            return since + spec.unreachable_timeout_seconds
        return None

    def poke(self, context):
        spec = self.run_spec
        try:
            status, output = self._read_training_status(spec)
        except NotFound:
            return self._vm_gone(context, spec)
        except (HostKeysNotPublished, *transient_ssh_errors()) as error:
            self.log.warning("Could not check training on %s this time: %s", spec.vm_name, error)
            return self._unreachable(context, spec, error)
        return self._judge(context, spec, status, output)

    def _judge(self, context, spec: RunSpec, status: int, output: list[str], *, logged: bool = False):
        """The check's answer from what training_status.sh printed (its exit `status`, its
        lines): the poke's own read, or the trigger's (which `logged` the lines already)."""
        self._stop_clock(context, "unreachable_since")
        self._stop_clock(context, "new_vm_since")
        ordered = status_last(output)  # the status line last, every other line the training's
        if status != 0 or ordered is None:
            self.log.warning("training_status.sh gave no status (exit %s): %s", status, output[-5:])
            return False
        output = ordered
        fields = _status_fields(output[-1])
        self._note_last_step(context, _number(fields.get("last_step")))
        self._prune_checkpoints(spec)
        if not logged:
            if not self.deferrable:  # deferred, each watch of the trigger names it as it starts
                self._note_full_log(context, spec)
            log_training_lines(self.log, output[:-1])
        state = fields.get("state")
        if fields.get("reason") == "no-training-started":
            recovery = self._recovery(spec)
            if recovery.record_unrecorded() or recovery.count():
                # A recovery was cut short (this task was killed or retried) before training restarted.
                recovery.resume()
                return False
            raise AirflowFailException(
                f"No training was ever started on VM {spec.vm_name} (no pid file for {spec.run_name}): "
                "the VM was replaced outside this run, or start_training did not run on it"
            )
        self.log.info(
            "Training %s: state %s, last step %s, loss %s",
            spec.run_name, state, fields.get("last_step"), fields.get("last_loss"),
        )
        if state == "running":
            idle = _number(fields.get("idle_seconds")) or 0
            if idle > spec.stall_timeout_seconds:
                raise AirflowFailException(
                    f"Training {spec.run_name} on {spec.vm_name} stalled: no new step for {idle} s "
                    f"(stall_timeout_seconds={spec.stall_timeout_seconds}; last step {fields.get('last_step')})"
                )
            return False
        if state == "exited" and fields.get("exit_code") == "0":
            # The checkpoints are in storage: the process is done, is its final step committed?
            marker = spec.final_commit_marker_uri
            if StorageEndpointHook(gcp_conn_id=self.gcp_conn_id).uri_exists(marker):
                self.log.info("Final checkpoint committed in storage: %s", marker)
                state = "succeeded"
            else:
                self.log.warning("Training exited 0 but %s does not exist", marker)
        if state != "succeeded" and self._lost_with_its_vm(context, spec):
            return False
        if state == "succeeded":
            result = {
                "final_step": _number(fields.get("last_step")),
                # As text: a diverged run's "nan" or "inf" must reach the publishing gate intact.
                "final_loss": fields.get("last_loss"),
                "final_checkpoint": spec.final_checkpoint_path,
                "vm_recoveries": self._recovery(spec).count(),
            }
            self.log.info("Training %s finished: %s", spec.run_name, result)
            return PokeReturnValue(is_done=True, xcom_value=result)
        tail = output[_tail_start(output) : -1]
        if fields.get("exit_code") == "0":
            # MaxText exits 0 when the data runs out before `steps` (training_status.sh finds its
            # "run out of training data" line): that is not a finished run.
            cause = f"training exited 0 after step {fields.get('last_step')} of {spec.steps}"
            if fields.get("out_of_data") == "yes":
                cause += ": the dataset ran out of training data"
            elif spec.durable:
                cause += f": step {spec.steps} has no {ORBAX_COMMIT_MARKER} in storage"
        else:
            cause = f"training {_exit_text(fields.get('exit_code'))} after step {fields.get('last_step')}"
        raise AirflowFailException(
            f"Training {spec.run_name} on {spec.vm_name} ended without its final checkpoint "
            f"{spec.final_checkpoint_path} ({cause}); last log lines:\n" + "\n".join(tail)
        )

    def _read_training_status(self, spec: RunSpec) -> tuple[int, list[str]]:
        """Run training_status.sh on `spec`'s VM: its exit status and its lines, as they came."""
        output: list[str] = []
        hook = vm_ssh_hook(spec, self.gcp_conn_id, self.ssh_conn_id, conn_retry_attempts=1)
        with hook.get_conn():
            hook.upload_scripts(script_files())
            status, _ = hook.run_command(
                remote_command("training_status", spec),
                timeout=STEPS["training_status"].timeout_seconds(spec),
                on_line=output.append,
            )
        return status, output

    def _note_full_log(self, context, spec: RunSpec) -> None:
        """Say where the training's full log is, once a try (the task log shows only some of it)."""
        store, key = self._state(context, self._try_key(context, "full_log_noted"))
        if not store.get(key):
            self.log.info("%s", spec_full_log_note(spec))
            store.set(key, True)

    def _note_last_step(self, context, step: float | int | None) -> None:
        """Keep the last training step seen: a recovery's record says how many steps it lost."""
        store, key = self._state(context, "last_step")
        if step is not None and store.get(key) != step:
            store.set(key, step)

    def _unreachable(self, context, spec: RunSpec, error: BaseException) -> bool | PokeReturnValue:
        """Bound how long an unanswering VM is polled: the stall check runs on the VM, so it cannot
        fire there. A VM that is stopped (TERMINATED: its guest shut down, as its autostop does
        when the pipeline was away, or the cloud stopped it) is lost at once; a recreated VM has
        vm.remake.SSH_WAIT_SECONDS from its insert to boot; any other VM is lost once it answered
        nothing for unreachable_timeout_seconds. A lost VM is replaced and its training resumed,
        or the run fails (and delete_vm deletes it)."""
        status = self._vm_status(spec)
        if status is None:
            return self._vm_gone(context, spec)
        if status == "TERMINATED":
            if finished := self._finished_in_storage(spec):
                return finished
            self._stop_clock(context, "unreachable_since")
            self._recover(context, spec, f"VM {spec.vm_name} is stopped (TERMINATED: its guest shut down, or the "
                          "cloud stopped it)", replace=True)
            return False
        if status == "PENDING":
            # A recreated flex-start VM whose request waits in the queue: its boot has not begun,
            # so its clock starts when it leaves the queue (the cloud ends the request at its validity).
            self._stop_clock(context, "new_vm_since")
            self._clock_start(context, "new_vm_since")
            self.log.info("VM %s is PENDING: its flex-start request waits for a machine", spec.vm_name)
            return False
        store, key = self._state(context, "new_vm_since")
        if (booting_since := store.get(key)) is not None:
            waited, bound, name = time.time() - booting_since, SSH_WAIT_SECONDS, "the recreated VM's boot"
        else:
            waited, bound = time.time() - self._clock_start(context, "unreachable_since"), spec.unreachable_timeout_seconds
            name = "unreachable_timeout_seconds"
        if waited < bound:
            return False
        reason = f"VM {spec.vm_name} has answered no SSH for {waited:.0f} s ({name}: {bound} s; last error: {error})"
        self._stop_clock(context, "unreachable_since")
        self._stop_clock(context, "new_vm_since")
        self._recover(context, spec, reason, replace=True)
        return False

    def _prune_checkpoints(self, spec: RunSpec) -> None:
        """Keep the newest `checkpoints_kept` committed checkpoints in storage, deleting older ones
        (MaxText 0.2.2's train_sft keeps every one: sizing.prunable_steps). A storage error only
        postpones it to the next poke."""
        if not spec.durable or spec.checkpoints_kept is None:
            return
        prune_checkpoints(
            lambda: StorageEndpointHook(gcp_conn_id=self.gcp_conn_id), spec.checkpoints_dir, spec.checkpoints_kept, self.log
        )

    def _lost_with_its_vm(self, context, spec: RunSpec) -> bool:
        """Whether a training seen ended died with its VM rather than on its own: the instance is
        gone (recovered now) or no longer RUNNING. A preempted or stopped VM is STOPPING while
        its guest shuts down (the workload may be killed before sshd), then gone or TERMINATED
        (cloud.google.com/compute/docs/instances/instance-life-cycle): that is a lost VM, not a
        failed training, and the next poke finds out which."""
        status = self._vm_status(spec)
        if status is None:
            self._recover_gone_vm(context, spec)
            return True
        if status == "RUNNING":
            return False
        self.log.warning(
            "The training on %s ended while the VM is %s (shutting down: preempted, stopped or deleted): "
            "a lost VM, not a failed training; looking again at the next poke", spec.vm_name, status,
        )
        return True


def _exit_text(exit_code: str | None) -> str:
    """bash reports a process killed by signal N as exit code 128+N: name the signal."""
    text = f"exited with code {exit_code}"
    if exit_code and exit_code.isdigit() and 128 < int(exit_code) < 128 + signal.NSIG:
        try:
            text += f" (killed by {signal.Signals(int(exit_code) - 128).name})"
        except ValueError:
            pass
    return text


class SliceSshReadySensor(VmSshReadySensor):
    """Wait until every host accepts the pipeline's SSH login, then start each one's autostop; a
    host gone or not RUNNING fails the run. Deferrable as on one VM: one check of every host on the
    worker, then `SliceSshReadyTrigger` tries the hosts still waiting, all at once."""

    def poke(self, context) -> bool | PokeReturnValue:
        specs = self.host_specs
        check_hosts_running(specs, self.gcp_conn_id)
        if self._logins(context, specs, lambda spec: HostLog(self.log, spec.vm_name)):
            return self._pins(context)
        self.log.info("%d of %d hosts answer SSH", len(specs) - len(self._waiting_hosts(context)), len(specs))
        return False

    def _defer_to_ssh_trigger(self, context) -> None:
        triggers = [self._host_trigger(context, spec) for spec in self._waiting_hosts(context)]
        if None in triggers:  # a host gone since the check: this fails the run, naming it
            check_hosts_running(self.host_specs, self.gcp_conn_id)
            _check_again_after(self, "a host's address not found", max(self.poke_interval, self.capacity_first_read_seconds))
        trigger = SliceSshReadyTrigger(
            hosts=[trigger.serialize()[1] for trigger in triggers], first_event_after=self.capacity_first_read_seconds
        )
        self.defer(trigger=trigger, method_name="resume_after_logins")

    def resume_after_logins(self, context, event: dict):
        """Back from the slice's SSH trigger: the hosts whose login worked, and the events of
        those that need the worker (see vm/ssh_ready.py)."""
        specs = {spec.vm_name: spec for spec in self.host_specs}
        store, key = self._state(context, self._try_key(context, "ssh_ready_hosts"))
        for name in event["ready"]:
            self._pin(context, specs[name], event["host_keys"][name])
            start_autostop(specs[name], self.gcp_conn_id, self.ssh_conn_id, HostLog(self.log, name))
            store.set(key, [*(store.get(key) or []), name])
        if not event["events"]:
            return self._pins(context).xcom_value
        return self._judge(context, event["events"])


class SliceTrainingSensor(TrainingCheckpointSensor):
    """Wait for the final checkpoint as on one VM, watching host 0 (its log, its loss, the commit
    marker in storage), and every other host's training process: one that died, or a host gone,
    fails the run at once, naming the host and the end of its log. One host's death ends every
    host's training (JAX's coordination service aborts the others), so when host 0's ended too,
    the hosts whose process died on its own are named first: they are the cause.

    Deferrable as on one VM: one check of every host on the worker, then
    `SliceTrainingStatusTrigger` watches host 0 as `TrainingStatusTrigger` does, and at each poll
    reads every other host's status and asks the Compute API about every host; it hands back
    host 0's event, another host's dead training, or a host lost, each judged as a poke judges it.
    With deferrable=False it pokes in reschedule mode."""

    def poke(self, context):
        check_hosts_running(self.host_specs, self.gcp_conn_id)
        if deaths := self._worker_deaths():
            raise AirflowFailException("\n".join(deaths))
        with self._other_hosts_deaths_first():
            return super().poke(context)

    @contextmanager
    def _other_hosts_deaths_first(self):
        """Host 0's judgement; when it fails the run and another host's training died on its own,
        that host is named first, as the cause."""
        try:
            yield
        except AirflowFailException as ended:
            if deaths := self._worker_deaths():
                raise AirflowFailException("\n".join([*deaths, f"Host 0: {ended}"])) from None
            raise

    def _worker_deaths(self) -> list[str]:
        """What ended the training on each other host whose process exited non-zero."""
        others = self.host_specs[1:]
        deaths = [death for death in on_every_host(others, self._worker_death, "training") if death] if others else []
        if deaths:
            # A host deleted and re-created by its group since the last look at the Compute API
            # has a blank disk, which reads as a training never started: asked again, the API
            # names that cause instead.
            check_hosts_running(self.host_specs, self.gcp_conn_id)
        return deaths

    def _worker_death(self, spec: RunSpec) -> str | None:
        try:
            _, output = self._read_training_status(spec)
        except (HostKeysNotPublished, *transient_ssh_errors()) as error:
            # Host 0's stall check still runs: a silent worker stops every host's steps.
            self.log.warning("Could not check training on host %s this time: %s", spec.vm_name, error)
            return None
        return self._death(spec, output)

    def _death(self, spec: RunSpec, output: list[str]) -> str | None:
        """What ended the training on `spec`'s host, from training_status.sh's lines there: None
        unless its process died (`training_died`)."""
        status = next((line for line in reversed(output) if STATUS_LINE.match(line)), None)
        if status is None:
            return None
        fields = _status_fields(status)
        if not training_died(fields):
            return None
        if fields.get("reason") == "no-training-started":
            return f"No training was ever started on host {spec.host_index} ({spec.vm_name})"
        lines = [line for line in output if not STATUS_LINE.match(line)]
        code = fields.get("exit_code")
        how = _exit_text(code) if code != "none" else "died without writing its exit code (killed)"
        return (
            f"Training {spec.run_name} {how} on host {spec.host_index} "
            f"({spec.vm_name}); last log lines:\n" + "\n".join(lines[_tail_start(lines):])
        )

    # ----- deferrable: the slice's status trigger, and what its events say --------------------------

    def _defer_to_status_trigger(self, context) -> None:
        triggers = [self._status_trigger(context, spec) for spec in self.host_specs]
        trigger = SliceTrainingStatusTrigger(
            hosts=[trigger.serialize()[1] for trigger in triggers],
            instance_ids={spec.vm_name: spec.host_id for spec in self.host_specs},
            first_event_after=self.capacity_first_read_seconds,
        )
        self.defer(trigger=trigger, method_name="resume_after_hosts")

    def _answer_to(self, context, event: dict) -> bool | PokeReturnValue | None:
        """Host 0's status event, judged as on one VM; the other hosts' deaths named first."""
        with self._other_hosts_deaths_first():
            return super()._answer_to(context, event)

    def resume_after_hosts(self, context, event: dict):
        """Back from the slice's status trigger (see vm/training_watch.py), judged in a poke's
        order: a host lost fails the run, naming it; then the other hosts' dead trainings (from
        the trigger's reads) or refusals; then host 0's event, as on one VM."""
        check_hosts_running(self.host_specs, self.gcp_conn_id)
        events = event["hosts"]
        others = [spec for spec in self.host_specs[1:] if spec.vm_name in events]
        deaths = [self._death(spec, events[spec.vm_name]["output"])
                  for spec in others if events[spec.vm_name]["status"] == "training"]
        if deaths := [death for death in deaths if death]:
            raise AirflowFailException("\n".join(deaths))
        for spec in others:
            if (refused := events[spec.vm_name])["status"] == "refused":
                message = f"Host {spec.host_index} ({spec.vm_name}): {refused['message']}"
                raise (HostKeyMismatch if refused["kind"] == "host_key" else LoginRefused)(message)
        if event["host_0"] is None:  # a host the Compute API called lost is RUNNING now: check again
            return self.resume_check(context)
        return self.resume_after_status(context, event["host_0"])

    def _recover(self, context, spec: RunSpec, reason: str, *, replace: bool = False) -> None:
        raise AirflowFailException(f"{reason}: {NOT_RECOVERED}")
