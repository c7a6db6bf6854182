"""Cloud Storage JSON API (v1) emulator over plain HTTP: the parts gcloud storage,
google-cloud-storage, gcsfs and tensorstore use.

    /storage/v1/b[/BUCKET]                                 buckets insert, list, get, delete
    /storage/v1/b/BUCKET/storageLayout                     (gcloud asks before recursive copies)
    /storage/v1/b/BUCKET/o[/OBJECT]                        objects list, get (alt=media too),
                                                           patch, update, delete
    /storage/v1/b/B/o/O/{copyTo,rewriteTo}/b/B2/o/O2       copy, rewrite (done in one call)
    /storage/v1/b/B/o/O/compose                            compose
    /upload/storage/v1/b/B/o?uploadType=media|multipart|resumable
    /download/storage/v1/b/B/o/O?alt=media                 (Range requests too)
    /_localcloud/requests                                  GET: the request log; DELETE: clear it
    /_localcloud/faults                                    GET, POST: error injection rules and
                                                           IAM denials (a principal lacking a role)

Links in responses (selfLink, mediaLink, resumable session URLs) use the request's Host.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import secrets
import shutil
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

from .._daemon import RequestLog
from .iam import Bindings
from .store import GcsError, Store, check_preconditions, invalid, now_rfc3339

log = logging.getLogger(__name__)

_B = r"/b/(?P<bucket>[^/]+)"
_O = r"/o/(?P<object>[^/]+)"
ROUTES = [
    ("POST", rf"/storage/v1{_B}{_O}/(?P<op>copyTo|rewriteTo)/b/(?P<dbucket>[^/]+)/o/(?P<dobject>[^/]+)", "copy"),
    ("POST", rf"/storage/v1{_B}{_O}/compose", "compose"),
    ("GET", rf"/storage/v1{_B}/o/(?P<object>.+)", "get_object"),
    ("PATCH", rf"/storage/v1{_B}/o/(?P<object>.+)", "patch_object"),
    ("PUT", rf"/storage/v1{_B}/o/(?P<object>.+)", "update_object"),
    ("DELETE", rf"/storage/v1{_B}/o/(?P<object>.+)", "delete_object"),
    ("GET", rf"/download/storage/v1{_B}/o/(?P<object>.+)", "get_object"),
    ("GET", rf"/storage/v1{_B}/o", "list_objects"),
    ("POST", rf"(?:/resumable)?/upload/storage/v1{_B}/o", "upload"),
    ("PUT", rf"(?:/resumable)?/upload/storage/v1{_B}/o", "upload"),
    ("DELETE", rf"(?:/resumable)?/upload/storage/v1{_B}/o", "upload"),
    ("GET", rf"/storage/v1{_B}/storageLayout", "storage_layout"),
    ("GET", rf"/storage/v1{_B}", "get_bucket"),
    ("DELETE", rf"/storage/v1{_B}", "delete_bucket"),
    ("GET", r"/storage/v1/b", "list_buckets"),
    ("POST", r"/storage/v1/b", "insert_bucket"),
]
_ROUTES = [(method, re.compile(pattern + "/?"), name) for method, pattern, name in ROUTES]
_CONTENT_RANGE = re.compile(r"bytes (?:(\d+)-(\d+)|\*)/(\d+|\*)")


class Response:
    def __init__(self, status: int = 200, body: object = b"", headers: dict | None = None,
                 stream=None, length: int = 0) -> None:
        self.status, self.headers = status, dict(headers or {})
        self.stream, self.length = stream, length  # an open file: send `length` bytes from it
        if isinstance(body, (dict, list)):
            body = json.dumps(body, indent=1).encode()
            self.headers.setdefault("Content-Type", "application/json; charset=UTF-8")
        self.body = body


class Request:
    """One request; the body is read on demand (uploads stream it to a file)."""

    def __init__(self, method: str, target: str, headers, rfile, base: str) -> None:
        url = urlsplit(target)
        self.method, self.path, self.headers, self.base = method, url.path, headers, base
        self.query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        self._rfile, self.consumed = rfile, False

    def chunks(self):
        if self.consumed:
            return
        self.consumed = True
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            while size := int(self._rfile.readline().split(b";")[0].strip() or b"0", 16):
                yield self._rfile.read(size)
                self._rfile.readline()
            while self._rfile.readline().strip():  # trailers
                pass
            return
        left = int(self.headers.get("Content-Length") or 0)
        while left > 0:
            chunk = self._rfile.read(min(left, 1 << 20))
            if not chunk:
                raise ConnectionError("client closed the connection mid-body")
            left -= len(chunk)
            yield chunk

    def read(self) -> bytes:
        return b"".join(self.chunks())

    def json(self) -> dict:
        raw = self.read()
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError as exc:
            # Reason parseError for a body that is not JSON: the JSON API's status-codes page
            # (cloud.google.com/storage/docs/json_api/v1/status-codes); the detail is ours.
            raise GcsError(400, "parseError", f"Parse Error: {exc}") from None
        if not isinstance(body, dict):
            raise invalid("The request body must be a JSON object.")
        return body


class StorageApi:
    def __init__(self, store: Store, request_log: RequestLog) -> None:
        self.store, self.request_log = store, request_log
        self.sessions: dict[str, dict] = {}
        self.faults: list[dict] = []
        self.denials: list[dict] = []
        self.sessions_lock = threading.Lock()  # guards sessions and faults
        self.iam = Bindings()  # bound callers' permissions (iam.py)

    def handle(self, req: Request) -> Response:
        if req.path.startswith("/_localcloud/"):
            try:
                return self.control(req)
            except GcsError as exc:
                return Response(exc.code, exc.body())
        try:
            if self.faults and (fault := self._fault(req)):
                raise fault
            if self.denials and (denied := self._denied(req)):
                raise denied
            caller = self.iam.caller(req.headers.get("Authorization"))
            if missing := self.iam.missing(caller, req.method, req.path):
                what = "bucket" if missing.startswith("storage.buckets.") else "object"
                raise GcsError(
                    403, "forbidden",
                    f"{caller} does not have {missing} access to the Google "
                    f"Cloud Storage {what}. Permission '{missing}' denied on resource (or it may not exist).",
                )
            for method, pattern, name in _ROUTES:
                match = pattern.fullmatch(req.path)
                if match and method == req.method:
                    args = {k: unquote(v) for k, v in match.groupdict().items()}
                    response = getattr(self, name)(req, **args)
                    break
            else:
                # A path the emulator does not serve: 404 notFound in the API's shape; wording ours.
                raise GcsError(404, "notFound", f"Not Found: {req.method} {req.path}")
        except GcsError as exc:
            response = Response(exc.code, exc.body() if exc.code != 304 else b"")
        except ConnectionError:
            raise  # the client hung up mid-body: nobody to answer
        except Exception:
            log.error("unhandled error on %s %s:\n%s", req.method, req.path, traceback.format_exc())
            response = Response(500, GcsError(500, "backendError", "Internal error (localcloud).").body())
        self.request_log.append({"time": now_rfc3339(), "method": req.method, "path": req.path,
                                 "query": req.query, "status": response.status})
        return response

    def control(self, req: Request) -> Response:
        what = req.path.rstrip("/")
        if what == "/_localcloud/requests" and req.method in ("GET", "DELETE"):
            if req.method == "DELETE":
                self.request_log.clear()
            return Response(200, self.request_log.read() if req.method == "GET" else {})
        if what == "/_localcloud/iam/bindings" and req.method == "POST":  # iam.py's Bindings.bind
            body = req.json()
            if not {"member", "permissions"} <= set(body) <= {"member", "permissions", "token", "tokeninfo_url"}:
                raise invalid('Expected {"member", "permissions", "token"?, "tokeninfo_url"?}.')
            return Response(200, self.iam.bind(body))
        if what == "/_localcloud/faults" and req.method in ("GET", "POST"):
            if req.method == "POST":
                self._set_faults(req.json())
            with self.sessions_lock:
                return Response(200, {"rules": self.faults, "denials": self.denials})
        raise GcsError(404, "notFound", f"No control endpoint {req.method} {req.path}.")

    def _set_faults(self, body: dict) -> None:
        """{"rules": [{"method": "PUT", "path_regex": "...", "status": 503, "count": 1}]}, replacing
        the rules: a matching API request gets that error (count times, or always).
        "denials": [{"token": T, "principal": EMAIL, "bucket": B}] (replaced likewise; a list not
        given is kept): a
        request carrying `Authorization: Bearer T` may not create objects in bucket B, as when the
        account EMAIL has no role granting storage.objects.create on it."""
        denials = body.get("denials", [])
        for denial in denials if isinstance(denials, list) else [None]:
            if not isinstance(denial, dict) or set(denial) != {"token", "principal", "bucket"} or \
                    not all(isinstance(v, str) and v for v in denial.values()):
                raise invalid(f"Bad denial {denial!r}: keys token, principal, bucket (strings).")
        rules = body.get("rules", [])
        for rule in rules if isinstance(rules, list) else [None]:
            if not isinstance(rule, dict) or not set(rule) <= {"method", "path_regex", "status", "count"} or \
                    not isinstance(rule.get("status"), int) or not 400 <= rule["status"] <= 599:
                raise invalid(f"Bad fault rule {rule!r}: keys method, path_regex, status (400-599), count.")
            re.compile(rule.get("path_regex", ""))
        with self.sessions_lock:  # each list is replaced only when given
            if "rules" in body:
                self.faults = [dict(rule) for rule in rules]
            if "denials" in body:
                self.denials = [dict(denial) for denial in denials]

    # Object creation: uploads, and the copies and composes that write a new object.
    _CREATES = re.compile(r"/upload/storage/v1/b/(?P<bucket>[^/]+)/o|"
                          r"/storage/v1/b/[^/]+/o/[^/]+/(copyTo|rewriteTo)/b/(?P<target>[^/]+)/o/[^/]+|"
                          r"/storage/v1/b/(?P<composed>[^/]+)/o/[^/]+/compose")

    def _denied(self, req: Request) -> GcsError | None:
        """A create by a denied principal: 403 forbidden in the API's words. The message is the
        one Cloud Storage gives a principal without the permission, e.g. "<account> does not have
        storage.objects.create access to the Google Cloud Storage object. Permission
        'storage.objects.create' denied on resource (or it may not exist)." (googleapis/
        google-cloud-php#1206 for objects; the whole body, for buckets.create, in
        data-integrations/google-cloud#1503)."""
        match = self._CREATES.fullmatch(req.path) if req.method == "POST" else None
        if not match:
            return None
        bucket = unquote(match.group("bucket") or match.group("target") or match.group("composed"))
        token = (req.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        with self.sessions_lock:
            for denial in self.denials:
                if denial["token"] == token and denial["bucket"] == bucket:
                    return GcsError(
                        403, "forbidden",
                        f"{denial['principal']} does not have storage.objects.create access to the Google Cloud "
                        "Storage object. Permission 'storage.objects.create' denied on resource (or it may not exist).",
                    )
        return None

    def _fault(self, req: Request) -> GcsError | None:
        with self.sessions_lock:
            for rule in self.faults:
                if rule.get("method", req.method) == req.method and re.search(rule.get("path_regex", ""), req.path):
                    if "count" in rule:
                        rule["count"] -= 1
                        if rule["count"] <= 0:
                            self.faults.remove(rule)
                    # An injected fault (tests): the API's shape, reason backendError as the
                    # status-codes page gives 5xx; the message says it is localcloud's.
                    return GcsError(rule["status"], "backendError", f"localcloud: injected fault ({rule['status']}).")
        return None

    # ----- buckets

    def insert_bucket(self, req: Request) -> Response:
        return Response(200, self._bucket(self.store.create_bucket(req.json()), req))

    def list_buckets(self, req: Request) -> Response:
        prefix = req.query.get("prefix", "")
        items = [self._bucket(b, req) for name, b in sorted(self.store.buckets.items()) if name.startswith(prefix)]
        return Response(200, {"kind": "storage#buckets", "items": items})

    def get_bucket(self, req: Request, bucket: str) -> Response:
        return Response(200, self._bucket(self.store.bucket(bucket), req))

    def storage_layout(self, req: Request, bucket: str) -> Response:
        b = self.store.bucket(bucket)
        return Response(200, {"kind": "storage#storageLayout", "bucket": bucket, "location": b["location"],
                              "locationType": b["locationType"],
                              "hierarchicalNamespace": b.get("hierarchicalNamespace", {"enabled": False})})

    def delete_bucket(self, req: Request, bucket: str) -> Response:
        self.store.delete_bucket(bucket)
        return Response(204)

    def _bucket(self, resource: dict, req: Request) -> dict:
        return {**resource, "selfLink": f"{req.base}/storage/v1/b/{resource['name']}"}

    # ----- objects

    def resource(self, meta: dict, req: Request) -> dict:
        bucket, name, gen = meta["bucket"], meta["name"], meta["generation"]
        quoted = quote(name, safe="")
        out = {"kind": "storage#object", "id": f"{bucket}/{name}/{gen}",
               "selfLink": f"{req.base}/storage/v1/b/{bucket}/o/{quoted}",
               "mediaLink": f"{req.base}/download/storage/v1/b/{bucket}/o/{quoted}?generation={gen}&alt=media",
               **meta, "generation": str(gen), "metageneration": str(meta["metageneration"]),
               "size": str(meta["size"]), "timeStorageClassUpdated": meta["timeCreated"],
               "timeFinalized": meta["timeCreated"],
               "etag": base64.b64encode(f"{gen}/{meta['metageneration']}".encode()).decode()}
        return out

    def get_object(self, req: Request, bucket: str, object: str) -> Response:
        if req.query.get("alt", "json") == "json" and not req.path.startswith("/download/"):
            return Response(200, self.resource(self.store.get(bucket, object, req.query), req))
        meta, f = self.store.open(bucket, object, req.query)
        size = meta["size"]
        headers = {"Content-Type": meta.get("contentType", "application/octet-stream"),
                   "X-Goog-Generation": str(meta["generation"]), "X-Goog-Metageneration": str(meta["metageneration"]),
                   "X-Goog-Hash": ",".join(f"{k}={meta[h]}" for k, h in (("crc32c", "crc32c"), ("md5", "md5Hash"))
                                           if h in meta),
                   "X-Goog-Stored-Content-Length": str(size), "X-Goog-Stored-Content-Encoding": "identity",
                   "X-Goog-Storage-Class": "STANDARD", "Accept-Ranges": "bytes",
                   "ETag": f'"{meta.get("md5Hash") or meta["crc32c"]}"'}
        if meta.get("componentCount"):
            headers["X-Goog-Component-Count"] = str(meta["componentCount"])
        start, end = 0, size - 1
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", (req.headers.get("Range") or "").strip())
        if match and match.group(1) + match.group(2):
            if match.group(1):
                start = int(match.group(1))
                end = min(int(match.group(2)), size - 1) if match.group(2) else size - 1
            else:
                start = max(size - int(match.group(2)), 0)
            if start >= size or start > end:
                f.close()
                if size == 0 and start == 0:
                    return Response(200, b"", headers)
                # 416 requestedRangeNotSatisfiable: the status-codes page's reason for a Range
                # beyond the object.
                raise GcsError(416, "requestedRangeNotSatisfiable", "Request range not satisfiable")
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        f.seek(start)
        return Response(206 if "Content-Range" in headers else 200, headers=headers, stream=f,
                        length=max(end - start + 1, 0))

    def list_objects(self, req: Request, bucket: str) -> Response:
        q = req.query
        prefix, delimiter = q.get("prefix", ""), q.get("delimiter", "")
        start, end, token = q.get("startOffset", ""), q.get("endOffset"), q.get("pageToken")
        after = base64.urlsafe_b64decode(token.encode()).decode() if token else None
        glob = _glob_regex(q["matchGlob"]) if q.get("matchGlob") else None
        limit = min(int(q.get("maxResults") or 1000), 1000)
        trailing = q.get("includeTrailingDelimiter") == "true"
        names = self.store.list(bucket)
        items, prefixes, last, more = [], [], None, False
        for name in names:
            if not name.startswith(prefix) or name < start or (end and name >= end):
                continue
            if glob and not glob.fullmatch(name):
                continue
            key = name
            if delimiter and (cut := name.find(delimiter, len(prefix))) >= 0:
                key = name[: cut + len(delimiter)]
            # Keys (names, or the prefixes they collapse into) come in sorted order.
            if (after is not None and key <= after) or key == last:
                continue
            if len(items) + len(prefixes) >= limit:
                more = True
                break
            last = key
            if key != name:
                prefixes.append(key)
            elif delimiter and name.endswith(delimiter) and name != prefix:
                prefixes.append(key)  # "a/" is a prefix, and with includeTrailingDelimiter an item too
                if trailing:
                    items.append(name)
            else:
                items.append(name)
        out = {"kind": "storage#objects"}
        metas = []
        for name in items:
            try:
                metas.append(self.resource(self.store.get(bucket, name, read=False), req))
            except GcsError:  # deleted meanwhile
                pass
        if metas:
            out["items"] = metas
        if prefixes:
            out["prefixes"] = prefixes
        if more:
            out["nextPageToken"] = base64.urlsafe_b64encode(last.encode()).decode()
        return Response(200, out)

    def patch_object(self, req: Request, bucket: str, object: str) -> Response:
        return Response(200, self.resource(self.store.update(bucket, object, req.json(), req.query, replace=False), req))

    def update_object(self, req: Request, bucket: str, object: str) -> Response:
        return Response(200, self.resource(self.store.update(bucket, object, req.json(), req.query, replace=True), req))

    def delete_object(self, req: Request, bucket: str, object: str) -> Response:
        self.store.delete(bucket, object, req.query)
        return Response(204)

    def copy(self, req: Request, bucket: str, object: str, op: str, dbucket: str, dobject: str) -> Response:
        fields = req.json()
        source_query = {k.replace("Source", "", 1) if k.startswith("ifSource") else k: v
                        for k, v in req.query.items() if k.startswith("ifSource")}
        if "sourceGeneration" in req.query:
            source_query["generation"] = req.query["sourceGeneration"]
        meta = self.store.get(bucket, object, source_query, read=False)
        self.store.bucket(dbucket)
        if not any(fields.get(k) is not None for k in ("contentType", "metadata", "contentEncoding", "cacheControl")):
            fields = {**{k: meta[k] for k in meta if k in ("contentType", "metadata", "contentEncoding", "cacheControl",
                                                          "contentDisposition", "contentLanguage")}, **fields}
        tmp = self.store.link_data(bucket, meta)
        try:
            new = self.store.commit(dbucket, dobject, tmp, fields, req.query, meta.get("componentCount"), verify=False)
        finally:
            tmp.unlink(missing_ok=True)
        resource = self.resource(new, req)
        if op == "copyTo":
            return Response(200, resource)
        return Response(200, {"kind": "storage#rewriteResponse", "totalBytesRewritten": resource["size"],
                              "objectSize": resource["size"], "done": True, "resource": resource})

    def compose(self, req: Request, bucket: str, object: str) -> Response:
        body = req.json()
        sources = body.get("sourceObjects") or []
        if not 1 <= len(sources) <= 32:
            raise invalid("The number of source components provided (%d) must be between 1 and 32." % len(sources))
        tmp, components = self.store.temp_path(), 0
        try:
            with open(tmp, "wb") as out:
                for source in sources:
                    query = {k: str(v) for k, v in (source.get("objectPreconditions") or {}).items()}
                    if source.get("generation"):
                        query["generation"] = str(source["generation"])
                    meta, f = self.store.open(bucket, source.get("name", ""), query)
                    with f:
                        shutil.copyfileobj(f, out, 1 << 20)
                    components += meta.get("componentCount", 1)
            new = self.store.commit(bucket, object, tmp, body.get("destination") or {}, req.query, components, verify=False)
        finally:
            tmp.unlink(missing_ok=True)
        return Response(200, self.resource(new, req))

    # ----- uploads

    def upload(self, req: Request, bucket: str) -> Response:
        kind = req.query.get("uploadType")
        if "upload_id" in req.query:
            return self._resumable_put(req, bucket)
        if req.method != "POST":
            raise invalid("Upload requests must be POST, or target a resumable session.")
        self.store.bucket(bucket)
        if kind == "media":
            return self._finish(req, bucket, req.query.get("name"), req.chunks(),
                                {"contentType": req.headers.get("Content-Type")})
        if kind == "multipart":
            fields, data = _parse_multipart(req)
            return self._finish(req, bucket, fields.get("name") or req.query.get("name"), [data], fields)
        if kind == "resumable":
            fields = req.json()
            name = fields.get("name") or req.query.get("name")
            if not name:
                # A missing required parameter: 400 required "Required" (the status-codes page's
                # reason; the Login Required example there has the same form).
                raise GcsError(400, "required", "Required")
            check_preconditions(self.store.objects[bucket].get(name), req.query)
            fields.setdefault("contentType", req.headers.get("X-Upload-Content-Type"))
            upload_id = secrets.token_urlsafe(24)
            path = self.store.uploads / f"session-{upload_id}"
            path.touch()
            with self.sessions_lock:
                self.sessions[upload_id] = {"bucket": bucket, "name": name, "fields": fields, "path": path,
                                            "query": dict(req.query), "done": None, "lock": threading.Lock()}
            location = (f"{req.base}/upload/storage/v1/b/{bucket}/o?uploadType=resumable"
                        f"&name={quote(name, safe='')}&upload_id={upload_id}")
            return Response(200, headers={"Location": location, "X-GUploader-UploadID": upload_id})
        raise invalid(f"Invalid upload type: {kind!r} (media, multipart or resumable).")

    def _finish(self, req: Request, bucket: str, name: str | None, chunks, fields: dict) -> Response:
        if not name:  # as above
            raise GcsError(400, "required", "Required")
        tmp = self.store.temp_path()
        try:
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
            meta = self.store.commit(bucket, name, tmp, fields, req.query)
        finally:
            tmp.unlink(missing_ok=True)
        return Response(200, self.resource(meta, req))

    def _resumable_put(self, req: Request, bucket: str) -> Response:
        upload_id = req.query["upload_id"]
        with self.sessions_lock:
            session = self.sessions.get(upload_id)
        if session is None or session["bucket"] != bucket:
            # An unknown or expired session answers 404 (Cloud Storage's resumable-upload docs:
            # start a new session then); the message is ours.
            raise GcsError(404, "notFound", "No such upload session.")
        if req.method == "DELETE":
            with self.sessions_lock:
                self.sessions.pop(upload_id, None)
            session["path"].unlink(missing_ok=True)
            return Response(499)
        with session["lock"]:
            if session["done"] is not None:
                req.read()
                return Response(200, self.resource(session["done"], req))
            path: Path = session["path"]
            have = path.stat().st_size
            spec = (req.headers.get("Content-Range") or "").strip()
            match = _CONTENT_RANGE.fullmatch(spec) if spec else None
            if spec and not match:
                raise invalid(f"Failed to parse Content-Range header: {spec!r}")
            first = int(match.group(1)) if match and match.group(1) else 0
            total = int(match.group(3)) if match and match.group(3) != "*" else None
            if match and match.group(1) is None:  # "bytes */N": a status query, or the end
                req.read()
            else:
                if first > have:
                    # A chunk past what was persisted. Status, reason and wording are this
                    # emulator's: no public capture of Cloud Storage's answer was checked.
                    raise GcsError(503, "backendError", f"Chunk starts at {first}, {have} bytes persisted.")
                skip = have - first
                with open(path, "ab") as f:
                    for chunk in req.chunks():
                        if skip:
                            cut, skip = min(skip, len(chunk)), skip - min(skip, len(chunk))
                            chunk = chunk[cut:]
                        f.write(chunk)
                have = path.stat().st_size
                if not match:
                    total = have
            if total is None or have < total:
                headers = {"Range": f"bytes=0-{have - 1}"} if have else {}
                return Response(308, headers={**headers, "X-GUploader-UploadID": upload_id})
            if have > total:
                raise invalid(f"The upload has {have} bytes, more than the declared {total}.")
            meta = self.store.commit(bucket, session["name"], path, session["fields"], session["query"])
            session["done"] = meta
            path.unlink(missing_ok=True)
            return Response(200, self.resource(meta, req))


# ----- multipart and glob helpers -------------------------------------------------------------

class _Headers(dict):
    """Case-insensitive header lines of a multipart part."""

    def __init__(self, lines) -> None:
        super().__init__()
        for line in lines:
            if ":" in line:
                key, _, value = line.partition(":")
                self[key.strip().lower()] = value.strip()

    def get(self, key, default=None):
        return super().get(key.lower(), default)


def _boundary(content_type: str) -> bytes:
    match = re.search(r"boundary=(\"[^\"]+\"|'[^']+'|[^;\s]+)", content_type)
    if not match:
        raise invalid("Missing multipart boundary.")
    return match.group(1).strip("'\"").encode()


def _split_multipart(raw: bytes, boundary: bytes) -> list[tuple[_Headers, bytes]]:
    """The parts of a multipart body, with CRLF line ends or (as gcloud sends them) bare LF."""
    parts = []
    for chunk in raw.split(b"--" + boundary)[1:]:
        if chunk.startswith(b"--"):
            break
        eol = b"\r\n" if chunk.startswith(b"\r\n") else b"\n"
        rest = chunk[len(eol):]
        head, _, body = (b"", b"", rest[len(eol):]) if rest.startswith(eol) else rest.partition(eol + eol)
        body = body[: -len(eol)] if body.endswith(eol) else body
        parts.append((_Headers(head.decode(errors="replace").splitlines()), body))
    return parts


def _parse_multipart(req: Request) -> tuple[dict, bytes]:
    parts = _split_multipart(req.read(), _boundary(req.headers.get("Content-Type", "")))
    if len(parts) != 2:
        raise invalid(f"A multipart upload needs 2 parts (metadata, media), got {len(parts)}.")
    try:
        fields = json.loads(parts[0][1] or b"{}")
    except ValueError as exc:
        raise GcsError(400, "parseError", f"Parse Error: {exc}") from None
    fields.setdefault("contentType", parts[1][0].get("content-type"))
    return fields, parts[1][1]


def _glob_regex(pattern: str) -> re.Pattern:
    """matchGlob: ** any characters, * and ? not '/', [...] sets, {a,b} alternatives."""
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out, i = out + ".*", i + 2
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            close = pattern.find("]", i + 1)
            if close < 0:
                raise invalid(f"Invalid matchGlob: {pattern!r}")
            body = pattern[i + 1 : close]
            out += "[" + ("^" + body[1:] if body.startswith("!") else body) + "]"
            i = close
        elif c == "{":
            close = pattern.find("}", i)
            if close < 0:
                raise invalid(f"Invalid matchGlob: {pattern!r}")
            out += "(?:" + "|".join(re.escape(alt) for alt in pattern[i + 1 : close].split(",")) + ")"
            i = close
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out, re.S)


