"""Projects and zones: projects.get, projects.setCommonInstanceMetadata (a global operation),
zones.get.

Projects carry commonInstanceMetadata; the guest-agent role (guest_agent.py) reads it with each
instance's metadata (OS Login, guest.py). Zones come from catalog.py.

Owns: ProjectResources (the project_metadata table). Imports operations, instances (the
Instance type), resources, catalog and errors.
"""

from __future__ import annotations

import copy
import logging
import threading
import zlib

from . import catalog, errors
from .instances import Instance
from .operations import Operations
from .resources import Link, Request, check_metadata, query_arg, region_of, stored_metadata, validated_body

log = logging.getLogger(__name__)


class ProjectResources(Operations):
    def __init__(self) -> None:
        super().__init__()
        self.project_metadata: dict[str, dict] = {}  # project → commonInstanceMetadata

    def get_project(self, project: str, req: Request) -> dict:
        # No `defaultServiceAccount`: like a project whose Compute Engine default service
        # account was removed. gcloud then sends no serviceAccounts, matching the captured
        # reference requests of the tutorial.
        with self.lock:
            metadata = copy.deepcopy(self._project_metadata(project))
        return {
            "kind": "compute#project",
            "id": str(zlib.crc32(project.encode()) + 10**11),
            "creationTimestamp": "2024-01-01T00:00:00.000-00:00",
            "name": project,
            "commonInstanceMetadata": metadata,
            "quotas": [],
            "selfLink": Link(f"projects/{project}"),
            "xpnProjectStatus": "UNSPECIFIED_XPN_PROJECT_STATUS",
            "defaultNetworkTier": "PREMIUM",
            "vmDnsSetting": "ZONAL_ONLY",
        }

    def _project_metadata(self, project: str) -> dict:
        """A project's commonInstanceMetadata (under the lock); a new project has none."""
        return self.project_metadata.setdefault(project, {"kind": "compute#metadata", "fingerprint": "localcloud0="})

    def set_common_instance_metadata(self, project: str, req: Request) -> dict:
        """projects.setCommonInstanceMetadata, what `gcloud compute project-info add-metadata`
        sends (the whole item list with the fingerprint from projects.get): a global operation.
        The guest agent of every VM of the project then applies it (OS Login, see guest.py)."""
        body = validated_body(req, "compute.projects.setCommonInstanceMetadata", "Metadata", "metadata_resource")
        request_id = query_arg(req.query, "requestId")
        with self.lock:
            if replayed := self._replayed(project, request_id):
                return replayed
            if body.get("fingerprint") != self._project_metadata(project)["fingerprint"]:
                raise errors.fingerprint_mismatch()
            check_metadata(body, "resource")
            self.project_metadata[project] = stored_metadata(body)
            # A global operation; its operationType is named like the zonal ones are (the
            # method's name: "setMetadata" for instances.setMetadata).
            op = self._register_operation(
                project, None, "setCommonInstanceMetadata", f"projects/{project}",
                str(zlib.crc32(project.encode()) + 10**11), request_id,
            )
            instances = [i for i in self.instances.values() if i.project == project]
        threading.Thread(target=self._run_project_metadata, args=(instances, op), daemon=True).start()
        return copy.deepcopy(op)

    def _run_project_metadata(self, instances: list[Instance], op: dict) -> None:
        self._op_running(op)
        try:
            for inst in instances:
                self._apply_guest_accounts(inst)
        except Exception as exc:
            log.exception("applying project metadata failed")
            self._op_done(op, ("INTERNAL_ERROR", f"localcloud: {exc}"), 500)
            return
        self._op_done(op)

    def get_zone(self, project: str, zone: str, req: Request) -> dict:
        # zones.get of a zone that does not exist: 404 notFound (gke-terraform-generator#24),
        # while zonal methods answer 400 "Unknown zone." (see dispatch).
        if not catalog.known_zone(zone):
            raise errors.not_found(f"projects/{project}/zones/{zone}")
        return {
            "kind": "compute#zone",
            "id": str(2000 + sum(map(ord, zone))),
            "creationTimestamp": "1969-12-31T16:00:00.000-08:00",
            "name": zone,
            "description": zone,
            "status": "UP",
            "region": Link(f"projects/{project}/regions/{region_of(zone)}"),
            "selfLink": Link(f"projects/{project}/zones/{zone}"),
            "availableCpuPlatforms": ["Intel Emerald Rapids", "AMD Genoa"],
            "supportsPzs": False,
        }
