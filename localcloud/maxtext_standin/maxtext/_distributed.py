"""Multi-controller JAX for the MaxText stand-in: one process per host of a multi-host TPU slice.

On TPU, MaxText 0.2.2 calls `jax.distributed.initialize(initialization_timeout=
jax_distributed_initialization_timeout)` and nothing else (maybe_initialize_jax_distributed_system,
src/maxtext/utils/max_utils.py, from pyconfig.initialize), so JAX 0.9.2's cluster auto-detection
places the process. `cluster_from_env` reads the environment as that detection does when
TPU_WORKER_HOSTNAMES is set (GkeTpuCluster in jax/_src/clusters/cloud_tpu_cluster.py, which JAX
tries before GceTpuCluster; jax/_src/distributed.py, jax/_src/clusters/cluster.py):
  - the workers: TPU_PROCESS_ADDRESSES, else TPU_WORKER_HOSTNAMES, split on ",";
  - the process count: workers x MEGASCALE_NUM_SLICES (1 when unset);
  - the process id: TPU_WORKER_ID + MEGASCALE_SLICE_ID x workers;
  - the coordinator: JAX_COORDINATOR_ADDRESS, else the host of MEGASCALE_COORDINATOR_ADDRESS or of
    the first worker, at port JAX_COORDINATOR_PORT, else 8482 (cloud_tpu_cluster.coordinator_port).
JAX would read the MEGASCALE_* keys from the metadata server's tpu-env when they are not in the
environment; the local cloud has no metadata server, so the stand-in reads the environment only.
One process (a single VM) forms no cluster: the stand-in then runs exactly as it always did (real
JAX would still start a one-process coordination service). skip_jax_distributed_system=true keeps
every process on its own, as in MaxText; MaxText's other reasons to skip the call
(enable_checkpointing=false, enable_single_controller, ...) are not imitated.

Process 0 runs the coordination service, here a TCP server of newline-delimited JSON messages; it
binds the coordinator's own address (JAX binds [::]:PORT unless JAX_COORDINATOR_BIND_ADDRESS says
otherwise; the local cloud's VMs share one network namespace, so a wildcard bind would take the
port from every other VM). Every process, 0 included, is a client of it, as each JAX process's
coordination agent is: it registers, then sends a heartbeat every heartbeat_timeout/2 seconds
(CoordinationServiceAgent::StartSendingHeartbeats); the service fails a task whose heartbeats
stopped for heartbeat_timeout seconds and sends the error to every other task, which terminates.
Barriers stand for a step's collectives and for Orbax's syncs; `shutdown` is JAX's shutdown
barrier at exit, with its timeout.

The error texts are those of jaxlib 0.9.2, as four runs of jax 0.9.2 on two and three CPU
processes over loopback printed them (the local cloud's real-MaxText image; a task SIGKILLed, the
leader SIGKILLed, the leader SIGSTOPped, a task raising before exit); the same lines are in the
JAX documentation's "Fault Tolerant Distributed JAX" (docs/fault_tolerance.rst) and in the strings
of jaxlib 0.9.2's libjax_common.so. The terminating line is logged as absl FATAL (client.h:80),
which aborts the process (SIGABRT: exit status 134 from a shell); openxla/xla#38624 made that
failure loud instead of a quiet exit 1.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import random
import socket
import sys
import threading
import time

from maxtext import _standin as s

COORDINATOR_PORT = "8482"  # jax/_src/clusters/cloud_tpu_cluster.py: coordinator_port
# jax.distributed.initialize's defaults (jax/_src/distributed.py); MaxText passes neither.
HEARTBEAT_TIMEOUT_SECONDS = 100
SHUTDOWN_TIMEOUT_SECONDS = 300
# CoordinationServiceAgent::Connect: the registration deadline is the timeout plus 5 seconds
# "for any service-related timeouts to propagate", retried with a backoff of up to 2^14 ms.
REGISTER_GRACE_SECONDS = 5
MAX_BACKOFF_EXPONENT = 14
STRAGGLER_LOG_LIMIT = 3  # coordination_service.cc: kPendingStragglerLogLimit
OWN_ERROR_DELAY_SECONDS = 2.0  # at most, before process 0 takes the error it sent the others

# ---- jaxlib 0.9.2's texts (see the module docstring for where they were read)
SERVICE_ERROR_PAYLOAD = " [type.googleapis.com/tensorflow.CoordinationServiceError='']"
POLLED_RPC = "\n\nRPC: /tensorflow.CoordinationService/PollForError" + SERVICE_ERROR_PAYLOAD
TERMINATING = ("Terminating process because the JAX distributed service detected fatal errors. This most likely "
               "indicates that another task died; see the other task logs for more details. Disable Python "
               "buffering, i.e. `python -u`, to be sure to see all the previous output. absl::Status: ")
POLLED = "Polled an error from coordination service (this can be an error from this or another task)."
PROPAGATING = "Use error polling to propagate the following error to all tasks: "
UNHEALTHY = ("UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n{tasks}\n"
             "The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. "
             "preemption, eviction) to debug further.")
LEADER_GONE = ("UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was "
               "preempted/died/restarted unexpectedly or this task is experiencing network issues. Check earlier "
               "logs from 1) this task, 2) the leader (usually slice 0 task 0), and 3) cluster scheduler to debug "
               "further.\nAdditional GRPC error information from remote target coordination_service while calling "
               "/tensorflow.CoordinationService/PollForError:\n"
               ':UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}')
DEADLINE = "DEADLINE_EXCEEDED: Deadline Exceeded\n\nRPC: /tensorflow.CoordinationService/{rpc}"
BARRIER_TIMED_OUT = (
    "DEADLINE_EXCEEDED: Barrier timed out. Id: {id}::0. This usually happens because a task triggered the barrier "
    "too early or too slowly. Please look at the task logs (both timed out and first task) to debug further.\n"
    "# of tasks that reached the barrier: {reached}/{tasks}.\nThe first task at the barrier: {first}. Some timed "
    "out task names:\n{missing}\n [type.googleapis.com/tensorflow.BarrierError='\\n\\x{id_length:02x}{id}']"
    + SERVICE_ERROR_PAYLOAD)
SHUTDOWN_BARRIER_FAILED = "INTERNAL: Shutdown barrier has failed.\nBarrier result: '"
OUT_OF_SYNC = ("\nThis suggests that the workers are out of sync. Either at least one worker (a) crashed early due to "
               "program error or scheduler events (e.g. preemption, eviction), (b) was too fast in its execution, or "
               "(c) too slow / hanging. Check the logs (both the program and scheduler events) for an earlier error "
               "to identify the root cause.")
SHUTDOWN_BARRIER = "Shutdown"


@dataclasses.dataclass(frozen=True)
class Cluster:
    process_id: int
    num_processes: int
    coordinator: str  # host:port, as every process dials it
    bind: tuple[str, int]  # where process 0's service listens


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def cluster_from_env(env=os.environ) -> Cluster | None:
    """The slice this process belongs to, read as JAX's TPU cluster detection reads it; None when
    the environment names one process or no TPU workers at all."""
    workers_text = env.get("TPU_PROCESS_ADDRESSES")
    if workers_text is None:
        workers_text = env.get("TPU_WORKER_HOSTNAMES")
    if workers_text is None:
        return None
    workers = workers_text.split(",")
    num_processes = len(workers) * int(env.get("MEGASCALE_NUM_SLICES") or 1)
    if num_processes == 1:
        return None
    process_id = int(str(env.get("TPU_WORKER_ID"))) + int(env.get("MEGASCALE_SLICE_ID") or 0) * len(workers)
    coordinator = env.get("JAX_COORDINATOR_ADDRESS")
    if not coordinator:
        host = (env.get("MEGASCALE_COORDINATOR_ADDRESS") or workers[0]).split(":")[0]
        coordinator = f"{host}:{env.get('JAX_COORDINATOR_PORT') or COORDINATOR_PORT}"
    if not 0 <= process_id < num_processes:  # jax/_src/distributed.py's check and its message
        raise ValueError("process_id and num_processes must be nonnegative, with process_id < num_processes. "
                         f"Got process_id={process_id}, num_processes={num_processes}.")
    bind = env.get("JAX_COORDINATOR_BIND_ADDRESS") or coordinator
    return Cluster(process_id, num_processes, coordinator, _host_port(bind))


def _terminate(status: str, polled: bool = True) -> None:
    """What jaxlib's client does on a fatal coordination error: log it, then abort the process."""
    if polled:
        s.log(POLLED, where="coordination_service_agent.cc:281", level="E")
    s.log(TERMINATING + status, where="client.h:80", level="F")
    sys.stderr.write("*** Check failure stack trace: ***\n")
    sys.stderr.flush()
    os.abort()


