"""Launcher for the local cloud's emulators (Cloud Storage, Compute Engine with OS Login, the
Hugging Face Hub), for tests and local runs.

    with LocalCloud(state_dir, images={"PROJECT/FAMILY": Path("/image/dir")}) as cloud:
        cloud.compute_endpoint   # "http://127.0.0.1:PORT/compute/v1/"
        cloud.storage_endpoint   # "http://127.0.0.1:PORT2/storage/v1/"
        cloud.oslogin_endpoint   # "http://127.0.0.1:PORT/" (the OS Login API, in compute's process)
        cloud.iap_tunnel_endpoint  # "wss://127.0.0.1:PORT4/v4/" (IAP's TCP forwarding, in compute's process)
        cloud.create_bucket("my-bucket")
        cloud.hub.endpoint       # "http://127.0.0.1:PORT3" (HF_ENDPOINT's format)
        cloud.hub.add_user("team", token, role="write")

Each emulator runs as `python -m localcloud.<service>` in its own session; they are stopped
by `stop()`, at interpreter exit, or by themselves when this process dies. One cloud per
state dir: starting on a dir whose previous emulators crashed (or still run) takes them over
and reaps the old compute emulator's VMs. Storage keeps its buckets in STATE_DIR/storage/,
the Hub its repos in STATE_DIR/hub/, across restarts.

The VMs reach the storage emulator the way a real TPU VM reaches Cloud Storage with its
service account: every SSH session on a VM has `vm_env` in its environment (sshd SetEnv), so
gcloud storage, google-cloud-storage, gcsfs, tensorstore (Orbax) and the MaxText stand-in
talk to the emulator with no other setup.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from localcloud.compute.first_boot import FirstBoot
from localcloud.compute.vm import reap_stale
from localcloud.hub.launcher import HubEmulator
from localcloud.service import Service, ServiceError as LocalCloudError





# What gcloud on a VM authenticates with (its service account, as the metadata server would give it).
VM_ACCESS_TOKEN = "localcloud-vm-service-account"
VM_SERVICE_ACCOUNT_EMAIL = "localcloud-vm@local-project.iam.gserviceaccount.com"


def storage_env(storage_url: str) -> dict[str, str]:
    """Environment variables that point every Cloud Storage client at the emulator at
    `storage_url` ("http://127.0.0.1:PORT"), with no credentials to find."""
    return {
        # gcloud storage: the JSON API endpoint, and a token instead of a service account.
        "CLOUDSDK_API_ENDPOINT_OVERRIDES_STORAGE": f"{storage_url}/storage/v1/",
        "CLOUDSDK_AUTH_ACCESS_TOKEN": VM_ACCESS_TOKEN,
        "CLOUDSDK_CORE_DISABLE_PROMPTS": "1",
        # google-cloud-storage (anonymous credentials then), gcsfs, the MaxText stand-in.
        "STORAGE_EMULATOR_HOST": storage_url,
        # gcsfs: the plain JSON API client. (Newer gcsfs, like the project venv's, defaults to
        # an extended one that first asks the gRPC Storage Control API for each bucket's layout.)
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        # tensorstore's gcs kvstore (Orbax's checkpoint data); it finds no credentials and
        # goes on anonymously after one logged error line.
        "TENSORSTORE_GCS_HTTP_URL": storage_url,
        # etils.epath (Orbax's paths) handles gs:// with gcsfs rather than TensorFlow's gfile.
        "EPATH_USE_TF": "false",
    }


class LocalCloud:
    def __init__(
        self,
        state_dir: Path,
        images: dict[str, Path] | None = None,
        *,
        startup_timeout: float = 30.0,
        stop_timeout: float = 30.0,
        python: str = sys.executable,
        keep_deleted_shm: bool = False,
        vm_env: dict[str, str] | None = None,
        first_boot: FirstBoot | None = None,
    ) -> None:
        """`vm_env` adds to (or overrides) the environment every VM's SSH sessions get.
        `first_boot`: what each VM's boot goes through (compute/first_boot.py; default: nothing)."""
        self.first_boot = first_boot or FirstBoot()
        self.state_dir = Path(state_dir).resolve()
        self.keep_deleted_shm = keep_deleted_shm
        self.images = {k: Path(v) for k, v in (images or {}).items()}
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.python = python
        self.extra_vm_env = dict(vm_env or {})
        d = self.state_dir
        self._storage = Service("storage", "localcloud.storage", d / "storage-ready.json", d / "storage-emulator.log")
        self._compute = Service("compute", "localcloud.compute", d / "compute-ready.json", d / "compute-emulator.log")
        # The Hugging Face Hub: huggingface_hub reaches it through HF_ENDPOINT or an endpoint argument.
        self.hub = HubEmulator(d / "hub", startup_timeout=startup_timeout, stop_timeout=stop_timeout, python=python)
        self._lock = threading.Lock()

    # ----- lifecycle -----------------------------------------------------------------------

    def start(self) -> LocalCloud:
        with self._lock:
            if self.running:
                return self
            self.state_dir.mkdir(parents=True, exist_ok=True)
            try:
                self.hub.start()
                if not self._storage.running:
                    self._storage.start(self.python, ["--state-dir", str(self.state_dir / "storage"), "--port", "0"],
                                        self.startup_timeout)
                if not self._compute.running:
                    images_file = self.state_dir / "compute-images.json"
                    images_file.write_text(json.dumps({k: str(v) for k, v in self.images.items()}, indent=1))
                    env_file = self.state_dir / "compute-vm-env.json"
                    env_file.write_text(json.dumps(self.vm_env, indent=1))
                    self._compute.start(
                        self.python,
                        [
                            "--state-dir", str(self.state_dir),
                            "--port", "0",
                            "--images-file", str(images_file),
                            "--vm-env-file", str(env_file),
                            *(["--keep-deleted-shm"] if self.keep_deleted_shm else []),
                            "--first-boot-cloud-init", str(self.first_boot.cloud_init_seconds),
                            "--first-boot-dpkg-lock", str(self.first_boot.dpkg_lock_seconds),
                        ],
                        self.startup_timeout,
                    )
            except BaseException:
                self._stop_services()
                raise
            atexit.register(self.stop)
            return self

    def stop(self) -> None:
        """Stop the emulators (compute deletes its VMs first); idempotent."""
        with self._lock:
            atexit.unregister(self.stop)
            self._stop_services()

    def _stop_services(self) -> None:
        failed = self._compute.stop(self.stop_timeout)
        if failed is not None:
            # The emulator was killed or crashed, so it could not delete its VMs: reap
            # them from their records (only its own, never a newer emulator's).
            reap_stale(self.state_dir, only_owner=failed.pid)
        self._storage.stop(self.stop_timeout)
        self.hub.stop()

    def __enter__(self) -> LocalCloud:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._compute.running and self._storage.running and self.hub.running

    # The compute emulator's port, pid and process (what tests of the compute API look at).
    @property
    def port(self) -> int | None:
        return self._compute.port

    @property
    def pid(self) -> int | None:
        return self._compute.proc.pid if self._compute.proc else None

    @property
    def _proc(self) -> subprocess.Popen | None:
        return self._compute.proc

    @property
    def storage_pid(self) -> int | None:
        return self._storage.proc.pid if self._storage.proc else None

    # ----- endpoints and controls ----------------------------------------------------------

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise LocalCloudError("LocalCloud is not started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def compute_endpoint(self) -> str:
        """gcloud's api_endpoint_overrides/compute format (and the discovery client's)."""
        return f"{self.base_url}/compute/v1/"

    @property
    def oslogin_endpoint(self) -> str:
        """The OS Login API (served by the compute emulator's process), in gcloud's
        api_endpoint_overrides/oslogin format: the host root, as oslogin.googleapis.com/ is."""
        return f"{self.base_url}/"

    @property
    def token_uri(self) -> str:
        """The OAuth token endpoint of service-account keys (localcloud/iap/tokens.py), in compute's
        process: a key file's `token_uri`, as https://oauth2.googleapis.com/token is."""
        return f"{self.base_url}/token"

    @property
    def resourcemanager_endpoint(self) -> str:
        """Resource Manager's projects.testIamPermissions (IAP's permission only), in compute's
        process, in gcloud's api_endpoint_overrides/cloudresourcemanager format: the host root."""
        return f"{self.base_url}/"

    @property
    def iap_tunnel_endpoint(self) -> str:
        """IAP's TCP forwarding relay (localcloud/iap/relay.py), "wss://127.0.0.1:PORT/v4/": gcloud's
        --iap-tunnel-url-override and the Google connection's extra `iap_tunnel_endpoint` take it."""
        if not self._compute.ready:
            raise LocalCloudError("LocalCloud is not started")
        return self._compute.ready["iap_tunnel_endpoint"]

    @property
    def iap_tunnel_ca_file(self) -> str:
        """The relay's certificate, its own CA: what gcloud's core/custom_ca_certs_file and
        OpenSSL's SSL_CERT_FILE (Python's default TLS context) take to trust it."""
        if not self._compute.ready:
            raise LocalCloudError("LocalCloud is not started")
        return self._compute.ready["iap_tunnel_ca_file"]

    def add_service_account(self, email: str) -> dict:
        """A new key for service account `email` that the token endpoint accepts: the key file
        (what a Google connection's `keyfile_dict` holds), its `token_uri` this cloud's."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        public = key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
        self._control("POST", "iap/service-accounts", {"email": email, "public_key_pem": public})
        private = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
        return {
            "type": "service_account", "project_id": email.split("@")[1].split(".")[0],
            "private_key_id": os.urandom(20).hex(), "private_key": private, "client_email": email,
            "client_id": str(int.from_bytes(os.urandom(8), "big")), "token_uri": self.token_uri,
        }

    def bind_role(self, member: str, permissions: list[str] | None, *, token: str | None = None) -> None:
        """`member` (`serviceAccount:EMAIL`) may do exactly `permissions` through the Compute and
        Storage APIs from now on (localcloud/compute/iam.py, localcloud/storage/iam.py); None: its
        calls are no longer checked. `token`: a token that is the member's though the token
        endpoint did not issue it (the VMs' VM_ACCESS_TOKEN)."""
        self._control("POST", "iam/bindings", {"member": member, "permissions": permissions})
        self._control("POST", "iam/bindings", {
            "member": member, "permissions": permissions, "tokeninfo_url": f"{self.base_url}/tokeninfo",
            **({"token": token} if token else {}),
        }, base=self.storage_url)

    def grant_iap_tunnel_user(self, project: str, member: str) -> None:
        """`member` (`serviceAccount:EMAIL`) gets the IAP-secured Tunnel User role on `project`."""
        self._control("POST", "iap/tunnel-users", {"project": project, "member": member})

    def revoke_iap_tunnel_user(self, project: str, member: str) -> None:
        self._control("DELETE", "iap/tunnel-users", {"project": project, "member": member})

    def iap_requests(self) -> list[dict]:
        """The relay's log: [{caller (a token's service account, None without one), project, zone,
        instance, port, interface, user_agent, outcome ("connected", a close code, or 401)}]."""
        return self._control("GET", "iap/requests")

    def oslogin_requests(self) -> list[dict]:
        """The OS Login API's request log: [{time, method, path, query, body, status, user_agent,
        api_client (x-goog-api-client: a Cloud client library's client_info)}]."""
        return self._control("GET", "oslogin/requests")

    def clear_oslogin_requests(self) -> None:
        self._control("DELETE", "oslogin/requests")

    @property
    def storage_url(self) -> str:
        """The storage emulator's root, "http://127.0.0.1:PORT" (STORAGE_EMULATOR_HOST's format)."""
        if self._storage.port is None:
            raise LocalCloudError("LocalCloud is not started")
        return f"http://127.0.0.1:{self._storage.port}"

    @property
    def storage_endpoint(self) -> str:
        """gcloud's api_endpoint_overrides/storage format."""
        return f"{self.storage_url}/storage/v1/"

    @property
    def vm_env(self) -> dict[str, str]:
        """The environment every VM's SSH sessions get (see `storage_env`), plus `vm_env` extras."""
        # HF_ENDPOINT: huggingface_hub's (and the rehearsal's curl checks') Hub, as on any machine.
        return {**storage_env(self.storage_url), "HF_ENDPOINT": self.hub.endpoint, **self.extra_vm_env}

    def storage_requests(self) -> list[dict]:
        """The storage emulator's request log: [{time, method, path, query, status}]."""
        return self._control("GET", "requests", base=self.storage_url)

    def clear_storage_requests(self) -> None:
        self._control("DELETE", "requests", base=self.storage_url)

    def set_storage_faults(self, rules: list[dict]) -> list[dict]:
        """Replace the storage emulator's fault rules: [{"method": "PUT", "path_regex": "/upload/",
        "status": 503, "count": 1}]; a matching request gets that error, `count` times or always."""
        return self._control("POST", "faults", {"rules": rules}, base=self.storage_url)["rules"]

    def deny_vm_writes(self, bucket: str, principal: str = VM_SERVICE_ACCOUNT_EMAIL) -> None:
        """The VMs' service account may not create objects in `bucket` (no role on it): gcloud on
        a VM (its token, VM_ACCESS_TOKEN) is refused with the API's 403; the workers are not."""
        self._control("POST", "faults", {"denials": [
            {"token": VM_ACCESS_TOKEN, "principal": principal, "bucket": bucket}]}, base=self.storage_url)

    def allow_vm_writes(self) -> None:
        """Lift every deny_vm_writes."""
        self._control("POST", "faults", {"denials": []}, base=self.storage_url)

    def create_bucket(self, name: str, *, exist_ok: bool = False) -> dict:
        """Create bucket `name` through the JSON API; returns the bucket resource."""
        request = urllib.request.Request(
            f"{self.storage_endpoint}b?project=localcloud",
            data=json.dumps({"name": name}).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")
            if exc.code == 409 and exist_ok:
                with urllib.request.urlopen(f"{self.storage_endpoint}b/{name}", timeout=30) as response:
                    return json.loads(response.read())
            raise LocalCloudError(f"creating bucket {name!r}: {exc.code} {body}") from None

    def requests(self) -> list[dict]:
        return self._control("GET", "requests")

    def clear_requests(self) -> None:
        self._control("DELETE", "requests")

    def set_faults(self, faults: dict) -> dict:
        """Replace the compute emulator's faults (kinds and shapes: `localcloud.compute.faults.Faults`),
        e.g. {"http_errors": [{"method": "GET", "path_regex": "/instances/vm-1$", "status": 503}],
        "ssh_refused": {"seconds": 20}}; {} clears them all. Returns what is set."""
        return self._control("POST", "faults", faults)

    def get_faults(self) -> dict:
        """The compute faults still set (rules whose `count` ran out are gone)."""
        return self._control("GET", "faults")

    def terminate_vm(self, name: str, action: str = "DELETE", *, project: str | None = None, zone: str | None = None) -> dict:
        """End instance `name` the way Compute Engine itself does (preemption, its time limit):
        DELETE kills its processes and removes it (the API then answers 404), STOP kills them and
        leaves it TERMINATED. No API request or operation is made; returns when done."""
        body = {"action": action, **({"project": project} if project else {}), **({"zone": zone} if zone else {})}
        return self._control("POST", f"vms/{urllib.parse.quote(name, safe='')}/terminate", body)

    def preempt_vm(
        self, name: str, *, project: str | None = None, zone: str | None = None, soft_off_seconds: float = 30.0
    ) -> dict:
        """Preempt Spot (or preemptible) VM `name` the way Compute Engine does: a DONE
        compute.instances.preempted operation in its zone's operations list, the instance STOPPING
        with its processes running for `soft_off_seconds` (the guest's ACPI soft off, 30 s on
        Compute Engine), then TERMINATED or deleted per its instanceTerminationAction. Returns at
        once: {name, project, zone, action, status, operation, soft_off_seconds}. Any other VM, or
        one not RUNNING, is refused (LocalCloudError, 400)."""
        body = {
            "soft_off_seconds": soft_off_seconds,
            **({"project": project} if project else {}),
            **({"zone": zone} if zone else {}),
        }
        return self._control("POST", f"vms/{urllib.parse.quote(name, safe='')}/preempt", body)

    def host_event(self, name: str, event: str = "compute.instances.hostError", *, project: str | None = None,
                   zone: str | None = None) -> dict:
        """End RUNNING instance `name` by a host event as Compute Engine does (a host error, or
        `compute.instances.terminateOnHostMaintenance`): a DONE system-event operation in its zone,
        the instance TERMINATED. A managed instance group's member is then repaired by its group."""
        body = {"event": event, **({"project": project} if project else {}), **({"zone": zone} if zone else {})}
        return self._control("POST", f"vms/{urllib.parse.quote(name, safe='')}/host-event", body)

    def set_sshd_paused(self, name: str, paused: bool) -> dict:
        """Freeze the sshd of running VM `name` (connections queue, no SSH banner) or let it go on."""
        return self._control("POST", f"vms/{urllib.parse.quote(name, safe='')}/sshd", {"paused": paused})

    def add_reservation(
        self, name: str, count: int, machine_type: str = "ct6e-standard-8t", *, zone: str, project: str,
        shared_with: tuple[str, ...] = (),
    ) -> dict:
        """Create reservation `name` of `count` VMs of `machine_type` in `project`/`zone` (or change
        an existing one's count, machine type and sharing), shared with the projects `shared_with`;
        returns it as reservations.get does. Inserts naming a reservation that does not exist there,
        or one of another project not shared with theirs, are refused, as on Compute Engine."""
        body = {"project": project, "zone": zone, "name": name, "count": count, "machine_type": machine_type,
                **({"shared_with": list(shared_with)} if shared_with else {})}
        return self._control("POST", "reservations", body)

    def add_network(self, name: str, *, project: str, auto: bool = False, subnetworks: dict[str, str] | None = None,
                    region: str = "us-east5") -> dict:
        """Create (or replace) VPC network `name` in `project`: custom mode unless `auto`, with
        `subnetworks` ({name: ip_cidr_range}) in `region`; returns it as networks.get does. An
        insert on a custom-mode network without a subnetwork is refused, as on Compute Engine."""
        body = {
            "project": project, "name": name, "auto": auto,
            "subnetworks": [{"region": region, "name": n, "ip_cidr_range": r} for n, r in (subnetworks or {}).items()],
        }
        return self._control("POST", "networks", body)

    def set_project_metadata(self, project: str, items: dict[str, str | None]) -> dict:
        """Set (or, with None, remove) project-wide metadata items of `project` through the
        Compute API, the way `gcloud compute project-info add-metadata` does: projects.get for
        the fingerprint, projects.setCommonInstanceMetadata, then the global operation until
        DONE (every VM's guest agent of the project has applied it then). Returns the metadata."""
        project_url = f"{self.compute_endpoint}projects/{urllib.parse.quote(project, safe='')}"
        current = self._api("GET", project_url)["commonInstanceMetadata"]
        merged = {item["key"]: item.get("value") for item in current.get("items") or []}
        merged.update(items)
        body = {
            "fingerprint": current["fingerprint"],
            "items": [{"key": k, "value": v} for k, v in merged.items() if v is not None],
        }
        op = self._api("POST", f"{project_url}/setCommonInstanceMetadata", body)
        while op["status"] != "DONE":
            # operations.wait answers within 2 minutes, DONE or not.
            op = self._api("POST", f"{project_url}/global/operations/{op['name']}/wait", timeout=130)
        if "error" in op:
            raise LocalCloudError(f"setCommonInstanceMetadata of {project}: {op['error']}")
        return self._api("GET", project_url)["commonInstanceMetadata"]

    def _api(self, method: str, url: str, body: object = None, timeout: float = 30.0) -> dict:
        request = urllib.request.Request(
            url,
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise LocalCloudError(f"{method} {url}: {exc.code} {exc.read().decode(errors='replace')}") from None

    def add_image(self, key: str, image_dir: Path) -> None:
        """Make PROJECT/FAMILY `key` boot from `image_dir` (a custom image, in Compute Engine terms)."""
        self.images[key] = Path(image_dir)
        self._control("POST", "images", {key: str(image_dir)})

    def set_first_boot(self, first_boot: FirstBoot) -> None:
        """What the boots of VMs made from now on go through (compute/first_boot.py)."""
        self.first_boot = first_boot
        self._control("POST", "first-boot", {"cloud_init_seconds": first_boot.cloud_init_seconds,
                                             "dpkg_lock_seconds": first_boot.dpkg_lock_seconds})

    def vms(self) -> list[dict]:
        return self._control("GET", "vms")

    def set_vm_file(self, relpath: str, content: str | bytes) -> Path:
        """Write STATE_DIR/vm-etc/RELPATH, seen read-only by every VM at /run/localcloud/."""
        root = (self.state_dir / "vm-etc").resolve()
        path = (root / relpath).resolve()
        if root not in path.parents:
            raise ValueError(f"{relpath!r} is not a path inside vm-etc")
        path.parent.mkdir(parents=True, exist_ok=True)
        data = content.encode() if isinstance(content, str) else content
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)  # readers on the VMs never see a half-written file
        return path

    def deleted_shm(self, name: str) -> Path:
        """The /dev/shm of a deleted VM, kept when the cloud runs with keep_deleted_shm."""
        return self.state_dir / "deleted" / f"{name}-shm"

    def deleted_manifest(self, name: str) -> list | None:
        try:
            return json.loads((self.state_dir / "deleted" / f"{name}.json").read_text())
        except FileNotFoundError:
            return None

    def _control(self, method: str, what: str, body: object = None, base: str | None = None) -> object:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{base or self.base_url}/_localcloud/{what}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise LocalCloudError(f"{method} /_localcloud/{what}: {exc.code} {exc.read().decode(errors='replace')}") from None
