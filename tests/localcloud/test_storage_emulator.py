"""The Cloud Storage emulator through the clients that use it: google-cloud-storage, the gcloud
CLI, gcsfs, tensorstore/Orbax (real image only), and from inside a sandbox VM."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import google_crc32c
import paramiko
import pytest
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from localcloud import images
from localcloud.cloud import VM_SERVICE_ACCOUNT_EMAIL, storage_env
from tests.localcloud.test_compute_emulator import ssh, ssh_keys_line

REPO = Path(__file__).resolve().parents[2]
BIG = 20 * 1024 * 1024


# ----- fixtures and helpers ------------------------------------------------------------------


@pytest.fixture
def cloud(compute_cloud):
    """The session's LocalCloud (its storage emulator), with a clean request log."""
    compute_cloud.clear_storage_requests()
    return compute_cloud


@pytest.fixture
def bucket_name(cloud) -> str:
    name = f"lc-{uuid.uuid4().hex[:12]}"
    cloud.create_bucket(name)
    return name


@pytest.fixture
def client(cloud) -> storage.Client:
    return storage.Client(client_options={"api_endpoint": cloud.storage_url}, credentials=AnonymousCredentials(), project="p")


@pytest.fixture(scope="module")
def big_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("big") / "big.bin"
    path.write_bytes(os.urandom(BIG))
    return path


def b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def hashes(data: bytes) -> tuple[str, str]:
    return b64(hashlib.md5(data).digest()), b64(google_crc32c.Checksum(data).digest())