class _Connection:
    """One end of a JSON-lines TCP connection; `send` is safe from any thread."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.reader = sock.makefile("r", encoding="utf-8")
        self._lock = threading.Lock()

    def send(self, **message) -> bool:
        data = (json.dumps(message) + "\n").encode()
        try:
            with self._lock:
                self.sock.sendall(data)
            return True
        except OSError:
            return False

    def messages(self):
        """The messages received, until the other end closes the connection (or it breaks)."""
        try:
            for line in self.reader:
                yield json.loads(line)
        except (OSError, ValueError):
            return


class _Service:
    """Process 0's coordination service: registration, heartbeats, barriers, error propagation."""

    def __init__(self, cluster: Cluster, heartbeat_timeout: float, shutdown_timeout: float):
        self.num_tasks = cluster.num_processes
        self.heartbeat_timeout = heartbeat_timeout
        self.shutdown_timeout = shutdown_timeout
        self.listener = socket.create_server(cluster.bind, family=socket.AF_INET6 if ":" in cluster.bind[0]
                                             else socket.AF_INET)
        self.lock = threading.Condition()
        self.tasks: dict[int, _Connection] = {}
        self.closed: set[int] = set()  # tasks whose connection has ended
        self.last_heartbeat: dict[int, float] = {}
        self.barriers: dict[str, dict] = {}
        self.finished = False  # an error was propagated, or every task passed the shutdown barrier
        for target in (self._accept, self._check_health):
            threading.Thread(target=target, daemon=True).start()

    def _accept(self):
        while True:
            sock, _ = self.listener.accept()
            threading.Thread(target=self._serve, args=(_Connection(sock),), daemon=True).start()

    def _serve(self, conn: _Connection):
        task = None
        for message in conn.messages():
            op = message["op"]
            with self.lock:
                if op == "register":
                    task = message["task"]
                    self.tasks[task] = conn
                    self.last_heartbeat[task] = time.monotonic()
                    if len(self.tasks) == self.num_tasks:
                        self._send_all(op="ready")
                elif op == "heartbeat":
                    self.last_heartbeat[task] = time.monotonic()
                    conn.send(op="heartbeat_ok")
                elif op == "barrier":
                    self._arrive(message["id"], task, message.get("value"))
        # A closed connection fails nothing by itself: a task is lost when its heartbeats stop.
        with self.lock:
            self.closed.add(task)
            self.lock.notify_all()

    def _send_all(self, **message):
        """To every task, process 0's own last: once it has the message it may exit, closing the
        service."""
        for task in sorted(self.tasks, reverse=True):
            self.tasks[task].send(**message)

    def wait_for_others_to_leave(self, timeout: float):
        """After the shutdown barrier: the other tasks disconnect before the service goes away."""
        with self.lock:
            self.lock.wait_for(lambda: self.closed.issuperset(set(self.tasks) - {0}), timeout=timeout)

    def _arrive(self, barrier_id: str, task: int, value):
        barrier = self.barriers.setdefault(barrier_id, {"arrived": {}, "first": task, "deadline": (
            time.monotonic() + self.shutdown_timeout if barrier_id == SHUTDOWN_BARRIER else None)})
        barrier["arrived"][task] = value
        if len(barrier["arrived"]) == self.num_tasks:
            del self.barriers[barrier_id]
            if barrier_id == SHUTDOWN_BARRIER:
                self.finished = True
            self._send_all(op="pass", id=barrier_id, value=barrier["arrived"].get(0))

    def _check_health(self):
        interval = min(1.0, self.heartbeat_timeout / 10)
        while True:
            time.sleep(interval)  # the service's periodic staleness check
            with self.lock:
                if self.finished:
                    return
                now = time.monotonic()
                stale = sorted(task for task, seen in self.last_heartbeat.items()
                               if now - seen > self.heartbeat_timeout)
                if stale:
                    self._fail(UNHEALTHY.format(tasks="\n".join(map(str, stale[:STRAGGLER_LOG_LIMIT]))))
                    return
                shutdown = self.barriers.get(SHUTDOWN_BARRIER)
                if shutdown and now > shutdown["deadline"]:
                    self._fail_shutdown(shutdown)
                    return

    def _fail_shutdown(self, barrier: dict):
        barrier_id = f"{SHUTDOWN_BARRIER}::{random.getrandbits(64)}"
        missing = [task for task in range(self.num_tasks) if task not in barrier["arrived"]]
        result = BARRIER_TIMED_OUT.format(
            id=barrier_id, id_length=len(barrier_id), reached=len(barrier["arrived"]), tasks=self.num_tasks,
            first=barrier["first"], missing="\n".join(map(str, missing[:STRAGGLER_LOG_LIMIT])))
        s.log("Shutdown barrier in coordination service has failed:\n" + result + OUT_OF_SYNC,
              where="coordination_service.cc:1653", level="E")
        self._fail(SHUTDOWN_BARRIER_FAILED + result)

    def _fail(self, status: str):
        """Fail the job (called holding the lock): every task that is still connected gets the
        error, as from PollForError. Process 0's own task last, once the others have ended (or
        after a moment): its abort closes the service, and a task that had not read the error yet
        would report the leader lost instead."""
        self.finished = True
        s.log(PROPAGATING + status + SERVICE_ERROR_PAYLOAD, where="coordination_service.cc:1681", level="E")
        others = [task for task in self.tasks if task != 0]
        for task in others:
            self.tasks[task].send(op="error", status=status + POLLED_RPC)
        self.lock.wait_for(lambda: self.closed.issuperset(others), timeout=OWN_ERROR_DELAY_SECONDS)
        self.tasks[0].send(op="error", status=status + POLLED_RPC)


