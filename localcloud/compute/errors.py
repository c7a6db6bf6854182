"""Errors with the body shape of the Compute Engine v1 API.

Two families exist in the real API and clients parse both:
- resource errors from Compute Engine itself (`notFound`, `alreadyExists`, `invalid`, ...):
  `{"error": {"code", "message", "errors": [{"message", "domain": "global", "reason"}]}}`;
- request-decoding errors from Google's front end (unknown field, wrong JSON type), which
  also carry `status` and a `google.rpc.BadRequest` detail.
"""

from __future__ import annotations

from http import HTTPStatus


class ApiError(Exception):
    """An error answer: HTTP status plus the JSON body the real API would send."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        location: str | None = None,
        location_type: str | None = None,
        status: str | None = None,
        field: str | None = None,
        domain: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.location = location
        self.location_type = location_type
        self.status = status
        self.field = field
        self.domain = domain
        self.headers = dict(headers or {})  # extra response headers (Retry-After)

    def body(self) -> dict:
        item = {"message": self.message, "domain": self.domain or "global", "reason": self.reason}
        if self.location:
            item["location"] = self.location
            item["locationType"] = self.location_type or "parameter"
        error: dict = {"code": self.code, "message": self.message, "errors": [item]}
        if self.status:
            error["status"] = self.status
            if self.domain is None:
                item.pop("domain")
        if self.field:
            error["details"] = [
                {
                    "@type": "type.googleapis.com/google.rpc.BadRequest",
                    "fieldViolations": [{"field": self.field, "description": self.message}],
                }
            ]
        return {"error": error}


def not_found(resource_path: str) -> ApiError:
    return ApiError(404, "notFound", f"The resource '{resource_path}' was not found")


def already_exists(resource_path: str) -> ApiError:
    return ApiError(409, "alreadyExists", f"The resource '{resource_path}' already exists")


def not_ready(resource_path: str) -> ApiError:
    return ApiError(400, "resourceNotReady", f"The resource '{resource_path}' is not ready")


def invalid(message: str) -> ApiError:
    return ApiError(400, "invalid", message)


def invalid_field_value(field: str, value: object, why: str) -> ApiError:
    shown = "" if value is None else value
    return invalid(f"Invalid value for field '{field}': '{shown}'. {why}")


def required_field(field: str) -> ApiError:
    return ApiError(400, "required", f"Required field '{field}' not specified")


def bad_payload(message: str, field: str) -> ApiError:
    """A request-decoding error as Google's front end words it."""
    return ApiError(400, "invalid", message, status="INVALID_ARGUMENT", field=field)


def fingerprint_mismatch() -> ApiError:
    return ApiError(
        412,
        "conditionNotMet",
        "Supplied fingerprint does not match current metadata fingerprint.",
        location="If-Match",
        location_type="header",
    )


def http_reason(code: int) -> str:
    """Operation.httpErrorMessage is the upper-case reason phrase ("SERVICE UNAVAILABLE")."""
    try:
        return HTTPStatus(code).phrase.upper()
    except ValueError:
        return "ERROR"