def api(cloud, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(cloud.storage_url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def logged(cloud, method: str | None = None, contains: str = "") -> list[dict]:
    return [r for r in cloud.storage_requests() if (method is None or r["method"] == method) and contains in r["path"]]


def start_emulator(state_dir: Path, parent_pid: int) -> tuple[subprocess.Popen, dict]:
    ready_file = state_dir / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "localcloud.storage", "--state-dir", str(state_dir), "--port", "0",
         "--ready-file", str(ready_file), "--parent-pid", str(parent_pid)],
        cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while not (ready_file.exists() and json.loads(ready_file.read_text() or "{}").get("pid") == proc.pid):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return proc, json.loads(ready_file.read_text())


@pytest.fixture
def processes():
    """Processes a test starts in their own session; killed by process group afterwards."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ----- the process ---------------------------------------------------------------------------


def test_process_ready_file_sigterm_parent_death_and_restart(tmp_path, processes):
    parent = subprocess.Popen(["sleep", "600"], start_new_session=True)
    processes.append(parent)
    proc, ready = start_emulator(tmp_path / "state", parent.pid)
    processes.append(proc)
    assert ready == {"port": ready["port"], "pid": proc.pid, "endpoint": f"http://127.0.0.1:{ready['port']}/storage/v1/"}
    assert os.getpgid(proc.pid) == proc.pid  # its own process group
    base = f"http://127.0.0.1:{ready['port']}"
    gcs = storage.Client(client_options={"api_endpoint": base}, credentials=AnonymousCredentials(), project="p")
    gcs.create_bucket("keep-me").blob("a/b.txt").upload_from_string(b"kept")
    generation = gcs.bucket("keep-me").get_blob("a/b.txt").generation

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert not (tmp_path / "state" / "ready.json").exists()

    # Restarted on the same state dir: the objects are still there, generation included.
    proc, ready = start_emulator(tmp_path / "state", parent.pid)
    processes.append(proc)
    gcs = storage.Client(client_options={"api_endpoint": f"http://127.0.0.1:{ready['port']}"},
                         credentials=AnonymousCredentials(), project="p")
    blob = gcs.bucket("keep-me").get_blob("a/b.txt")
    assert blob.download_as_bytes() == b"kept" and blob.generation == generation

    os.killpg(parent.pid, signal.SIGKILL)
    parent.wait()
    assert proc.wait(timeout=10) == 0  # the parent is gone: it exits by itself


# ----- google-cloud-storage ------------------------------------------------------------------


def test_google_cloud_storage_uploads_downloads_and_preconditions(cloud, client, bucket_name, big_file):
    bucket = client.bucket(bucket_name)
    with pytest.raises(gexc.Conflict):
        client.create_bucket(bucket_name)
    assert client.get_bucket(bucket_name).name == bucket_name
    with pytest.raises(gexc.NotFound):
        client.get_bucket("lc-no-such-bucket")

    bucket.blob("dir/simple.txt").upload_from_string(b"hello", content_type="text/plain")
    meta_blob = bucket.blob("dir/meta.json")
    meta_blob.metadata = {"k": "v"}
    meta_blob.upload_from_string(b'{"a": 1}', content_type="application/json")
    # 20 MB in 8 MB chunks: a resumable session, two 308s, then the object.
    bucket.blob("dir/big.bin", chunk_size=8 * 1024 * 1024).upload_from_filename(big_file)
    uploads = logged(cloud, contains="/upload/")
    assert [(r["method"], r["query"]["uploadType"], r["status"]) for r in uploads] == [
        ("POST", "multipart", 200), ("POST", "multipart", 200), ("POST", "resumable", 200),
        ("PUT", "resumable", 308), ("PUT", "resumable", 308), ("PUT", "resumable", 200)]

    data = big_file.read_bytes()
    blob = bucket.get_blob("dir/big.bin")
    assert blob.size == BIG and (blob.md5_hash, blob.crc32c) == hashes(data)
    assert blob.generation > 0 and blob.metageneration == 1 and blob.updated and blob.content_type
    assert blob.download_as_bytes() == data  # the client checks the hash it is sent
    assert blob.download_as_bytes(start=100, end=199) == data[100:200]
    meta = bucket.get_blob("dir/meta.json")
    assert meta.metadata == {"k": "v"} and meta.content_type == "application/json" and meta.size == 8

    # Preconditions: ifGenerationMatch=0 means "only if absent".
    with pytest.raises(gexc.PreconditionFailed) as failed:
        bucket.blob("dir/simple.txt").upload_from_string(b"again", if_generation_match=0)
    assert "conditionNotMet" in str(failed.value)  # the GCS error body, as the client shows it
    bucket.blob("dir/new.txt").upload_from_string(b"new", if_generation_match=0)
    first = bucket.get_blob("dir/new.txt").generation
    bucket.blob("dir/new.txt").upload_from_string(b"newer", if_generation_match=first)
    second = bucket.get_blob("dir/new.txt")
    assert second.generation > first and second.metageneration == 1
    with pytest.raises(gexc.PreconditionFailed):
        bucket.blob("dir/new.txt").delete(if_generation_match=first)
    with pytest.raises(gexc.PreconditionFailed):
        bucket.blob("dir/new.txt").upload_from_string(b"x", if_metageneration_match=7)
    second.metadata = {"x": "1"}
    second.patch()
    assert bucket.get_blob("dir/new.txt").metageneration == 2
    bucket.blob("dir/new.txt").delete(if_generation_match=second.generation)
    with pytest.raises(gexc.NotFound):
        bucket.blob("dir/new.txt").delete()

    # Copy, rewrite, compose.
    bucket.copy_blob(bucket.blob("dir/simple.txt"), bucket, "copy/simple.txt")
    assert bucket.blob("copy/simple.txt").download_as_bytes() == b"hello"
    bucket.blob("copy/rewritten.bin").rewrite(bucket.blob("dir/big.bin"))
    assert bucket.get_blob("copy/rewritten.bin").md5_hash == blob.md5_hash
    composed = bucket.blob("copy/composed.txt")
    composed.compose([bucket.blob("dir/simple.txt"), bucket.blob("dir/meta.json")])
    composed.reload()
    assert composed.component_count == 2 and composed.md5_hash is None
    assert composed.download_as_bytes() == b'hello{"a": 1}' and composed.crc32c == hashes(b'hello{"a": 1}')[1]


def test_google_cloud_storage_listing(cloud, client, bucket_name, monkeypatch):
    # Through STORAGE_EMULATOR_HOST this time: the client picks anonymous credentials itself.
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", cloud.storage_url)
    env_client = storage.Client()
    bucket = env_client.bucket(bucket_name)
    names = ["a.txt", "d/1", "d/2", "d/sub/3", "e/4", "z"]
    for name in names:
        bucket.blob(name).upload_from_string(name.encode())
    assert [b.name for b in env_client.list_blobs(bucket_name)] == names

    top = env_client.list_blobs(bucket_name, delimiter="/")
    assert [b.name for b in top] == ["a.txt", "z"] and top.prefixes == {"d/", "e/"}
    under_d = env_client.list_blobs(bucket_name, prefix="d/", delimiter="/")
    assert [b.name for b in under_d] == ["d/1", "d/2"] and under_d.prefixes == {"d/sub/"}

    cloud.clear_storage_requests()
    assert [b.name for b in env_client.list_blobs(bucket_name, page_size=2)] == names
    pages = logged(cloud, "GET", f"/b/{bucket_name}/o")
    assert len(pages) == 3 and "pageToken" not in pages[0]["query"] and "pageToken" in pages[2]["query"]
    # Prefixes count towards a page too.
    pager = env_client.list_blobs(bucket_name, delimiter="/", page_size=1)
    seen = []
    for page in pager.pages:
        seen += [b.name for b in page] + sorted(page.prefixes)
    assert seen == ["a.txt", "d/", "e/", "z"]

    assert [b.name for b in env_client.list_blobs(bucket_name, start_offset="d/2", end_offset="e/")] == ["d/2", "d/sub/3"]
    assert [b.name for b in env_client.list_blobs(bucket_name, match_glob="d/*")] == ["d/1", "d/2"]
    assert [b.name for b in env_client.list_blobs(bucket_name, match_glob="**/[34]")] == ["d/sub/3", "e/4"]


def test_json_api_errors_and_media_urls(cloud, bucket_name):
    status, _, body = api(cloud, "GET", f"/storage/v1/b/{bucket_name}/o/no%2Fsuch")
    assert status == 404
    assert json.loads(body) == {"error": {"code": 404, "message": f"No such object: {bucket_name}/no/such", "errors": [
        {"message": f"No such object: {bucket_name}/no/such", "domain": "global", "reason": "notFound"}]}}
    status, _, body = api(cloud, "GET", "/storage/v1/b/lc-no-such-bucket/o")
    assert status == 404 and json.loads(body)["error"]["message"] == "The specified bucket does not exist."
    status, _, body = api(cloud, "POST", "/storage/v1/b?project=p", json.dumps({"name": bucket_name}).encode())
    assert status == 409 and json.loads(body)["error"]["errors"][0]["reason"] == "conflict"
    status, _, body = api(cloud, "POST", "/storage/v1/b?project=p", json.dumps({"name": "Bad_Name"}).encode())
    assert status == 400 and json.loads(body)["error"]["errors"][0]["reason"] == "invalid"

    name = "x/y z.txt"
    status, _, body = api(cloud, "POST", f"/upload/storage/v1/b/{bucket_name}/o?uploadType=media&name=x%2Fy%20z.txt",
                          b"0123456789", {"Content-Type": "text/plain"})
    assert status == 200
    resource = json.loads(body)
    assert resource["name"] == name and resource["size"] == "10" and resource["generation"].isdigit()
    assert (resource["md5Hash"], resource["crc32c"]) == hashes(b"0123456789")
    status, _, body = api(cloud, "POST", f"/upload/storage/v1/b/{bucket_name}/o?uploadType=media&name=x%2Fy%20z.txt"
                          "&ifGenerationMatch=0", b"other")
    assert status == 412
    assert json.loads(body)["error"]["errors"][0] == {
        "message": "At least one of the pre-conditions you specified did not hold.", "domain": "global",
        "reason": "conditionNotMet", "locationType": "header", "location": "If-Match"}

    # alt=media on the object URL and the download URL, with a Range; mediaLink works as given.
    status, headers, body = api(cloud, "GET", f"/storage/v1/b/{bucket_name}/o/x%2Fy%20z.txt?alt=media",
                                headers={"Range": "bytes=2-4"})
    assert (status, body, headers["Content-Range"]) == (206, b"234", "bytes 2-4/10")
    assert headers["X-Goog-Generation"] == resource["generation"]
    assert f"md5={resource['md5Hash']}" in headers["X-Goog-Hash"]
    with urllib.request.urlopen(resource["mediaLink"], timeout=30) as response:
        assert response.read() == b"0123456789"
    status, _, _ = api(cloud, "GET", f"/download/storage/v1/b/{bucket_name}/o/x%2Fy%20z.txt?alt=media",
                       headers={"Range": "bytes=50-"})
    assert status == 416
    # A NotMatch precondition that fails on a read is a 304, as GCS answers.
    status, _, _ = api(cloud, "GET", f"/storage/v1/b/{bucket_name}/o/x%2Fy%20z.txt?alt=media"
                       f"&ifGenerationNotMatch={resource['generation']}")
    assert status == 304

    status, _, body = api(cloud, "DELETE", f"/storage/v1/b/{bucket_name}")
    assert status == 409 and "not empty" in json.loads(body)["error"]["message"]
    # Every request is logged (never a body), the failing ones too.
    entries = logged(cloud)
    assert all(set(e) == {"time", "method", "path", "query", "status"} for e in entries)
    assert [e["status"] for e in entries if e["path"] == f"/upload/storage/v1/b/{bucket_name}/o"] == [200, 412]


def test_fault_rules(cloud, bucket_name):
    path = f"/storage/v1/b/{bucket_name}/o"
    try:
        rules = cloud.set_storage_faults([{"method": "GET", "path_regex": f"/b/{bucket_name}/o$", "status": 503,
                                           "count": 2}])
        assert rules == [{"method": "GET", "path_regex": f"/b/{bucket_name}/o$", "status": 503, "count": 2}]
        first, second, third = (api(cloud, "GET", path) for _ in range(3))
        assert (first[0], second[0], third[0]) == (503, 503, 200)
        assert json.loads(first[2])["error"]["code"] == 503
        assert [r["status"] for r in logged(cloud, "GET", path)] == [503, 503, 200]
        assert json.loads(api(cloud, "GET", "/_localcloud/faults")[2]) == {"rules": [], "denials": []}
        status, _, _ = api(cloud, "POST", "/_localcloud/faults", json.dumps({"rules": [{"status": 200}]}).encode())
        assert status == 400
    finally:
        cloud.set_storage_faults([])


# ----- gcloud --------------------------------------------------------------------------------


def gcloud_env(cloud, config_dir: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLOUDSDK_", "STORAGE_EMULATOR"))}
    return {**env, **storage_env(cloud.storage_url), "CLOUDSDK_CONFIG": str(config_dir), **extra}


def gcloud(env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["gcloud", "storage", *args], env=env, capture_output=True, text=True, timeout=180)
    if check:
        assert result.returncode == 0, f"gcloud storage {' '.join(args)}: {result.stderr[-3000:]}"
    return result


def test_a_vm_service_account_without_a_role_on_the_bucket_is_refused_by_gcloud(cloud, bucket_name, tmp_path):
    # gcloud as a VM runs it (the VM's token) is refused what the workers may still do.
    vm = gcloud_env(cloud, tmp_path / "gcloud-config")
    (tmp_path / "probe").write_text("probe\n")
    gcloud(vm, "cp", str(tmp_path / "probe"), f"gs://{bucket_name}/before.txt")
    try:
        cloud.deny_vm_writes(bucket_name)
        refused = gcloud(vm, "cp", str(tmp_path / "probe"), f"gs://{bucket_name}/probe.txt", check=False)
        assert refused.returncode != 0
        assert (f"{VM_SERVICE_ACCOUNT_EMAIL} does not have storage.objects.create access to the Google Cloud "
                "Storage object") in refused.stderr, refused.stderr
        assert [r["status"] for r in uploads(cloud)][-1] == 403
        assert gcloud(vm, "cat", f"gs://{bucket_name}/before.txt").stdout == "probe\n"  # reads still work
        worker = storage.Client(project="p", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": cloud.storage_url})
        worker.bucket(bucket_name).blob("by-worker.txt").upload_from_string(b"ok")  # another principal
        other = gcloud(vm, "cp", str(tmp_path / "probe"), f"gs://{bucket_name}-other/x.txt", check=False)
        assert "does not have storage.objects.create" not in other.stderr  # only that bucket is denied
    finally:
        cloud.allow_vm_writes()


def uploads(cloud) -> list[dict]:
    return [r for r in cloud.storage_requests() if "/upload/" in r["path"] or r["path"].endswith("/compose")]


def test_gcloud_storage_cli(cloud, bucket_name, big_file, tmp_path):
    env = gcloud_env(cloud, tmp_path / "gcloud-config")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha\n")
    (src / "sub" / "b.txt").write_text("beta\n")
    (src / "big.bin").write_bytes(big_file.read_bytes())
    gs = f"gs://{bucket_name}"

    gcloud(env, "cp", str(src / "a.txt"), f"{gs}/one/a.txt")
    assert gcloud(env, "cat", f"{gs}/one/a.txt").stdout == "alpha\n"
    gcloud(env, "cp", "-r", str(src), f"{gs}/tree/")
    assert any(r["path"].startswith("/resumable/upload/") for r in uploads(cloud))  # the 20 MB file
    listing = gcloud(env, "ls", "-r", f"{gs}/tree/").stdout.split()
    assert {f"{gs}/tree/src/a.txt", f"{gs}/tree/src/big.bin", f"{gs}/tree/src/sub/b.txt"} <= set(listing)
    assert gcloud(env, "ls", f"{gs}/tree/src/").stdout.split() == [
        f"{gs}/tree/src/a.txt", f"{gs}/tree/src/big.bin", f"{gs}/tree/src/sub/"]

    # --if-generation-match=0: the second copy fails with the 412.
    gcloud(env, "cp", "--if-generation-match=0", str(src / "a.txt"), f"{gs}/once.txt")
    again = gcloud(env, "cp", "--if-generation-match=0", str(src / "a.txt"), f"{gs}/once.txt", check=False)
    assert again.returncode == 1 and "412" in again.stderr and "pre-conditions" in again.stderr

    # Downloads (the big file with gcloud's hash check, possibly sliced).
    down = tmp_path / "down"
    down.mkdir()
    gcloud(env, "cp", "-r", f"{gs}/tree/src", str(down))
    for rel in ("a.txt", "sub/b.txt", "big.bin"):
        assert (down / "src" / rel).read_bytes() == (src / rel).read_bytes()

    # rsync both ways; a second run copies nothing.
    gcloud(env, "rsync", "-r", str(src), f"{gs}/mirror")
    cloud.clear_storage_requests()
    gcloud(env, "rsync", "-r", str(src), f"{gs}/mirror")
    assert uploads(cloud) == []
    back = tmp_path / "back"
    back.mkdir()
    gcloud(env, "rsync", "-r", f"{gs}/mirror", str(back))
    assert sorted(str(p.relative_to(back)) for p in back.rglob("*") if p.is_file()) == ["a.txt", "big.bin", "sub/b.txt"]
    stamp = (back / "big.bin").stat().st_mtime_ns
    cloud.clear_storage_requests()
    gcloud(env, "rsync", "-r", f"{gs}/mirror", str(back))
    assert not logged(cloud, "GET", "/download/") and (back / "big.bin").stat().st_mtime_ns == stamp

    described = gcloud(env, "objects", "describe", f"{gs}/mirror/big.bin", "--format=json").stdout
    obj = json.loads(described)
    md5, crc = hashes(big_file.read_bytes())
    assert (obj["size"], obj["md5_hash"], obj["crc32c_hash"]) == (BIG, md5, crc)
    assert obj["generation"].isdigit() and "goog-reserved-file-mtime" in obj["custom_fields"]

    gcloud(env, "rm", "-r", f"{gs}/mirror")
    assert f"{gs}/mirror/" not in gcloud(env, "ls", gs).stdout.split()
    assert gcloud(env, "ls", f"{gs}/mirror", check=False).returncode == 1


def test_gcloud_parallel_composite_upload(cloud, bucket_name, big_file, tmp_path):
    """gcloud composes uploads above 150 MB by default; a low threshold makes it compose here."""
    env = gcloud_env(cloud, tmp_path / "gcloud-config", CLOUDSDK_STORAGE_PARALLEL_COMPOSITE_UPLOAD_ENABLED="True",
                     CLOUDSDK_STORAGE_PARALLEL_COMPOSITE_UPLOAD_THRESHOLD="1M",
                     CLOUDSDK_STORAGE_PARALLEL_COMPOSITE_UPLOAD_COMPONENT_SIZE="8M")
    gcloud(env, "cp", str(big_file), f"gs://{bucket_name}/composite.bin")
    assert [r["status"] for r in uploads(cloud) if r["path"].endswith("/compose")] == [200]
    obj = json.loads(gcloud(env, "objects", "describe", f"gs://{bucket_name}/composite.bin", "--format=json").stdout)
    assert obj["component_count"] >= 2 and obj["crc32c_hash"] == hashes(big_file.read_bytes())[1]
    gcloud(env, "cp", f"gs://{bucket_name}/composite.bin", str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == big_file.read_bytes()


# ----- gcsfs ---------------------------------------------------------------------------------


def test_gcsfs(cloud, bucket_name, monkeypatch, tmp_path):
    for key, value in storage_env(cloud.storage_url).items():
        monkeypatch.setenv(key, value)
    import gcsfs

    fs = gcsfs.GCSFileSystem(skip_instance_cache=True)
    data = os.urandom(12 * 1024 * 1024)
    with fs.open(f"{bucket_name}/dir/big.bin", "wb", block_size=5 * 2**20) as f:  # a resumable upload
        f.write(data)
    fs.pipe(f"{bucket_name}/dir/small.txt", b"small")
    assert fs.cat(f"{bucket_name}/dir/big.bin") == data
    assert fs.cat_file(f"{bucket_name}/dir/big.bin", start=10, end=20) == data[10:20]
    assert fs.ls(f"{bucket_name}/dir", detail=False) == [f"{bucket_name}/dir/big.bin", f"{bucket_name}/dir/small.txt"]
    assert fs.info(f"{bucket_name}/dir")["type"] == "directory"
    assert fs.info(f"{bucket_name}/dir/small.txt")["size"] == 5
    fs.get(f"{bucket_name}/dir", str(tmp_path / "got"), recursive=True)
    assert (tmp_path / "got" / "small.txt").read_bytes() == b"small"
    fs.copy(f"{bucket_name}/dir/small.txt", f"{bucket_name}/other/copy.txt")
    fs.rm(f"{bucket_name}/dir", recursive=True)
    assert fs.find(bucket_name) == [f"{bucket_name}/other/copy.txt"]
    assert {(r["method"], r["status"]) for r in logged(cloud, contains="/upload/")} >= {("POST", 308), ("POST", 200)}


# ----- tensorstore and Orbax (the real image's venv) ------------------------------------------

ORBAX_PROBE = r"""
import json, sys
import numpy as np, jax.numpy as jnp, tensorstore as ts
import orbax.checkpoint as ocp
from etils import epath

bucket = sys.argv[1]
kv = ts.KvStore.open({"driver": "gcs", "bucket": bucket, "path": "kv/"}).result()
kv.write("a", b"hello").result()
kv.write("d/b", b"world").result()
out = {"kv_read": kv.read("a").result().value.decode(), "kv_list": sorted(k.decode() for k in kv.list().result())}

path = epath.Path(f"gs://{bucket}/ckpt")
out["epath"] = type(path).__name__
tree = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4), "b": {"x": jnp.ones(5, dtype=jnp.bfloat16)}}
with ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=2)) as mgr:
    for step in (1, 2, 3):
        mgr.save(step, args=ocp.args.StandardSave(tree))
    mgr.wait_until_finished()
    out["steps"] = list(mgr.all_steps())
    restored = mgr.restore(3, args=ocp.args.StandardRestore(tree))
