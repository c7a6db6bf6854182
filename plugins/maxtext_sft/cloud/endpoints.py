"""A Google API endpoint set on the Google connection, in gcloud's `api_endpoint_overrides` format."""

from __future__ import annotations


def endpoint_override(hook, extra_field: str, api_path: str) -> str | None:
    """The connection extra `extra_field` (e.g. `https://host/compute/v1/`), checked; None when unset.

    gcloud's format ends with the API's path (`compute/v1/`, `storage/v1/`), so one value serves
    gcloud, the discovery client (which wants it whole) and the Cloud client libraries (which
    want the host root: strip `api_path`). An API whose discovery document has an empty
    servicePath (OS Login: rootUrl `https://oslogin.googleapis.com/`) takes `api_path` "": its
    value is the host root.
    """
    endpoint = hook._get_field(extra_field, None)
    if not endpoint:
        return None
    endpoint = endpoint.rstrip("/") + "/"
    if not endpoint.endswith("/" + api_path):
        raise ValueError(
            f"Connection {hook.gcp_conn_id!r}: {extra_field} must end with /{api_path} "
            f"(gcloud's api_endpoint_overrides format), got {endpoint!r}"
        )
    return endpoint
