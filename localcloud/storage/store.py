"""The storage emulator's buckets and objects: files under the state dir, JSON sidecars.

Layout, `STATE_DIR/`:
    buckets/BUCKET/bucket.json          the bucket resource
    buckets/BUCKET/objects/KEY.json     one object's metadata (KEY = sha256 of the name)
    buckets/BUCKET/objects/KEY-GEN.data its content; immutable once written (a new
                                        generation is a new file, so copies are hard links)
    uploads/                            resumable sessions' data and upload temp files (a
                                        restart drops them, and the sessions with them)

Only the live generation of an object is kept (buckets have no versioning). Everything is
loaded into memory at start; one lock orders every change.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import os
import re
import secrets
import threading
import time
from pathlib import Path

try:
    import google_crc32c
except ImportError:  # pragma: no cover - the project venv has it
    google_crc32c = None

_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]")
# Fields a client may set on an object (uploads, patch, update, copy, compose).
WRITABLE = ("contentType", "contentEncoding", "contentDisposition", "contentLanguage", "cacheControl",
            "customTime", "metadata", "storageClass")


class GcsError(Exception):
    """An error answer in the JSON API's format: {"error": {"code", "message", "errors":
    [{"message", "domain": "global", "reason"}]}} (cloud.google.com/storage/docs/json_api/v1/
    status-codes; the body google-api-core's exceptions.from_http_response reads; a 409 bucket
    delete in kestra-io/plugin-gcp#321 shows it whole). Where each error's wording was seen is noted next to it; errors of emulator-only
    control paths and injected faults say "localcloud"."""

    def __init__(self, code: int, reason: str, message: str, **extra: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.extra = code, reason, message, extra

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message,
                          "errors": [{"message": self.message, "domain": "global", "reason": self.reason, **self.extra}]}}


def not_found_object(bucket: str, name: str) -> GcsError:
    # google-cloud-storage's NotFound for a missing object reads "404 GET ...: No such object:
    # BUCKET/NAME" (the JSON API's 404 notFound).
    return GcsError(404, "notFound", f"No such object: {bucket}/{name}")


def not_found_bucket() -> GcsError:
    # The JSON API's 404 for a missing bucket (S3's wording, which Cloud Storage shares).
    return GcsError(404, "notFound", "The specified bucket does not exist.")


def condition_not_met(location: str = "If-Match") -> GcsError:
    # 412 conditionNotMet with this message (the JSON API's "HTTP status and error codes" page,
    # cloud.google.com/storage/docs/json_api/v1/status-codes; a public GCS client's test fixture
    # quotes the body). locationType/location name the failed precondition the way that page's
    # examples name a header parameter ("locationType": "header", "location": "Authorization").
    return GcsError(412, "conditionNotMet", "At least one of the pre-conditions you specified did not hold.",
                    locationType="header", location=location)


def invalid(message: str) -> GcsError:
    return GcsError(400, "invalid", message)


def now_rfc3339() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# ----- hashes ---------------------------------------------------------------------------------

def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


class Crc32c:
    """Incremental CRC32C (Castagnoli), the C extension when present."""

    _table: list[int] | None = None

    def __init__(self) -> None:
        self._c = google_crc32c.Checksum() if google_crc32c else None
        self._value = 0

    def update(self, data: bytes) -> None:
        if self._c is not None:
            self._c.update(data)
            return
        table = Crc32c._table = Crc32c._table or _crc32c_table()
        crc = self._value ^ 0xFFFFFFFF
        for byte in data:
            crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
        self._value = crc ^ 0xFFFFFFFF

    def b64(self) -> str:
        raw = self._c.digest() if self._c is not None else self._value.to_bytes(4, "big")
        return base64.b64encode(raw).decode()


def file_hashes(path: Path) -> tuple[str, str, int]:
    """(md5 base64, crc32c base64, size) of a file."""
    md5, crc, size = hashlib.md5(), Crc32c(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            md5.update(chunk)
            crc.update(chunk)
            size += len(chunk)
    return base64.b64encode(md5.digest()).decode(), crc.b64(), size


# ----- preconditions --------------------------------------------------------------------------

def check_preconditions(meta: dict | None, query: dict, prefix: str = "", read: bool = False) -> None:
    """ifGenerationMatch & co. (`prefix` "Source" for ifSourceGenerationMatch...); a missing
    object has generation 0. On reads a failed NotMatch is 304, as GCS answers."""
    gen = meta["generation"] if meta else 0
    metagen = meta["metageneration"] if meta else None
    for field, actual in (("GenerationMatch", gen), ("MetagenerationMatch", metagen)):
        match, not_match = query.get(f"if{prefix}{field}"), query.get(f"if{prefix}{field.replace('Match', 'NotMatch')}")
        for value, negate in ((match, False), (not_match, True)):
            if value is None:
                continue
            try:
                wanted = int(value)
            except ValueError:
                raise invalid(f"Invalid argument for if{prefix}{field}: {value!r}") from None
            if (actual == wanted) == negate or actual is None:
                if negate and read and actual is not None:
                    raise GcsError(304, "notModified", "Not Modified")
                raise condition_not_met("If-None-Match" if negate else "If-Match")


# ----- the store ------------------------------------------------------------------------------

class Store:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.uploads = root / "uploads"
        self.uploads.mkdir(parents=True, exist_ok=True)
        (root / "buckets").mkdir(exist_ok=True)
        self.lock = threading.RLock()
        self._last_generation = 0
        self.buckets: dict[str, dict] = {}
        self.objects: dict[str, dict[str, dict]] = {}
        for bucket_dir in sorted((root / "buckets").iterdir()):
            self.buckets[bucket_dir.name] = json.loads((bucket_dir / "bucket.json").read_text())
            objects = self.objects[bucket_dir.name] = {}
            for sidecar in (bucket_dir / "objects").glob("*.json"):
                meta = json.loads(sidecar.read_text())
                objects[meta["name"]] = meta
                self._last_generation = max(self._last_generation, meta["generation"])
        for leftover in self.uploads.iterdir():  # resumable sessions live in memory only
            leftover.unlink()

    # ----- buckets

    def create_bucket(self, body: dict) -> dict:
        name = body.get("name")
        if not isinstance(name, str) or not _BUCKET_NAME.fullmatch(name) or ".." in name:
            raise invalid(f"Invalid bucket name: '{name}'")
        with self.lock:
            if name in self.buckets:
                # The JSON API's answer ("googleapi: Error 409: You already own this bucket. Please
                # select another name., conflict", matched verbatim by minio's GCS gateway and
                # cortexlabs/cortex); the S3 wording it had before is not Cloud Storage's.
                raise GcsError(409, "conflict", "You already own this bucket. Please select another name.")
            now = now_rfc3339()
            resource = {
                "kind": "storage#bucket", "id": name, "name": name, "projectNumber": "100000000001",
                "metageneration": "1", "location": str(body.get("location", "US")).upper(),
                "locationType": "multi-region", "storageClass": body.get("storageClass", "STANDARD"),
                "etag": "CAE=", "timeCreated": now, "updated": now, "rpo": "DEFAULT",
                "iamConfiguration": {"bucketPolicyOnly": {"enabled": True}, "uniformBucketLevelAccess": {"enabled": True},
                                     "publicAccessPrevention": "inherited"},
                "softDeletePolicy": {"retentionDurationSeconds": "0"},
            }
            for key in ("labels", "versioning", "lifecycle", "autoclass", "hierarchicalNamespace"):
                if key in body:
                    resource[key] = body[key]
            bucket_dir = self.root / "buckets" / name
            (bucket_dir / "objects").mkdir(parents=True)
            _write_json(bucket_dir / "bucket.json", resource)
            self.buckets[name] = resource
            self.objects[name] = {}
            return resource

    def bucket(self, name: str) -> dict:
        try:
            return self.buckets[name]
        except KeyError:
            raise not_found_bucket() from None

    def delete_bucket(self, name: str) -> None:
        with self.lock:
            self.bucket(name)
            if self.objects[name]:
                # kestra-io/plugin-gcp#321 (the whole body), googleapis/python-storage#1071.
                raise GcsError(409, "conflict", "The bucket you tried to delete is not empty.")
            del self.buckets[name], self.objects[name]
            for path in (self.root / "buckets" / name / "objects").iterdir():
                path.unlink()
            (self.root / "buckets" / name / "objects").rmdir()
            (self.root / "buckets" / name / "bucket.json").unlink()
            (self.root / "buckets" / name).rmdir()

    # ----- objects

    def get(self, bucket: str, name: str, query: dict | None = None, read: bool = True) -> dict:
        """The live object's metadata (checked against `generation` and preconditions)."""
        with self.lock:
            meta = self._objects(bucket).get(name)
            query = query or {}
            if meta is None or ("generation" in query and str(meta["generation"]) != query["generation"]):
                raise not_found_object(bucket, name)
            check_preconditions(meta, query, read=read)
            return meta

    def open(self, bucket: str, name: str, query: dict) -> tuple[dict, object]:
        """(metadata, open binary file) of a consistent generation."""
        with self.lock:
            meta = self.get(bucket, name, query)
            return meta, open(self._data_path(bucket, meta), "rb")

    def list(self, bucket: str) -> list[str]:
        with self.lock:
            return sorted(self._objects(bucket))

    def temp_path(self) -> Path:
        return self.uploads / f"tmp-{secrets.token_hex(8)}"

    def commit(self, bucket: str, name: str, data: Path, fields: dict, query: dict,
               component_count: int | None = None, verify: bool = True) -> dict:
        """Make file `data` (moved or hard-linked away) the new generation of bucket/name."""
        _check_name(name)
        md5, crc, size = file_hashes(data)
        # Uploads are checked against hashes the client sent; copy and compose take theirs
        # from a source's metadata (gcloud sends the first component's), which GCS ignores.
        for key, actual in (("md5Hash", md5), ("crc32c", crc)):
            if verify and fields.get(key) and fields[key] != actual:
                raise invalid(f"Provided {key} \"{fields[key]}\" doesn't match calculated {key} \"{actual}\".")
        with self.lock:
            objects = self._objects(bucket)
            old = objects.get(name)
            check_preconditions(old, query)
            now = now_rfc3339()
            self._last_generation = max(self._last_generation + 1, time.time_ns() // 1000)
            meta = {"name": name, "bucket": bucket, "generation": self._last_generation, "metageneration": 1,
                    "size": size, "crc32c": crc, "timeCreated": now, "updated": now,
                    "contentType": fields.get("contentType") or "application/octet-stream", "storageClass": "STANDARD"}
            if component_count is None:
                meta["md5Hash"] = md5
            else:
                meta["componentCount"] = component_count
            meta.update({k: fields[k] for k in WRITABLE if fields.get(k) is not None and k not in meta})
            if "metadata" in meta:
                meta["metadata"] = {k: str(v) for k, v in meta["metadata"].items() if v is not None}
            os.link(data, self._data_path(bucket, meta))
            _write_json(self._meta_path(bucket, name), meta)
            objects[name] = meta
            if old is not None:
                self._data_path(bucket, old).unlink(missing_ok=True)
            return meta

    def update(self, bucket: str, name: str, fields: dict, query: dict, replace: bool) -> dict:
        """objects.patch (merge; a null removes) or objects.update (replace): a new metageneration."""
        with self.lock:
            meta = dict(self.get(bucket, name, query, read=False))
            if replace:
                for key in WRITABLE:
                    meta.pop(key, None)
                meta["contentType"] = "application/octet-stream"
            for key in WRITABLE:
                if key not in fields:
                    continue
                value = fields[key]
                if key == "metadata" and value is not None and not replace:
                    merged = {**meta.get("metadata", {}), **value}
                    value = {k: str(v) for k, v in merged.items() if v is not None}
                if value is None:
                    meta.pop(key, None)
                else:
                    meta[key] = value
            meta["metageneration"] += 1
            meta["updated"] = now_rfc3339()
            _write_json(self._meta_path(bucket, name), meta)
            self._objects(bucket)[name] = meta
            return meta

    def delete(self, bucket: str, name: str, query: dict) -> None:
        with self.lock:
            meta = self.get(bucket, name, query, read=False)
            del self._objects(bucket)[name]
            self._meta_path(bucket, name).unlink()
            self._data_path(bucket, meta).unlink(missing_ok=True)

    def link_data(self, bucket: str, meta: dict) -> Path:
        """A temp hard link to an object's content (for copy and rewrite)."""
        tmp = self.temp_path()
        with self.lock:
            os.link(self._data_path(bucket, meta), tmp)
        return tmp

    # ----- helpers

    def _objects(self, bucket: str) -> dict[str, dict]:
        try:
            return self.objects[bucket]
        except KeyError:
            raise not_found_bucket() from None

    def _key(self, name: str) -> str:
        return hashlib.sha256(name.encode()).hexdigest()

    def _meta_path(self, bucket: str, name: str) -> Path:
        return self.root / "buckets" / bucket / "objects" / f"{self._key(name)}.json"

    def _data_path(self, bucket: str, meta: dict) -> Path:
        return self.root / "buckets" / bucket / "objects" / f"{self._key(meta['name'])}-{meta['generation']}.data"


def _check_name(name: str) -> None:
    if not name or len(name.encode()) > 1024 or name in (".", "..") or "\r" in name or "\n" in name:
        raise invalid(f"The object name '{name}' is invalid.")


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)
