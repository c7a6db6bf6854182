"""Operations: what every mutating call answers with at once, carried to DONE by a worker thread.

Zonal, regional (a `region` field instead of `zone`) and global operations: get, wait (bounded,
like the real API's), list per scope and aggregated; a repeated requestId is answered with the
first request's operation.

Owns: Operations (the operations and request_ids tables), the base of every family's mixin.
Imports core, resources, errors and error_catalog.
"""

from __future__ import annotations

import copy
import logging
import secrets
import threading
import time

from . import errors
from .core import EmulatorCore
from .error_catalog import OPERATION_ERROR_STATUS
from .resources import Link, Request, aggregated_list, new_id, now_rfc3339, zonal_list

log = logging.getLogger(__name__)

OPERATION_USER = "localcloud-user@localcloud.invalid"


def new_operation_name(prefix: str = "operation") -> str:
    """operation-MS-HEX13-HEX8-HEX8; the cloud's own events are named systemevent-... alike (a real
    compute.instances.preempted operation: GoogleCloudPlatform/gcpdiag,
    test-data/gce5/json-dumps/global-operations.json)."""
    ms = int(time.time() * 1000)
    return f"{prefix}-{ms}-{secrets.token_hex(7)[:13]}-{secrets.token_hex(4)}-{secrets.token_hex(4)}"


class Operations(EmulatorCore):
    def __init__(self) -> None:
        super().__init__()
        self.operations: dict[tuple[str, str, str], dict] = {}
        self.request_ids: dict[tuple[str, str], tuple[str, str, str]] = {}

    def _replayed(self, project: str, request_id: str | None) -> dict | None:
        """The API answers a repeated requestId with the first request's operation."""
        if request_id and (project, request_id) in self.request_ids:
            return copy.deepcopy(self.operations[self.request_ids[(project, request_id)]])
        return None

    def _register_operation(
        self,
        project: str,
        zone: str | None,
        operation_type: str,
        target_path: str,
        target_id: str,
        request_id: str | None,
        *,
        region: str | None = None,
        name: str | None = None,
        user: str = OPERATION_USER,
    ) -> dict:
        """A new PENDING operation (under the lock): zonal, regional when `region` is given (a
        `region` field instead of `zone`; stored under the key "regions/REGION", which no zone
        name can equal), or global when neither is (a global operation has no `zone` field).
        `name` and `user` are for the cloud's own operations (lifecycle.preempt)."""
        name = name or new_operation_name()
        if region:
            scope, zone = f"projects/{project}/regions/{region}", f"regions/{region}"
            located = {"region": Link(scope)}
        else:
            scope = f"projects/{project}/zones/{zone}" if zone else f"projects/{project}/global"
            located = {"zone": Link(scope)} if zone else {}
        op = {
            "kind": "compute#operation",
            "id": new_id(),
            "name": name,
            **located,
            "operationType": operation_type,
            "targetLink": Link(target_path),
            "targetId": target_id,
            "status": "PENDING",
            "user": user,
            "progress": 0,
            "insertTime": now_rfc3339(),
            "selfLink": Link(f"{scope}/operations/{name}"),
        }
        if request_id:
            op["clientOperationId"] = request_id
            self.request_ids[(project, request_id)] = (project, zone, name)
        self.operations[(project, zone, name)] = op
        return op

    def _operation(self, project: str, zone: str | None, name: str) -> dict:
        op = self.operations.get((project, zone, name))
        if op is None:
            scope = (zone if zone.startswith("regions/") else f"zones/{zone}") if zone else "global"
            raise errors.not_found(f"projects/{project}/{scope}/operations/{name}")
        return op

    def get_operation(self, project: str, zone: str, operation: str, req: Request) -> dict:
        with self.lock:
            return copy.deepcopy(self._operation(project, zone, operation))

    def get_global_operation(self, project: str, operation: str, req: Request) -> dict:
        return self.get_operation(project, None, operation, req)

    def wait_operation(self, project: str, zone: str | None, operation: str, req: Request) -> dict:
        # Like the real `wait`: returns when DONE or after a bounded time (2 min there).
        with self.changed:
            op = self._operation(project, zone, operation)
            self.changed.wait_for(lambda: op["status"] == "DONE" or self.closing, self.operation_wait_timeout)
            return copy.deepcopy(op)

    def wait_global_operation(self, project: str, operation: str, req: Request) -> dict:
        return self.wait_operation(project, None, operation, req)

    def list_operations(self, project: str, zone: str, req: Request) -> dict:
        """zoneOperations.list: a zone's operations, with instances.list's filter and paging."""
        with self.lock:
            found = [copy.deepcopy(op) for (p, z, _), op in self.operations.items() if (p, z) == (project, zone)]
        return zonal_list("compute#operationList", f"projects/{project}/zones/{zone}/operations", found, req)

    def list_global_operations(self, project: str, req: Request) -> dict:
        with self.lock:
            found = [copy.deepcopy(op) for (p, z, _), op in self.operations.items() if p == project and z is None]
        return zonal_list("compute#operationList", f"projects/{project}/global/operations", found, req)

    def aggregated_list_operations(self, project: str, req: Request) -> dict:
        """globalOperations.aggregatedList, what `gcloud compute operations list` asks: every
        zone's operations and the global ones, grouped by scope ("zones/Z", "global")."""
        with self.lock:
            found = [copy.deepcopy(op) for (p, _, _), op in self.operations.items() if p == project]
        return aggregated_list("compute#operationAggregatedList", project, "operations", found, req)

    def _op_running(self, op: dict) -> None:
        with self.changed:
            op["status"] = "RUNNING"
            op["startTime"] = now_rfc3339()
            self.changed.notify_all()

    def _op_done(self, op: dict, error: tuple[str, str] | None = None, http_status: int | None = None) -> None:
        with self.changed:
            op["status"] = "DONE"
            op["progress"] = 100
            op["endTime"] = now_rfc3339()
            if error:
                code, message = error
                status = http_status or OPERATION_ERROR_STATUS.get(code, 400)
                op["error"] = {"errors": [{"code": code, "message": message}]}
                op["httpErrorStatusCode"] = status
                op["httpErrorMessage"] = errors.http_reason(status)
            self.changed.notify_all()

    def _finish_soon(self, op: dict, work=None) -> None:
        """Carry `op` to DONE on a worker thread, after `work()` if given (clients poll it)."""

        def run() -> None:
            self._op_running(op)
            try:
                if work is not None:
                    work()
            except Exception as exc:
                log.exception("%s failed", op["operationType"])
                self._op_done(op, ("INTERNAL_ERROR", f"localcloud: {exc}"), 500)
                return
            self._op_done(op)

        threading.Thread(target=run, daemon=True).start()

    def _sent(self, op: dict) -> dict:
        """The operation as its request is answered: copied before the worker can finish it."""
        answer = copy.deepcopy(op)
        self._finish_soon(op)
        return answer

    def get_region_operation(self, project: str, region: str, operation: str, req: Request) -> dict:
        with self.lock:
            return copy.deepcopy(self._operation(project, f"regions/{region}", operation))

    def wait_region_operation(self, project: str, region: str, operation: str, req: Request) -> dict:
        return self.wait_operation(project, f"regions/{region}", operation, req)