out["restored"] = bool(np.array_equal(np.asarray(restored["w"]), np.asarray(tree["w"])))
print(json.dumps(out))
"""


def _real_image() -> Path | None:
    image = images.cache_root_default() / f"real-{images.real_recipe()[:16]}"
    return image if (image / "maxtext_venv" / "bin" / "python3").exists() else None


@pytest.mark.real_maxtext
def test_tensorstore_and_orbax_checkpoints_on_gcs(cloud, bucket_name, client, tmp_path):
    image = _real_image()
    if image is None:
        pytest.skip("the real MaxText image is not built (python -m localcloud.images real builds it)")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "HF_TOKEN")}
    env.update(storage_env(cloud.storage_url), JAX_PLATFORMS="cpu")
    result = subprocess.run([str(image / "maxtext_venv/bin/python3"), "-c", ORBAX_PROBE, bucket_name],
                            capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"kv_read": "hello", "kv_list": ["a", "d/b"], "epath": out["epath"], "steps": [2, 3], "restored": True}
    assert "GPath" in out["epath"]  # gcsfs-backed, not TensorFlow's gfile

    # Orbax on GCS: a step is complete once its commit_success.txt exists (written last).
    bucket = client.bucket(bucket_name)
    names = {b.name for b in client.list_blobs(bucket_name, prefix="ckpt/")}
    assert "ckpt/3/commit_success.txt" in names and "ckpt/3/_CHECKPOINT_METADATA" in names
    assert not any(name.startswith("ckpt/1/") for name in names)  # max_to_keep deleted step 1
    committed = bucket.get_blob("ckpt/3/commit_success.txt")
    assert all(b.updated <= committed.updated for b in client.list_blobs(bucket_name, prefix="ckpt/3/"))


# ----- from inside a VM ----------------------------------------------------------------------


def test_vm_sessions_reach_the_emulator(cloud, compute_vm, bucket_name):
    key = paramiko.ECDSAKey.generate()
    instance = compute_vm("lc-storage-vm", metadata={"ssh-keys": ssh_keys_line("maxtext", key)})
    ip = instance["networkInterfaces"][0]["networkIP"]
    with ssh(ip, "maxtext", key) as client:
        def run(command: str) -> str:
            _, stdout, stderr = client.exec_command(command, timeout=120)
            out = stdout.read().decode()
            status = stdout.channel.recv_exit_status()
            assert status == 0, f"{command!r} exited {status}: {stderr.read().decode()}"
            return out

        env = dict(line.split("=", 1) for line in run("env").splitlines() if "=" in line)
        assert {k: env.get(k) for k in cloud.vm_env} == cloud.vm_env
        run("echo from-the-vm > ~/note.txt && gcloud storage cp ~/note.txt gs://%s/vm/note.txt" % bucket_name)
        assert run(f"gcloud storage cat gs://{bucket_name}/vm/note.txt") == "from-the-vm\n"
        assert run("ls -d ~/.config/gcloud")  # gcloud's config lives in the VM user's home
    gcs = storage.Client(client_options={"api_endpoint": cloud.storage_url}, credentials=AnonymousCredentials(), project="p")
    assert gcs.bucket(bucket_name).blob("vm/note.txt").download_as_bytes() == b"from-the-vm\n"
