"""The compute emulator's HTTP server: /compute/v1/ requests routed to the emulator's handlers,
/v1/users/ ones to the OS Login API (localcloud/oslogin, its own log), POST /token to the OAuth
token endpoint of service-account keys (localcloud/iap/tokens.py), and the emulator's own
controls under /_localcloud/ (`ControlApi`; nothing there is part of the Compute Engine API).
Errors are answered in the API's shape; every API request is logged.

Owns: API_PREFIX, CONTROL_PREFIX, ROUTES (the one table of every API path, in match order),
dispatch, ControlApi, Handler, make_server. Imports emulator (ComputeEmulator), faults through
it, resources, catalog and errors; only the entry points (__init__, __main__) import it.
"""

from __future__ import annotations

import json
import logging
import re
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from ..iap import tokens as token_endpoint
from ..oslogin import api as os_login_api
from ..oslogin.store import OsLoginError
from . import catalog, errors
from .emulator import ComputeEmulator
from .errors import ApiError
from .resources import Request, now_rfc3339, render

log = logging.getLogger(__name__)

API_PREFIX = "/compute/v1/"
CONTROL_PREFIX = "/_localcloud/"

ROUTES = [
    ("GET", r"projects/(?P<project>[^/]+)", "get_project"),
    ("POST", r"projects/(?P<project>[^/]+)/setCommonInstanceMetadata", "set_common_instance_metadata"),
    ("GET", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)", "get_zone"),
    ("GET", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/instances", "list_instances"),
    ("POST", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/instances", "insert_instance"),
    ("GET", r"projects/(?P<project>[^/]+)/aggregated/instances", "aggregated_list_instances"),
    ("GET", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/instances/(?P<instance>[^/]+)", "get_instance"),
    ("DELETE", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/instances/(?P<instance>[^/]+)", "delete_instance"),
    ("POST", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/instances/(?P<instance>[^/]+)/setMetadata", "set_metadata"),
    ("POST", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/instances/(?P<instance>[^/]+)/stop", "stop_instance"),
    ("GET", r"projects/(?P<project>[^/]+)/global/images", "list_images"),
    ("POST", r"projects/(?P<project>[^/]+)/global/images", "insert_image"),
    ("GET", r"projects/(?P<project>[^/]+)/global/images/family/(?P<family>[^/]+)", "get_image_from_family"),
    ("GET", r"projects/(?P<project>[^/]+)/global/images/(?P<image>[^/]+)", "get_image"),
    ("DELETE", r"projects/(?P<project>[^/]+)/global/images/(?P<image>[^/]+)", "delete_image"),
    (
        "GET",
        r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/instances/(?P<instance>[^/]+)/getGuestAttributes",
        "get_guest_attributes",
    ),
    ("GET", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/reservations", "list_reservations"),
    ("GET", r"projects/(?P<project>[^/]+)/aggregated/reservations", "aggregated_list_reservations"),
    (
        "GET",
        r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/reservations/(?P<reservation>[^/]+)",
        "get_reservation",
    ),
    ("GET", r"projects/(?P<project>[^/]+)/global/networks/(?P<network>[^/]+)", "get_network"),
    ("GET", r"projects/(?P<project>[^/]+)/regions/(?P<region>[^/]+)/subnetworks/(?P<subnetwork>[^/]+)", "get_subnetwork"),
    ("GET", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/operations", "list_operations"),
    ("GET", r"projects/(?P<project>[^/]+)/aggregated/operations", "aggregated_list_operations"),
    ("GET", r"projects/(?P<project>[^/]+)/global/operations", "list_global_operations"),
    ("GET", r"projects/(?P<project>[^/]+)/global/operations/(?P<operation>[^/]+)", "get_global_operation"),
    ("POST", r"projects/(?P<project>[^/]+)/global/operations/(?P<operation>[^/]+)/wait", "wait_global_operation"),
    ("GET", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/operations/(?P<operation>[^/]+)", "get_operation"),
    ("POST", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/operations/(?P<operation>[^/]+)/wait", "wait_operation"),
]

# Multi-host TPU slices (groups.py) and their regional operations.
_P = r"projects/(?P<project>[^/]+)"
ROUTES += [
    ("POST", _P + r"/regions/(?P<region>[^/]+)/resourcePolicies", "insert_resource_policy"),
    ("GET", _P + r"/regions/(?P<region>[^/]+)/resourcePolicies/(?P<name>[^/]+)", "get_resource_policy"),
    ("DELETE", _P + r"/regions/(?P<region>[^/]+)/resourcePolicies/(?P<name>[^/]+)", "delete_resource_policy"),
    ("POST", _P + r"/global/instanceTemplates", "insert_global_template"),
    ("GET", _P + r"/global/instanceTemplates/(?P<name>[^/]+)", "get_global_template"),
    ("DELETE", _P + r"/global/instanceTemplates/(?P<name>[^/]+)", "delete_global_template"),
    ("POST", _P + r"/regions/(?P<region>[^/]+)/instanceTemplates", "insert_region_template"),
    ("GET", _P + r"/regions/(?P<region>[^/]+)/instanceTemplates/(?P<name>[^/]+)", "get_region_template"),
    ("DELETE", _P + r"/regions/(?P<region>[^/]+)/instanceTemplates/(?P<name>[^/]+)", "delete_region_template"),
    ("POST", _P + r"/zones/(?P<zone>[^/]+)/instanceGroupManagers", "insert_group"),
    ("GET", _P + r"/zones/(?P<zone>[^/]+)/instanceGroupManagers/(?P<name>[^/]+)", "get_group"),
    ("DELETE", _P + r"/zones/(?P<zone>[^/]+)/instanceGroupManagers/(?P<name>[^/]+)", "delete_group"),
    (
        "POST",
        _P + r"/zones/(?P<zone>[^/]+)/instanceGroupManagers/(?P<name>[^/]+)/listManagedInstances",
        "list_managed_instances",
    ),
    (
        "POST",
        _P + r"/zones/(?P<zone>[^/]+)/instanceGroupManagers/(?P<name>[^/]+)/recreateInstances",
        "recreate_instances",
    ),
    ("GET", _P + r"/zones/(?P<zone>[^/]+)/autoscalers", "list_autoscalers"),
    ("GET", _P + r"/regions/(?P<region>[^/]+)/operations/(?P<operation>[^/]+)", "get_region_operation"),
    ("POST", _P + r"/regions/(?P<region>[^/]+)/operations/(?P<operation>[^/]+)/wait", "wait_region_operation"),
]
_COMPILED = [(m, re.compile(p), h) for m, p, h in ROUTES]


def dispatch(
    emulator: ComputeEmulator, method: str, path: str, req: Request, caller: str | None = None
) -> tuple[int, object]:
    """Route one /compute/v1/ request of `caller` (a token's service account, None for others:
    iam.py checks a bound one); returns (status, payload with Links)."""
    rest = path[len(API_PREFIX) :]
    for route_method, pattern, handler in _COMPILED:
        m = pattern.fullmatch(rest)
        if m and route_method == method:
            params = {k: unquote(v) for k, v in m.groupdict().items()}
            if "zone" in params and handler != "get_zone" and not catalog.known_zone(params["zone"]):
                raise errors.unknown_zone(params["zone"])
            # The resource a refusal names: the request's, an insert's new resource by its name.
            name = req.body.get("name") if method == "POST" and isinstance(req.body, dict) else None
            resource = unquote(rest) + (f"/{name}" if handler.startswith("insert_") and name else "")
            emulator.iam.check(caller, handler, req.body, resource)
            return 200, getattr(emulator, handler)(req=req, **params)
    raise ApiError(404, "notFound", f"The requested URL {path} was not found on this server (localcloud).")


class ControlApi:
    """/_localcloud/: the emulator's own controls (never part of the Compute Engine API)."""

    def __init__(self, emulator: ComputeEmulator) -> None:
        self.emulator = emulator

    def dispatch(self, method: str, path: str, body: object) -> tuple[int, object]:
        emulator = self.emulator
        what = path[len(CONTROL_PREFIX) :].rstrip("/")
        if what == "requests" and method == "GET":
            return 200, emulator.request_log.read()
        if what == "requests" and method == "DELETE":
            emulator.request_log.clear()
            return 200, {}
        if what == "oslogin/requests" and method == "GET":  # the OS Login API's own log
            return 200, emulator.os_login_request_log.read()
        if what == "oslogin/requests" and method == "DELETE":
            emulator.os_login_request_log.clear()
            return 200, {}
        if what == "faults" and method == "POST":
            return 200, emulator.set_faults(body)
        if what == "faults" and method == "GET":
            return 200, emulator.faults.current()
        if what == "vms" and method == "GET":
            return 200, emulator.vms()
        if (m := re.fullmatch(r"vms/([^/]+)/terminate", what)) and method == "POST":
            # {"action": "DELETE" | "STOP", "project"?: ..., "zone"?: ...}: as the cloud does it.
            body = body if body is not None else {}
            if not isinstance(body, dict) or set(body) - {"action", "project", "zone"}:
                raise ApiError(400, "invalid", 'Expected {"action": "DELETE" | "STOP", "project"?, "zone"?}.')
            name = unquote(m.group(1))
            return 200, emulator.terminate(name, body.get("action", "DELETE"), body.get("project"), body.get("zone"))
        if (m := re.fullmatch(r"vms/([^/]+)/preempt", what)) and method == "POST":
            # {"project"?, "zone"?, "soft_off_seconds"?: 30}: preempt a Spot VM as the cloud does.
            body = body if body is not None else {}
            if not isinstance(body, dict) or set(body) - {"project", "zone", "soft_off_seconds"}:
                raise ApiError(400, "invalid", 'Expected {"project"?, "zone"?, "soft_off_seconds"?: 30}.')
            return 200, emulator.preempt(
                unquote(m.group(1)), body.get("project"), body.get("zone"), body.get("soft_off_seconds", 30.0)
            )
        if (m := re.fullmatch(r"vms/([^/]+)/host-event", what)) and method == "POST":
            # {"event": "compute.instances.hostError" | "...terminateOnHostMaintenance", "project"?, "zone"?}.
            if not isinstance(body, dict) or "event" not in body or set(body) - {"event", "project", "zone"}:
                raise ApiError(400, "invalid", 'Expected {"event", "project"?, "zone"?}.')
            return 200, emulator.host_event(unquote(m.group(1)), body["event"], body.get("project"), body.get("zone"))
        if (m := re.fullmatch(r"vms/([^/]+)/sshd", what)) and method == "POST":
            # {"paused": true | false}: freeze a running VM's sshd (no banner) or let it go on.
            if not isinstance(body, dict) or set(body) != {"paused"} or not isinstance(body["paused"], bool):
                raise ApiError(400, "invalid", 'Expected {"paused": true | false}.')
            return 200, emulator.pause_sshd(unquote(m.group(1)), body["paused"])
        if what == "reservations" and method == "POST":
            # {"project", "zone", "name", "count", "machine_type"}: create or change a reservation.
            return 200, emulator.set_reservation(body)
        if what == "networks" and method == "POST":
            # {"project", "name", "auto", "subnetworks"?: [{"region", "name", "ip_cidr_range"}]}.
            return 200, emulator.set_network(body)
        if what == "iam/bindings" and method == "POST":
            # {"member": "serviceAccount:EMAIL", "permissions": [...] | null}: what the member may do
            # through this API from now on (iam.py), null: no longer checked.
            if not isinstance(body, dict) or set(body) != {"member", "permissions"}:
                raise ApiError(400, "invalid", 'Expected {"member", "permissions"}.')
            return 200, emulator.iam.bind(body["member"], body["permissions"])
        if what == "iap/service-accounts" and method == "POST":
            # {"email", "public_key_pem"}: a service account whose key the token endpoint accepts.
            if not isinstance(body, dict) or set(body) != {"email", "public_key_pem"}:
                raise ApiError(400, "invalid", 'Expected {"email", "public_key_pem"}.')
            return 200, emulator.tokens.add_service_account(body["email"], body["public_key_pem"])
        if what == "iap/tunnel-users" and method in ("POST", "DELETE"):
            # {"project", "member": "serviceAccount:EMAIL"}: grant (POST) or revoke the Tunnel User role.
            if not isinstance(body, dict) or set(body) != {"project", "member"}:
                raise ApiError(400, "invalid", 'Expected {"project", "member"}.')
            change = emulator.iap_policy.grant if method == "POST" else emulator.iap_policy.revoke
            return 200, change(body["project"], body["member"])
        if what == "iap/requests" and method == "GET":  # the relay's log: who tunnelled where
            return 200, emulator.iap_request_log.read()
        if what == "iap/requests" and method == "DELETE":
            emulator.iap_request_log.clear()
            return 200, {}
        if what == "first-boot" and method == "POST":
            # {"cloud_init_seconds": S, "dpkg_lock_seconds": S}: what the next VMs' boots go through.
            return 200, emulator.set_first_boot(body)
        if what == "images" and method == "POST":  # {"PROJECT/FAMILY": "/abs/image/dir"}, merged
            if not isinstance(body, dict) or not all(isinstance(v, str) and v.startswith("/") for v in body.values()):
                raise ApiError(400, "invalid", "Expected {\"PROJECT/FAMILY\": \"/absolute/image/dir\"}.")
            return 200, emulator.add_base_images(body)
        raise ApiError(404, "notFound", f"No control endpoint {method} {path}.")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # see localcloud/storage/server.py
    server_version = "localcloud-compute/1"
    emulator: ComputeEmulator  # set on the subclass made by make_server
    control: ControlApi

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def _handle(self, method: str) -> None:
        url = urlsplit(self.path)
        path = url.path
        query = parse_qs(url.query, keep_blank_values=True)
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        host = self.headers.get("Host") or "%s:%d" % self.server.server_address[:2]
        if path == token_endpoint.PATH and method == "POST":  # a form, not JSON
            status, payload = self.emulator.tokens.grant(raw)
            self._answer(status, json.dumps(payload).encode())
            return
        if path == token_endpoint.TOKENINFO_PATH and method == "GET":
            status, payload = self.emulator.tokens.tokeninfo((query.get("access_token") or [""])[0])
            self._answer(status, json.dumps(payload).encode())
            return
        if (m := re.fullmatch(r"/v1/projects/([^/:]+):testIamPermissions", path)) and method == "POST":
            status, payload = self._test_iam_permissions(unquote(m.group(1)), raw)
            self._answer(status, json.dumps(payload).encode())
            return
        base = f"http://{host}{API_PREFIX}"
        body: object = None
        extra_headers: dict[str, str] = {}
        try:
            if raw.strip():
                try:
                    body = json.loads(raw)
                except ValueError as exc:
                    body = raw.decode(errors="replace")
                    raise errors.bad_payload(f"Invalid JSON payload received. {exc}.", "") from None
            if path.startswith(CONTROL_PREFIX):
                status, payload = self.control.dispatch(method, path, body)
            elif path.startswith(os_login_api.PREFIX):
                self._os_login(method, path, query, body)
                return
            elif path.startswith(API_PREFIX):
                if fault := self.emulator.faults.http_error(method, path):
                    raise fault
                status, payload = dispatch(self.emulator, method, path, Request(query, body, base), self._caller())
            else:
                raise ApiError(404, "notFound", f"The requested URL {path} was not found on this server.")
        except ApiError as exc:
            status, payload = exc.code, exc.body()
            extra_headers = exc.headers
        except Exception:
            log.error("unhandled error on %s %s:\n%s", method, self.path, traceback.format_exc())
            status, payload = 500, ApiError(500, "backendError", "Internal error (localcloud).").body()
        if not path.startswith(CONTROL_PREFIX):
            # Logged before answering: a client that got its answer finds its request logged.
            self.emulator.request_log.append(
                {
                    "time": now_rfc3339(),
                    "method": method,
                    "path": path,
                    "query": {k: v[0] if len(v) == 1 else v for k, v in query.items()},
                    "body": body,
                    "status": status,
                }
            )
        data = json.dumps(render(payload, base), indent=1).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        for name, value in extra_headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _os_login(self, method: str, path: str, query: dict, body: object) -> None:
        """A request to the OS Login API (localcloud/oslogin: another API on this server, its
        own request log with the caller's User-Agent, its own error shape)."""
        try:
            status, payload = os_login_api.dispatch(self.emulator.os_login, method, path, query, body)
        except OsLoginError as exc:
            status, payload = exc.code, exc.body()
        self.emulator.os_login_request_log.append({
            "time": now_rfc3339(), "method": method, "path": path,
            "query": {k: v[0] if len(v) == 1 else v for k, v in query.items()},
            "body": body, "status": status, "user_agent": self.headers.get("User-Agent", ""),
            # The Cloud client libraries' own header: their client_info's user agent goes there.
            "api_client": self.headers.get("x-goog-api-client", ""),
        })
        self._answer(status, json.dumps(payload).encode())

    def _caller(self) -> str | None:
        """The service account whose token the request carries (None: no token this cloud issued)."""
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        return self.emulator.tokens.identity(token.strip()) if scheme.lower() == "bearer" else None

    def _test_iam_permissions(self, project: str, raw: bytes) -> tuple[int, dict]:
        """Resource Manager v1 projects.testIamPermissions, for the one permission this cloud's IAM
        knows (IAP's tunnel, localcloud/iap/relay.py): the caller's (a token the token endpoint
        issued) subset of the asked permissions, {} for none. An invalid token gets the 401 every
        Google API answers (google.rpc UNAUTHENTICATED)."""
        email = self._caller()
        if email is None:
            return 401, {"error": {"code": 401, "status": "UNAUTHENTICATED", "message": (
                "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie "
                "or other valid authentication credential.")}}
        asked = (json.loads(raw or b"{}") or {}).get("permissions") or []
        held = [p for p in asked if p == "iap.tunnelInstances.accessViaIAP" and self.emulator.iap_policy.allows(project, email)]
        return 200, ({"permissions": held} if held else {})

    def _answer(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:
        log.debug("%s - %s", self.address_string(), format % args)


class EmulatorServer(ThreadingHTTPServer):
    daemon_threads = True
    # Do not join request threads on close: an operation `wait` may be parked for minutes.
    block_on_close = False


def make_server(emulator: ComputeEmulator, host: str = "127.0.0.1", port: int = 0) -> EmulatorServer:
    handler = type("BoundHandler", (Handler,), {"emulator": emulator, "control": ControlApi(emulator)})
    return EmulatorServer((host, port), handler)
