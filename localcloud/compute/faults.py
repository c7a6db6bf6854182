"""The faults tests switch on (POST /_localcloud/faults): their kinds, validation and use counts,
and the error an http_errors rule answers a request with.

Owns: Faults (the rules), InsertFaults (the rules one instances.insert took), and the host key a
host_key_mismatch VM publishes. Imports errors and error_catalog; the instance family (instances,
lifecycle) and server.py act on what it holds.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import threading
import zlib

from . import errors
from .errors import ApiError
from .error_catalog import HTTP_ERROR_MESSAGES, HTTP_ERROR_REASONS, HTTP_ERROR_STATUS, INSTANCE_ERRORS, fill


class Faults:
    """Fault switches, replaced as a whole by POST /_localcloud/faults (GET shows what is left).

    The body maps each fault kind to one rule (a JSON object) or a list of rules. A rule may
    carry `count`: it applies to the next N matching calls, then switches off; without `count`
    it applies once (except `insert_fails_after_accept` and `max_run_duration_refused`, which then
    stay on until replaced).
    Rules of the per-instance kinds may carry `name_regex`: they only apply to instances whose
    name it matches (re.search). Unknown kinds, unknown keys and bad values are refused (400).

    Kinds:

    Presets (`"preset"`, see INSTANCE_ERRORS, where each shape's source is named): every class
    of instance-creation error, in the shape of the place the fault injects it:
    reservation_full, reservation_not_found, reservation_incompatible, org_policy,
    unsupported_tpu_configuration (CONDITION_NOT_MET; synchronously 412 conditionNotMet),
    zone_resource_pool_exhausted[_with_details] (503), quota_exceeded (QUOTA_EXCEEDED;
    synchronously 403 quotaExceeded, domain usageLimits), preemptible_tpu_quota_exceeded (the same,
    for the preemptible TPU v6e quota that Spot and flex-start TPU VMs use), permission_denied (PERMISSIONS_ERROR;
    synchronously 403 forbidden). Explicit code, reason, status or message override the preset's.

    insert_fails_after_accept  {"preset": "reservation_full"} or {"code": "ZONE_RESOURCE_POOL_EXHAUSTED",
                                "message": ..., "http_status": 503, "leave_instance": false, "count": N}
        instances.insert answers with an operation as usual, which then ends DONE with this
        error (httpErrorStatusCode from the preset or code, or `http_status`); the instance is
        removed, or left TERMINATED with no VM (`leave_instance`).

    http_errors  [{"method": "GET", "path_regex": "/instances/vm-1$", "status": 429,
                   "reason": "rateLimitExceeded", "message": ..., "retry_after": 1, "count": N}]
        A Compute API request whose method and path (re.search on the URL path, query excluded)
        match gets this error instead of being served, in the API's error body; `status` is
        400-599; reason and message default from the status (429: rateLimitExceeded, status
        RESOURCE_EXHAUSTED, a per-minute quota message; 503: backendError, UNAVAILABLE). A 429
        carries `Retry-After` (`retry_after` seconds, default 1; any status may set it).

    insert_rejected  {"preset": "quota_exceeded"} or
                     {"reason": "quotaExceeded", "status": 403, "message": ..., "name_regex", "count"}
        instances.insert of a valid body fails synchronously with this error (no instance, no
        operation), the preset's status, reason, domain and message. Without a fault, a real
        reservation that is missing in the zone, of another machine type or fully used fails the
        insert on its operation (see `ReservationResources.reservation_to_consume`); a fault is taken
        first, so it wins.

    operation_errors  {"operation": "insert" | "delete", "preset" (insert only), "code": "INTERNAL_ERROR",
                       "message": ..., "http_status": 500, "leave_instance": false, "name_regex", "count"}
        The call is accepted (an operation is returned), then the operation ends DONE with this
        error. insert: as insert_fails_after_accept. delete: the instance is not deleted; it keeps
        its status and its VM keeps running. Default code: insert ZONE_RESOURCE_POOL_EXHAUSTED,
        delete INTERNAL_ERROR; the message defaults to the real API's wording for the code.

    operation_hangs  {"operation": "insert" | "delete", "seconds": 30, "name_regex", "count"}
        The operation stays RUNNING for `seconds` (without `seconds`: until a POST of faults
        without operation_hangs clears it; that also ends a hang early), then goes on as usual
        (an operation_errors rule taken by the same call still applies). A hanging insert leaves
        the instance PROVISIONING; a hanging delete leaves it STOPPING with its VM still running.

    ssh_refused  {"seconds": 10, "name_regex", "count"}
        The next VM(s) created start sshd `seconds` after the instance became RUNNING: until
        then port 22 refuses connections (the guest booted late).

    ssh_banner_timeout  {"seconds": 10, "name_regex", "count"}
        The next VM(s) created accept TCP connections on port 22 but send no SSH banner for
        `seconds` after becoming RUNNING (a hung sshd, frozen with SIGSTOP); then sshd serves
        the queued connections and new ones as usual.

    flex_start_wait  {"seconds": 120, "name_regex", "count"}
        The next flex-start instance(s) (provisioningModel FLEX_START) find capacity `seconds`
        after their insert. With params.requestValidForDuration of 90 s or more the instance is
        PENDING meanwhile (no VM, no address in use by a process, nothing consumed) and its insert
        operation RUNNING; then it goes PROVISIONING, STAGING, RUNNING with its sshd as usual and
        the operation ends DONE. If `seconds` exceeds requestValidForDuration, at that expiry the
        instance is deleted and the operation ends DONE with ZONE_RESOURCE_POOL_EXHAUSTED (503).
        Without requestValidForDuration, or under 90 s, capacity must be there at once: the insert's
        operation fails so at once. `"expires": true`: no capacity comes, and the request expires
        after `seconds` as it would at the end of its requestValidForDuration (a test need not wait
        out the 90 s the API's shortest request lasts). Other provisioning models ignore the rule
        (it is not used up).

    max_run_duration_refused  {"provisioning_models": ["RESERVATION_BOUND"], "name_regex", "count"}
        instances.insert of a body whose scheduling has a maxRunDuration and one of these
        provisioning models (default: RESERVATION_BOUND) fails synchronously with 400 invalid
        "Invalid value for field 'resource.scheduling.maxRunDuration': '{ "seconds": "N"}'.
        max-run-duration for given provisioning model is not supported" (the shape's source:
        error_catalog.RUN_DURATION_NOT_SUPPORTED). Without `count` it stays on until replaced: it
        plays an API that never takes the field, not a passing fault. Bodies without the field pass.

    host_key_mismatch  {"name_regex", "count"}
        The next VM(s) created publish, in their guest attributes (hostkeys/), an Ed25519 host
        key that is not their sshd's: what a client sees when something else answers at the
        VM's address.

    first_boot_host_keys  {"seconds": 4, "publish_after": 1, "name_regex", "count"}
        The next VM(s) created change their host keys once during their first boot, as two real
        first-boot actions can: they serve and publish one set of keys (cloud-init's, made before
        sshd starts), then `seconds` after RUNNING the guest agent makes new keys of every type
        and renames them over the old files, so new connections meet them, and `publish_after`
        seconds later (default 1) the guest attributes show them. See guest_agent.py for the
        sources and the order.
    """

    PER_INSTANCE = {
        "insert_rejected", "operation_errors", "operation_hangs", "ssh_refused", "ssh_banner_timeout", "host_key_mismatch",
        "flex_start_wait", "max_run_duration_refused", "first_boot_host_keys",
    }
    OPERATIONS = ("insert", "delete")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: dict[str, list[dict]] = {}
        self._listed: set[str] = set()  # kinds given as a list of rules (shown back as a list)
        self._cleared: dict[str, int] = {}  # kind → how many POSTs came without it

    # -- validation, one rule at a time --

    @staticmethod
    def _keys(rule: dict, allowed: set[str]) -> None:
        unknown = set(rule) - allowed - {"count"}
        if unknown:
            raise ValueError(f"unknown settings {sorted(unknown)} (allowed: {sorted(allowed | {'count'})})")

    @staticmethod
    def _str(rule: dict, key: str, required: bool = False) -> None:
        if key not in rule:
            if required:
                raise ValueError(f"'{key}' is required")
            return
        if not isinstance(rule[key], str) or not rule[key]:
            raise ValueError(f"'{key}' must be a non-empty string")

    @staticmethod
    def _status(rule: dict, key: str, required: bool = False) -> None:
        value = rule.get(key)
        if value is None:
            if required:
                raise ValueError(f"'{key}' is required")
            return
        if not isinstance(value, int) or isinstance(value, bool) or not 400 <= value <= 599:
            raise ValueError(f"'{key}' must be an HTTP error status (400-599)")

    @staticmethod
    def _seconds(rule: dict, required: bool) -> None:
        value = rule.get("seconds")
        if value is None:
            if required:
                raise ValueError("'seconds' is required")
            return
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 24 * 3600:
            raise ValueError("'seconds' must be a number of seconds (0 < seconds <= 86400)")

    @staticmethod
    def _regex(rule: dict, key: str) -> None:
        if key in rule:
            Faults._str(rule, key)
            try:
                re.compile(rule[key])
            except re.error as exc:
                raise ValueError(f"'{key}' is not a regular expression: {exc}") from None

    @staticmethod
    def _operation(rule: dict) -> None:
        if rule.get("operation") not in Faults.OPERATIONS:
            raise ValueError(f"'operation' must be one of {list(Faults.OPERATIONS)}")

    @staticmethod
    def _preset(rule: dict) -> None:
        if "preset" in rule and rule["preset"] not in INSTANCE_ERRORS:
            raise ValueError(f"'preset' must be one of {sorted(INSTANCE_ERRORS)}")

    @staticmethod
    def _check_insert_fails_after_accept(rule: dict) -> None:
        Faults._keys(rule, {"preset", "code", "message", "leave_instance", "http_status"})
        Faults._preset(rule)
        Faults._str(rule, "code")
        Faults._str(rule, "message")
        Faults._status(rule, "http_status")
        if "leave_instance" in rule and not isinstance(rule["leave_instance"], bool):
            raise ValueError("leave_instance must be a boolean")

    @staticmethod
    def _check_http_errors(rule: dict) -> None:
        Faults._keys(rule, {"method", "path_regex", "status", "reason", "message", "retry_after"})
        Faults._status(rule, "status", required=True)
        if "method" in rule and rule["method"] not in ("GET", "POST", "PUT", "PATCH", "DELETE"):
            raise ValueError("'method' must be GET, POST, PUT, PATCH or DELETE")
        Faults._regex(rule, "path_regex")
        Faults._str(rule, "reason")
        Faults._str(rule, "message")
        retry_after = rule.get("retry_after")
        if retry_after is not None and (
            not isinstance(retry_after, int) or isinstance(retry_after, bool) or retry_after < 0
        ):
            raise ValueError("'retry_after' must be a whole number of seconds")

    @staticmethod
    def _check_insert_rejected(rule: dict) -> None:
        Faults._keys(rule, {"preset", "reason", "status", "message", "name_regex"})
        Faults._preset(rule)
        if "preset" not in rule:
            Faults._str(rule, "reason", required=True)
        Faults._str(rule, "reason")
        Faults._str(rule, "message")
        Faults._status(rule, "status")
        Faults._regex(rule, "name_regex")

    @staticmethod
    def _check_operation_errors(rule: dict) -> None:
        Faults._keys(rule, {"operation", "preset", "code", "message", "http_status", "leave_instance", "name_regex"})
        Faults._operation(rule)
        Faults._preset(rule)
        if "preset" in rule and rule["operation"] != "insert":
            raise ValueError("'preset' only applies to insert")
        Faults._str(rule, "code")
        Faults._str(rule, "message")
        Faults._status(rule, "http_status")
        Faults._regex(rule, "name_regex")
        if "leave_instance" in rule:
            if rule["operation"] != "insert":
                raise ValueError("'leave_instance' only applies to insert")
            if not isinstance(rule["leave_instance"], bool):
                raise ValueError("leave_instance must be a boolean")

    @staticmethod
    def _check_operation_hangs(rule: dict) -> None:
        Faults._keys(rule, {"operation", "seconds", "name_regex"})
        Faults._operation(rule)
        Faults._seconds(rule, required=False)
        Faults._regex(rule, "name_regex")

    @staticmethod
    def _check_sshd(rule: dict) -> None:
        Faults._keys(rule, {"seconds", "name_regex"})
        Faults._seconds(rule, required=True)
        Faults._regex(rule, "name_regex")

    @staticmethod
    def _check_flex_start_wait(rule: dict) -> None:
        Faults._keys(rule, {"seconds", "name_regex", "expires"})
        Faults._seconds(rule, required=True)
        Faults._regex(rule, "name_regex")
        if "expires" in rule and not isinstance(rule["expires"], bool):
            raise ValueError("'expires' must be a boolean")

    @staticmethod
    def _check_host_key_mismatch(rule: dict) -> None:
        Faults._keys(rule, {"name_regex"})
        Faults._regex(rule, "name_regex")

    @staticmethod
    def _check_max_run_duration_refused(rule: dict) -> None:
        Faults._keys(rule, {"provisioning_models", "name_regex"})
        Faults._regex(rule, "name_regex")
        models = rule.get("provisioning_models", ["RESERVATION_BOUND"])
        known = ("STANDARD", "SPOT", "FLEX_START", "RESERVATION_BOUND")
        if not isinstance(models, list) or not models or any(model not in known for model in models):
            raise ValueError(f"'provisioning_models' must be a non-empty list of {list(known)}")

    @staticmethod
    def _check_first_boot_host_keys(rule: dict) -> None:
        Faults._keys(rule, {"seconds", "publish_after", "name_regex"})
        Faults._seconds(rule, required=True)
        Faults._regex(rule, "name_regex")
        lag = rule.get("publish_after", 1)
        if not isinstance(lag, (int, float)) or isinstance(lag, bool) or not 0 <= lag <= 600:
            raise ValueError("'publish_after' must be a number of seconds (0 <= publish_after <= 600)")

    KINDS = {
        "insert_fails_after_accept": _check_insert_fails_after_accept,
        "http_errors": _check_http_errors,
        "insert_rejected": _check_insert_rejected,
        "operation_errors": _check_operation_errors,
        "operation_hangs": _check_operation_hangs,
        "ssh_refused": _check_sshd,
        "ssh_banner_timeout": _check_sshd,
        "host_key_mismatch": _check_host_key_mismatch,
        "flex_start_wait": _check_flex_start_wait,
        "max_run_duration_refused": _check_max_run_duration_refused,
        "first_boot_host_keys": _check_first_boot_host_keys,
    }
    # Kinds whose rules without `count` stay on until replaced (kept as it always was).
    STICKY = {"insert_fails_after_accept", "max_run_duration_refused"}

    def replace(self, settings: object) -> dict:
        if not isinstance(settings, dict):
            raise errors.invalid("Faults must be a JSON object.")
        rules: dict[str, list[dict]] = {}
        listed = set()
        for kind, value in settings.items():
            if kind not in self.KINDS:
                raise errors.invalid(f"Unknown fault '{kind}'. Known: {sorted(self.KINDS)}.")
            if isinstance(value, list):
                listed.add(kind)
            elif isinstance(value, dict):
                value = [value]
            else:
                raise errors.invalid(f"Fault '{kind}' must be a JSON object or a list of them.")
            rules[kind] = []
            for i, rule in enumerate(value):
                where = f"Fault '{kind}'" + (f" rule {i}" if kind in listed else "")
                if not isinstance(rule, dict):
                    raise errors.invalid(f"{where} must be a JSON object.")
                count = rule.get("count")
                if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
                    raise errors.invalid(f"{where}: count must be a positive integer.")
                try:
                    self.KINDS[kind](rule)
                except ValueError as exc:
                    raise errors.invalid(f"{where}: {exc}.") from None
                rule = copy.deepcopy(rule)
                if "count" not in rule and kind not in self.STICKY:
                    rule["count"] = 1
                rules[kind].append(rule)
            if not rules[kind]:
                del rules[kind]
        with self._lock:
            for kind in self.KINDS:
                if kind not in rules:
                    self._cleared[kind] = self._cleared.get(kind, 0) + 1
            self._rules = rules
            self._listed = listed
            return self._render()

    def _render(self) -> dict:
        return {
            kind: copy.deepcopy(rules if kind in self._listed else rules[0]) for kind, rules in self._rules.items()
        }

    def current(self) -> dict:
        with self._lock:
            return self._render()

    def cleared(self, kind: str) -> int:
        """How many times the faults were replaced by settings without `kind` (a hang ends then)."""
        with self._lock:
            return self._cleared.get(kind, 0)

    def take(self, kind: str, match=None, *, name: str | None = None, operation: str | None = None) -> dict | None:
        """The first rule of `kind` that applies, counting one use of it; None if none does.

        A rule applies if `match(rule)` (when given) is true, its `name_regex` finds `name` and
        its `operation` is `operation`.
        """
        with self._lock:
            rules = self._rules.get(kind) or []
            for rule in rules:
                if "operation" in rule and rule["operation"] != operation:
                    continue
                if "name_regex" in rule and (name is None or not re.search(rule["name_regex"], name)):
                    continue
                if match is not None and not match(rule):
                    continue
                taken = copy.deepcopy(rule)
                if "count" in rule:
                    rule["count"] -= 1
                    if rule["count"] <= 0:
                        rules.remove(rule)
                        if not rules:
                            del self._rules[kind]
                return taken
            return None

    def http_error(self, method: str, path: str) -> ApiError | None:
        """The error an http_errors rule injects into this API request, if one matches."""
        rule = self.take(
            "http_errors",
            lambda r: r.get("method", method) == method and re.search(r.get("path_regex", ""), path) is not None,
        )
        if rule is None:
            return None
        status = rule["status"]
        reason = rule.get("reason") or HTTP_ERROR_REASONS.get(status, "backendError" if status >= 500 else "invalid")
        project = re.search(r"/projects/([^/]+)", path)
        message = fill(
            rule.get("message") or HTTP_ERROR_MESSAGES.get(status) or f"localcloud: injected HTTP {status} error.",
            project=project.group(1) if project else "-",
            project_number=zlib.crc32(project.group(1).encode()) + 10**11 if project else 0,
        )
        retry_after = rule.get("retry_after", 1 if status == 429 else None)
        return ApiError(
            status,
            reason,
            message,
            status=HTTP_ERROR_STATUS.get(status),
            domain="usageLimits" if status == 429 else ("global" if status in HTTP_ERROR_STATUS else None),
            headers={"Retry-After": str(retry_after)} if retry_after is not None else None,
        )


@dataclasses.dataclass
class InsertFaults:
    """The fault rules one instances.insert took (see Faults)."""

    hang: dict | None = None
    hang_epoch: int = 0
    fail: dict | None = None
    ssh_refused: dict | None = None
    ssh_banner_timeout: dict | None = None
    first_boot_host_keys: dict | None = None


def unrelated_ed25519_key() -> str:
    """A fresh Ed25519 public key in the OpenSSH wire format, base64 (as guest attributes hold it)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    line = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH)
    return line.decode().split()[1]
