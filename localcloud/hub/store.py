"""The local Hub's storage: repos as git-like histories of immutable snapshots.

Layout under the store's root:
    objects/blobs/ab/<git blob sha1>    regular files, named by their git blob id
    objects/lfs/ab/<sha256>             LFS files, named by their LFS oid
    objects/incoming/                   LFS uploads in progress
    repos/<models|datasets>/<ns>/<name>.json
        {"type", "id", "private", "gated", "createdAt", "grants", "branches": {name: commit id},
         "commits": {id: {"parents", "title", "message", "authors", "date", "files": {path: entry}}}}

A commit stores its whole file tree (path -> entry), so each commit is a complete snapshot
and never changes once written; a commit id is the sha1 of its canonical JSON.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import hashlib
import json
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

DEFAULT_BRANCH = "main"
REPO_TYPES = ("model", "dataset")
# The Hub keeps files of 10 MiB or more in LFS whatever .gitattributes says.
LFS_MIN_SIZE = 10 * 1024 * 1024
# What the Hub writes in the initial commit of a new repo: the usual binary formats go to LFS.
DEFAULT_GITATTRIBUTES = "".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n"
    for pattern in (
        "*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gz", "*.h5", "*.joblib",
        "*.lfs.*", "*.mlmodel", "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot",
        "*.parquet", "*.pb", "*.pickle", "*.pkl", "*.pt", "*.pth", "*.rar", "*.safetensors",
        "saved_model/**/*", "*.tar.*", "*.tar", "*.tflite", "*.tgz", "*.wasm", "*.xz", "*.zip",
        "*.zst", "*tfevents*",
    )
)
_SAFE_PATH_PART = re.compile(r"^[^/\\\x00]+$")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The git-lfs pointer file that git stores in place of an LFS file."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def iso_date(value: dt.datetime) -> str:
    """The Hub's date format: UTC, milliseconds, trailing Z."""
    value = value.astimezone(dt.timezone.utc)
    return value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"


def now_iso() -> str:
    return iso_date(dt.datetime.now(dt.timezone.utc))


def normalize_date(value: str) -> str:
    """Accept any ISO 8601 date (naive means UTC); return the Hub's format."""
    parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.timezone.utc)
    return iso_date(parsed)


def check_repo_path(path: str) -> str | None:
    """Why `path` cannot be a file path in a repo, or None if it can."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(not _SAFE_PATH_PART.match(p) for p in parts):
        return f"Invalid path {path!r}"
    if any(p in (".", "..") for p in parts) or parts[0] == ".git":
        return f"Invalid path {path!r}"
    return None


def lfs_patterns(gitattributes: str) -> list[str]:
    patterns = []
    for line in gitattributes.splitlines():
        fields = line.split()
        if fields and not fields[0].startswith("#") and "filter=lfs" in fields[1:]:
            patterns.append(fields[0])
    return patterns


def goes_to_lfs(path: str, size: int, sample: bytes, patterns: list[str]) -> bool:
    """The Hub's choice between a regular git file and LFS, approximated: 10 MiB or more, a pattern of
    .gitattributes, or binary content."""
    if size >= LFS_MIN_SIZE:
        return True
    name = path.rsplit("/", 1)[-1]
    # gitattributes: a pattern without a slash matches the file name at any depth.
    if any(fnmatch.fnmatchcase(path if "/" in p else name, p.lstrip("/")) for p in patterns):
        return True
    return is_binary(sample)


def is_binary(sample: bytes) -> bool:
    if b"\0" in sample:
        return True
    try:
        sample.decode("utf-8")
    except UnicodeDecodeError as exc:
        # The sample may end in the middle of a multi-byte character.
        return exc.start < len(sample) - 3
    return False


@dataclass(frozen=True)
class FileEntry:
    """One file of a snapshot."""

    oid: str  # git blob id: of the content, or of the LFS pointer for an LFS file
    size: int  # size of the content
    lfs: str | None = None  # sha256 of the content when the file is in LFS

    @property
    def remote_oid(self) -> str:
        """What the preupload call reports as the file's `oid` (the client compares it to its own)."""
        return self.lfs or self.oid

    def to_json(self) -> list:
        return [self.oid, self.size, self.lfs]

    @classmethod
    def from_json(cls, value: list) -> FileEntry:
        return cls(*value)


class Repo:
    def __init__(self, data: dict) -> None:
        self.type: str = data["type"]
        self.id: str = data["id"]
        self.private: bool = data.get("private", False)
        self.gated: str | bool = data.get("gated", False)  # False, "auto" or "manual" like the Hub
        self.created_at: str = data["createdAt"]
        self.grants: set[str] = set(data.get("grants", []))
        self.branches: dict[str, str] = data.get("branches", {})
        self.commits: dict[str, dict] = data.get("commits", {})

    @property
    def namespace(self) -> str:
        return self.id.split("/", 1)[0]

    def to_json(self) -> dict:
        return {
            "type": self.type, "id": self.id, "private": self.private, "gated": self.gated,
            "createdAt": self.created_at, "grants": sorted(self.grants),
            "branches": self.branches, "commits": self.commits,
        }

    def resolve(self, revision: str) -> str | None:
        """Commit id of a branch name, `refs/heads/NAME`, or a full or abbreviated commit id."""
        name = revision.removeprefix("refs/heads/")
        if name in self.branches:
            return self.branches[name]
        if re.fullmatch(r"[0-9a-f]{7,40}", revision):
            found = [c for c in self.commits if c.startswith(revision)]
            if len(found) == 1:
                return found[0]
        return None

    def files(self, commit_id: str | None) -> dict[str, FileEntry]:
        if commit_id is None:
            return {}
        return {p: FileEntry.from_json(e) for p, e in self.commits[commit_id]["files"].items()}

    def history(self, commit_id: str | None):
        """Commits from `commit_id` back to the first, following first parents (git log --first-parent)."""
        while commit_id is not None:
            commit = self.commits[commit_id]
            yield commit_id, commit
            commit_id = commit["parents"][0] if commit["parents"] else None

    def last_change(self, commit_id: str, path: str) -> tuple[str, dict]:
        """The newest commit that changed the file or folder `path`, as seen from `commit_id`."""
        def state(files: dict) -> object:
            if path in files:
                return files[path]
            return sorted((p, e) for p, e in files.items() if p.startswith(path + "/"))

        chain = list(self.history(commit_id))
        for (cid, commit), parent in zip(chain, chain[1:] + [(None, {"files": {}})]):
            if state(commit["files"]) != state(parent[1]["files"]):
                return cid, commit
        return chain[-1]


