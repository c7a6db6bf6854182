"""What every resource family of the compute emulator shares, with no state of its own: resource
links (`Link`, rendered with each request's base URL), ids, fingerprints and timestamps in the
API's formats, URL helpers, one API request as a handler sees it (`Request`), the checks of a
request body that several families make (schema, labels, metadata), and list paging.

Owns nothing that changes. Imports errors, filters and schema; every family module may import
it.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import re
import secrets

from . import errors
from .filters import parse_filter
from .schema import BodyValidator

NAME = re.compile(r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?")
_LABEL_KEY = re.compile(r"[a-z][a-z0-9_-]{0,62}")
_LABEL_VALUE = re.compile(r"[a-z0-9_-]{0,63}")
_URL_PREFIX = re.compile(r"^https?://[^/]+/compute/(?:v1|beta|alpha)/")


class Link:
    """A resource URL stored as a path; rendered with the base URL of each request."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path

    def __deepcopy__(self, memo: dict) -> Link:
        return self  # immutable

    def __repr__(self) -> str:
        return f"Link({self.path!r})"


def render(value: object, base: str) -> object:
    """A JSON-ready deep copy with every Link turned into `base + path`."""
    if isinstance(value, Link):
        return base + value.path
    if isinstance(value, dict):
        return {k: render(v, base) for k, v in value.items()}
    if isinstance(value, list):
        return [render(v, base) for v in value]
    return value


def now_rfc3339() -> str:
    return dt.datetime.now().astimezone().isoformat(timespec="milliseconds")


def rfc3339(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="milliseconds")


def parse_rfc3339(value: str) -> float | None:
    """Seconds since the epoch, or None unless `value` is an RFC 3339 timestamp with an offset."""
    if not re.fullmatch(r"\d{4}-\d\d-\d\d[Tt]\d\d:\d\d:\d\d(\.\d+)?([Zz]|[+-]\d\d:\d\d)", value):
        return None
    try:
        return dt.datetime.fromisoformat(value.upper().replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def new_id() -> str:
    # Compute Engine ids are unsigned 64-bit numbers, sent as decimal strings.
    return str(secrets.randbelow(2**63 - 10**18) + 10**18)


def new_fingerprint() -> str:
    return base64.b64encode(secrets.token_bytes(8)).decode()


def relative_url(value: str) -> str:
    """Strip `https://host/compute/v1/` from a resource URL (full or partial)."""
    return _URL_PREFIX.sub("", value).lstrip("/")


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


class Request:
    """What an API handler sees of one request."""

    def __init__(self, query: dict[str, list[str]], body: object, base: str) -> None:
        self.query = query
        self.body = body
        self.base = base  # "http://HOST:PORT/compute/v1/" as the client addressed us


def validated_body(req: Request, method: str, schema: str, field: str) -> dict:
    """The request's JSON body, checked against the discovery document's schema for `method`."""
    if req.body is None:
        raise errors.required_field("resource")
    BodyValidator(method).check(schema, req.body, field)
    assert isinstance(req.body, dict)
    return req.body


def stored_metadata(metadata: dict) -> dict:
    stored = {"kind": "compute#metadata", "fingerprint": new_fingerprint()}
    if metadata.get("items"):
        stored["items"] = copy.deepcopy(metadata["items"])
    return stored


def query_arg(query: dict, key: str) -> str | None:
    values = query.get(key)
    return values[-1] if values else None


def check_labels(labels: dict, field: str) -> None:
    if len(labels) > 64:
        raise errors.invalid_field_value(field, "", "Too many labels: at most 64.")
    for key, value in labels.items():
        if not _LABEL_KEY.fullmatch(key):
            raise errors.invalid_field_value(
                field,
                "",
                f"Label key '{key}' violates format constraints. The key must start with a "
                "lowercase character, can only contain lowercase letters, numeric characters, "
                "underscores and dashes. The key can be at most 63 characters long.",
            )
        if not _LABEL_VALUE.fullmatch(value):
            raise errors.invalid_field_value(
                field,
                "",
                f"Label value '{value}' violates format constraints. The value can only contain "
                "lowercase letters, numeric characters, underscores and dashes. The value can be "
                "at most 63 characters long.",
            )


def check_metadata(metadata: dict, field: str) -> None:
    items = metadata.get("items") or []
    seen = set()
    total = 0
    for i, item in enumerate(items):
        key = item.get("key")
        if key is None:
            raise errors.required_field(f"{field}.items[{i}].key")
        if key in seen:
            raise errors.invalid_field_value(f"{field}.items[{i}].key", key, "Duplicate metadata key.")
        seen.add(key)
        total += len(key) + len(item.get("value") or "")
    if total > 512 * 1024:
        raise errors.invalid_field_value(field, "", "Metadata is larger than 512 KB.")


def zonal_list(kind: str, path: str, resources: list[dict], req: Request) -> dict:
    """One page of a zone's resources of one collection (a *List)."""
    page, token = list_page(resources, req)
    result = {"kind": kind, "id": path, "selfLink": Link(path)}
    if page:
        result["items"] = page
    if token:
        result["nextPageToken"] = token
    return result


def aggregated_list(kind: str, project: str, collection: str, resources: list[dict], req: Request) -> dict:
    """One page of a project's resources of one collection, grouped by zone (an *AggregatedList)."""
    page, token = list_page(resources, req)
    items: dict[str, dict] = {}
    for resource in page:
        zone, region = resource.get("zone"), resource.get("region")
        if zone:
            scope = f"zones/{zone.path.rsplit('/', 1)[1]}"
        else:
            scope = f"regions/{region.path.rsplit('/', 1)[1]}" if region else "global"
        items.setdefault(scope, {collection: []})[collection].append(resource)
    path = f"projects/{project}/aggregated/{collection}"
    result = {"kind": kind, "id": path, "items": items, "selfLink": Link(path)}
    if token:
        result["nextPageToken"] = token
    return result


def list_page(resources: list[dict], req: Request) -> tuple[list[dict], str | None]:
    """Filter, order and page a list; the filter sees rendered (URL) values."""
    query = req.query
    predicate = parse_filter(query_arg(query, "filter"))
    resources = [r for r in resources if predicate(render(r, req.base))]
    order = (query_arg(query, "orderBy") or "name").split()
    if order[0] not in ("name", "creationTimestamp") or len(order) > 2 or order[1:] not in ([], ["asc"], ["desc"]):
        raise errors.invalid(f"Invalid value for field 'orderBy': '{query_arg(query, 'orderBy')}'. Unsupported.")
    resources.sort(key=lambda r: r.get(order[0], ""), reverse=order[1:] == ["desc"])
    try:
        max_results = int(query_arg(query, "maxResults") or 500)
        offset = int(base64.urlsafe_b64decode(query_arg(query, "pageToken") or "MA==").decode())
    except ValueError:
        raise errors.invalid("Invalid value for field 'pageToken' or 'maxResults'.") from None
    max_results = max(0, min(max_results, 500)) or 500
    page = resources[offset : offset + max_results]
    more = offset + max_results < len(resources)
    token = base64.urlsafe_b64encode(str(offset + max_results).encode()).decode() if more else None
    return page, token