def _reason(status: int) -> str:
    return {200: "OK", 204: "No Content", 206: "Partial Content", 304: "Not Modified", 308: "Resume Incomplete",
            499: "Client Closed Request"}.get(status) or BaseHTTPRequestHandler.responses.get(status, ("",))[0]


# ----- HTTP -----------------------------------------------------------------------------------

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY: the response's headers and body go out as two writes, and with Nagle's algorithm
    # the second waits for the client's delayed ACK (~40 ms a request). Measured: 100 uploads of
    # 50 kB took 4.7 s, 0.33 s without; an Orbax checkpoint (~300 objects) took 14 s to save.
    disable_nagle_algorithm = True
    server_version = "localcloud-storage/1"
    api: StorageApi  # set on the subclass made by make_server

    def _serve(self) -> None:
        host = self.headers.get("Host") or "%s:%d" % self.server.server_address[:2]
        req = Request(self.command, self.path, self.headers, self.rfile, base=f"http://{host}")
        response = self.api.handle(req)
        if not req.consumed:
            self.close_connection = True  # the body was never read: this connection cannot go on
        self.send_response(response.status, _reason(response.status))
        for key, value in response.headers.items():
            self.send_header(key, value)
        length = response.length if response.stream is not None else len(response.body)
        self.send_header("Content-Length", str(length))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if response.stream is None:
            self.wfile.write(response.body)
            return
        with response.stream as f:
            left = response.length
            while left > 0:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    break
                self.wfile.write(chunk)
                left -= len(chunk)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

    def log_message(self, format: str, *args) -> None:
        log.debug("%s - %s", self.address_string(), format % args)


class StorageServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 128

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # a client that hung up (an aborted sliced download, a cancelled read)
        super().handle_error(request, client_address)


def make_server(state_dir: Path, host: str = "127.0.0.1", port: int = 0) -> StorageServer:
    api = StorageApi(Store(state_dir), RequestLog(state_dir / "requests.jsonl"))
    return StorageServer((host, port), type("BoundHandler", (Handler,), {"api": api}))