class Runtime:
    """This process's place in a multi-controller run: `barrier` and `shutdown` block until every
    process gets there; any lost process makes every other one terminate."""

    def __init__(self, cluster: Cluster, initialization_timeout: float, heartbeat_timeout: float,
                 shutdown_timeout: float):
        self.cluster = cluster
        self.process_id = cluster.process_id
        self.num_processes = cluster.num_processes
        self.initialization_timeout = initialization_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.shutdown_timeout = shutdown_timeout
        self._conn: _Connection | None = None
        self._service: _Service | None = None
        self._ready = threading.Event()
        self._passed: dict[str, threading.Event] = {}
        self._values: dict[str, object] = {}
        self._heartbeat_answered = time.monotonic()
        self._closing = False

    def initialize(self):
        """jax.distributed.initialize: process 0 starts the service, then every process registers
        and waits for all the others, for at most initialization_timeout (+ the agent's 5 s)."""
        s.log("Attempting to initialize the jax distributed system...", where="max_utils.py:278")
        if self.process_id == 0:
            host, port = self.cluster.bind
            s.log(f"Starting JAX distributed service on {host}:{port}", where="distributed.py:149")
            self._service = _Service(self.cluster, self.heartbeat_timeout, self.shutdown_timeout)
        s.log(f"Connecting to JAX distributed service on {self.cluster.coordinator}", where="distributed.py:172")
        deadline = time.monotonic() + self.initialization_timeout + REGISTER_GRACE_SECONDS
        self._conn = self._dial(deadline)
        self._conn.send(op="register", task=self.process_id)
        threading.Thread(target=self._receive, daemon=True).start()
        if not self._ready.wait(max(0.0, deadline - time.monotonic())):
            _terminate(DEADLINE.format(rpc="RegisterTask"), polled=False)
        threading.Thread(target=self._send_heartbeats, daemon=True).start()
        s.log("Jax distributed system initialized!", where="max_utils.py:289")

    def _dial(self, deadline: float) -> _Connection:
        attempt = 0
        while True:
            attempt += 1
            try:
                sock = socket.create_connection(_host_port(self.cluster.coordinator),
                                                timeout=max(0.1, deadline - time.monotonic()))
                sock.settimeout(None)
                return _Connection(sock)
            except OSError:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    _terminate(DEADLINE.format(rpc="RegisterTask"), polled=False)
                backoff = (1 << min(MAX_BACKOFF_EXPONENT, attempt)) / 1000 * random.random()
                time.sleep(min(backoff, remaining))  # the agent's backoff before its next attempt

    def _receive(self):
        for message in self._conn.messages():
            op = message["op"]
            if op == "ready":
                self._ready.set()
            elif op == "heartbeat_ok":
                self._heartbeat_answered = time.monotonic()
            elif op == "pass":
                if message["id"] == SHUTDOWN_BARRIER:
                    self._closing = True
                self._values[message["id"]] = message["value"]
                self._barrier_event(message["id"]).set()
            elif op == "error":
                _terminate(message["status"])
        if not self._closing:  # the service's end closed: the leader is gone
            _terminate(LEADER_GONE)

    def _send_heartbeats(self):
        interval = self.heartbeat_timeout / 2
        while not self._closing:
            self._conn.send(op="heartbeat")
            time.sleep(interval)  # the agent's heartbeat interval
            if not self._closing and time.monotonic() - self._heartbeat_answered > self.heartbeat_timeout:
                _terminate(DEADLINE.format(rpc="Heartbeat"), polled=False)

    def _barrier_event(self, barrier_id: str) -> threading.Event:
        return self._passed.setdefault(barrier_id, threading.Event())

    def barrier(self, barrier_id: str, value=None):
        """Wait until every process reaches `barrier_id`; returns the value process 0 brought."""
        event = self._barrier_event(barrier_id)
        self._conn.send(op="barrier", id=barrier_id, value=value)
        event.wait()
        del self._passed[barrier_id]
        return self._values.pop(barrier_id)

    def shutdown(self):
        """jax.distributed.shutdown at exit: wait for every process at the shutdown barrier (the
        service fails everyone once it has waited shutdown_timeout seconds)."""
        self.barrier(SHUTDOWN_BARRIER)
        self._closing = True
        self._conn.sock.close()
        if self._service is not None:
            self._service.wait_for_others_to_leave(OWN_ERROR_DELAY_SECONDS)


def initialize(config, faults) -> Runtime | None:
    """The stand-in's jax.distributed.initialize for train_sft; None for a single process."""
    cluster = cluster_from_env()
    if cluster is None or config.skip_jax_distributed_system:
        return None
    runtime = Runtime(cluster, config.jax_distributed_initialization_timeout,
                      faults.get("heartbeat_timeout_seconds", HEARTBEAT_TIMEOUT_SECONDS),
                      faults.get("shutdown_timeout_seconds", SHUTDOWN_TIMEOUT_SECONDS))
    runtime.initialize()
    # JAX shuts the distributed system down at exit (jax/_src/api.py: clean_up, an atexit hook),
    # so after an uncaught exception's traceback too.
    atexit.register(runtime.shutdown)
    return runtime
