"""gs:// paths for the MaxText stand-in: the Cloud Storage JSON API, with urllib.

Only the local cloud's storage emulator is supported: its address comes from env
STORAGE_EMULATOR_HOST (which the local cloud's VMs have), and no credentials are sent.
"""

import json
import os
import urllib.error
import urllib.parse
import urllib.request

ENV = "STORAGE_EMULATOR_HOST"


class GcsError(OSError):
    pass


def is_gcs(path):
    return str(path).startswith("gs://")


def split(url):
    """gs://bucket/some/name -> ("bucket", "some/name")."""
    bucket, _, name = str(url)[len("gs://"):].partition("/")
    if not bucket:
        raise ValueError(f"not a gs:// object path: {url!r}")
    return bucket, name


def join(base, *parts):
    return "/".join([str(base).rstrip("/"), *(part.strip("/") for part in parts)])


def _endpoint():
    host = os.environ.get(ENV)
    if not host:
        raise GcsError(f"gs:// paths need ${ENV} (the local cloud's storage emulator, e.g. http://127.0.0.1:PORT); "
                       "the MaxText stand-in cannot reach Cloud Storage without it")
    return host if host.startswith(("http://", "https://")) else f"http://{host}"


def _call(method, path, query=None, data=None, headers=None):
    url = _endpoint() + path + ("?" + urllib.parse.urlencode(query) if query else "")
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = body[:500]
        raise GcsError(f"{method} {urllib.parse.unquote(path)}: {exc.code} {message}") from None


def _object_path(url):
    bucket, name = split(url)
    return f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}"


def write(url, data):
    """Upload `data` (bytes or str) as object `url`."""
    bucket, name = split(url)
    if isinstance(data, str):
        data = data.encode()
    _call("POST", f"/upload/storage/v1/b/{bucket}/o", {"uploadType": "media", "name": name}, data,
          {"Content-Type": "application/octet-stream"})


def read(url):
    """The content of object `url`, or None if there is no such object."""
    try:
        return _call("GET", _object_path(url), {"alt": "media"})
    except GcsError as err:
        if ": 404 " in str(err):
            return None
        raise


def exists(url):
    return read(url) is not None


def list_dirs(url):
    """The names of the "directories" right under `url` (prefixes with delimiter "/")."""
    bucket, name = split(url)
    prefix = name.rstrip("/") + "/" if name.strip("/") else ""
    names, token = [], None
    while True:
        query = {"prefix": prefix, "delimiter": "/", **({"pageToken": token} if token else {})}
        page = json.loads(_call("GET", f"/storage/v1/b/{bucket}/o", query))
        names += [p[len(prefix):].rstrip("/") for p in page.get("prefixes", [])]
        token = page.get("nextPageToken")
        if not token:
            return names