def tree_oid(files: dict[str, FileEntry], folder: str) -> str:
    """A stable id for a folder's content (not git's tree hash, which the client never checks)."""
    below = sorted((p, e.oid) for p, e in files.items() if p.startswith(folder + "/"))
    return hashlib.sha1(json.dumps(below).encode()).hexdigest()


class Store:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.lock = threading.RLock()  # every read or change of repos holds it
        for sub in ("objects/blobs", "objects/lfs", "objects/incoming", "repos"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        self.repos: dict[tuple[str, str], Repo] = {}
        for path in (root / "repos").glob("*/*/*.json"):
            repo = Repo(json.loads(path.read_text()))
            self.repos[(repo.type, repo.id)] = repo

    # ----- objects --------------------------------------------------------------------------

    def _object_path(self, kind: str, oid: str) -> Path:
        return self.root / "objects" / kind / oid[:2] / oid

    def put_regular(self, data: bytes) -> FileEntry:
        entry = FileEntry(git_blob_sha1(data), len(data))
        self._write_object(self._object_path("blobs", entry.oid), data)
        return entry

    def put_lfs(self, data: bytes) -> FileEntry:
        sha256 = hashlib.sha256(data).hexdigest()
        self._write_object(self._object_path("lfs", sha256), data)
        return self.lfs_entry(sha256, len(data))

    @staticmethod
    def lfs_entry(sha256: str, size: int) -> FileEntry:
        return FileEntry(git_blob_sha1(lfs_pointer(sha256, size)), size, sha256)

    def lfs_size(self, sha256: str) -> int | None:
        """Size of a stored LFS object, None if it was never uploaded."""
        if not re.fullmatch(r"[0-9a-f]{64}", sha256):
            return None
        try:
            return self._object_path("lfs", sha256).stat().st_size
        except FileNotFoundError:
            return None

    def incoming_file(self):
        """A temporary file for an LFS upload; `adopt_lfs` moves it into the store."""
        return tempfile.NamedTemporaryFile(dir=self.root / "objects/incoming", delete=False)

    def adopt_lfs(self, tmp_path: Path, sha256: str) -> None:
        target = self._object_path("lfs", sha256)
        target.parent.mkdir(exist_ok=True)
        os.replace(tmp_path, target)

    def content_path(self, entry: FileEntry) -> Path:
        return self._object_path("lfs", entry.lfs) if entry.lfs else self._object_path("blobs", entry.oid)

    def read(self, entry: FileEntry) -> bytes:
        return self.content_path(entry).read_bytes()

    @staticmethod
    def _write_object(target: Path, data: bytes) -> None:
        if target.exists():  # content-addressed: same name, same bytes
            return
        target.parent.mkdir(exist_ok=True)
        tmp = target.with_name(f".{target.name}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)

    # ----- repos ----------------------------------------------------------------------------

    def get(self, repo_type: str, repo_id: str) -> Repo | None:
        return self.repos.get((repo_type, repo_id))

    def create_repo(self, repo_type: str, repo_id: str, *, private: bool = False, gated: str | bool = False) -> Repo:
        repo = Repo({"type": repo_type, "id": repo_id, "private": private, "gated": gated, "createdAt": now_iso()})
        self.repos[(repo_type, repo_id)] = repo
        self.save(repo)
        return repo

    def delete_repo(self, repo: Repo) -> None:
        del self.repos[(repo.type, repo.id)]
        self._repo_file(repo).unlink(missing_ok=True)

    def save(self, repo: Repo) -> None:
        path = self._repo_file(repo)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(repo.to_json(), sort_keys=True))
        os.replace(tmp, path)

    def _repo_file(self, repo: Repo) -> Path:
        return self.root / "repos" / f"{repo.type}s" / f"{repo.id}.json"

    def commit(
        self,
        repo: Repo,
        branch: str,
        changes: dict[str, FileEntry | None],
        *,
        title: str,
        message: str = "",
        author: str,
        date: str | None = None,
    ) -> str:
        """Add a commit on `branch` (created if new) applying `changes` (None deletes a path).
        A commit that changes nothing is still a commit, as on the Hub."""
        parent = repo.branches.get(branch)
        files = {p: e.to_json() for p, e in repo.files(parent).items()}
        for path, entry in changes.items():
            if entry is None:
                files.pop(path, None)
            else:
                files[path] = entry.to_json()
        commit = {
            "parents": [parent] if parent else [],
            "title": title,
            "message": message,
            "authors": [author],
            "date": date or now_iso(),
            "files": dict(sorted(files.items())),
        }
        commit_id = hashlib.sha1(json.dumps(commit, sort_keys=True).encode()).hexdigest()
        repo.commits[commit_id] = commit
        repo.branches[branch] = commit_id
        self.save(repo)
        return commit_id
