"""Images: custom images made from a boot disk (images.insert with `sourceDisk`), and the boot
image an instance's insert names.

instances.stop keeps a VM's files; images.insert with `sourceDisk` makes an image of a boot disk
(a global operation; the image READY when it is DONE), which instances boot from by name, family
(global/images/family/F) or family view (zones/-/imageFamilyViews/F); see disk_images.py for
what an image holds. Local base images (PROJECT/FAMILY → folder) are given to the emulator
(--images-file, or the control call POST /_localcloud/images).

Owns: ImageResources (the custom_images table; the base images), CustomImage. Imports
operations, instances (the Instance whose disk an image is made of), disk_images, resources and
errors.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
import shutil
import threading
import zlib
from pathlib import Path

from . import disk_images, errors
from .errors import ApiError
from .instances import Instance
from .operations import Operations
from .resources import (
    NAME, Link, Request, check_labels, new_fingerprint, new_id, now_rfc3339, query_arg, region_of, relative_url,
    validated_body, zonal_list,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class CustomImage:
    """An image made by images.insert: its resource, and the folder a VM boots from once READY."""

    project: str
    resource: dict
    image_dir: Path
    sequence: int  # creation order: the newest of a family wins (creationTimestamp may tie)

    @property
    def name(self) -> str:
        return self.resource["name"]

    @property
    def usable(self) -> bool:
        """READY and not deprecated: what a family resolves to (images.getFromFamily)."""
        return self.resource["status"] == "READY" and "deprecated" not in self.resource


class ImageResources(Operations):
    images: dict[str, Path]  # the local base images, "PROJECT/FAMILY" → folder (set by ComputeEmulator)

    def __init__(self) -> None:
        super().__init__()
        self.custom_images: dict[tuple[str, str], CustomImage] = {}  # (project, name) → image
        self.image_sequence = 0

    # ----- images ------------------------------------------------------------------------------
    # Custom images made from a boot disk (images.insert with sourceDisk), the way a team bakes a
    # VM with its software into an image family. Compute Engine v1's discovery document: images
    # are global resources; insert, delete (and deprecate, not emulated) answer with a global
    # operation; `status` is PENDING until the image is made, then READY ("An image can be used to
    # create other resources, such as instances, only after ... the status is set to READY");
    # getFromFamily "Returns the latest image that is part of an image family and is not
    # deprecated". Only the sourceDisk kind of source is emulated.

    def _newest_of_family(self, project: str, family: str) -> CustomImage | None:
        """The newest READY, not deprecated image of `family` in `project` (under the lock)."""
        found = [
            image for image in self.custom_images.values()
            if image.project == project and image.resource.get("family") == family and image.usable
        ]
        return max(found, key=lambda image: image.sequence, default=None)

    def _base_image_resource(self, project: str, family: str) -> dict | None:
        """A local base image (given to the emulator as PROJECT/FAMILY) as images.getFromFamily
        answers for it: READY, named after its family."""
        image_dir = self.images.get(f"{project}/{family}")
        if image_dir is None:
            return None
        path = f"projects/{project}/global/images/{family}"
        return {
            "kind": "compute#image",
            "id": str(zlib.crc32(path.encode()) + 10**18),
            "creationTimestamp": "2024-01-01T00:00:00.000-00:00",
            "name": family,
            "family": family,
            "sourceType": "RAW",
            "status": "READY",
            "selfLink": Link(path),
        }

    def list_images(self, project: str, req: Request) -> dict:
        with self.lock:
            resources = [copy.deepcopy(i.resource) for i in self.custom_images.values() if i.project == project]
        return zonal_list("compute#imageList", f"projects/{project}/global/images", resources, req)

    def get_image(self, project: str, image: str, req: Request) -> dict:
        with self.lock:
            found = self.custom_images.get((project, image))
            if found is None:
                raise errors.not_found(f"projects/{project}/global/images/{image}")
            return copy.deepcopy(found.resource)

    def get_image_from_family(self, project: str, family: str, req: Request) -> dict:
        with self.lock:
            found = self._newest_of_family(project, family)
            if found is not None:
                return copy.deepcopy(found.resource)
            base = self._base_image_resource(project, family)
            if base is None:
                raise errors.not_found(f"projects/{project}/global/images/family/{family}")
            return base

    def _source_disk(self, project: str, source: str) -> tuple[Instance, dict, str]:
        """The instance whose attached disk `source` names, that attached disk, and the disk's
        path (under the lock). A disk lives here only as an instance's disk: one that no instance
        holds (never made, or deleted with its auto-deleted instance) does not exist."""
        m = re.fullmatch(r"(?:projects/(?P<p>[^/]+)/)?zones/(?P<z>[^/]+)/disks/(?P<d>[^/]+)", relative_url(source))
        if not m:
            raise errors.invalid_field_value("resource.sourceDisk", source, "Must be a URL to a disk resource.")
        path = f"projects/{m.group('p') or project}/zones/{m.group('z')}/disks/{m.group('d')}"
        for inst in self.instances.values():
            for disk in inst.resource["disks"]:
                if isinstance(disk.get("source"), Link) and disk["source"].path == path and disk.get("boot"):
                    return inst, disk, path
        raise errors.not_found(path)

    def insert_image(self, project: str, req: Request) -> dict:
        body = validated_body(req, "compute.images.insert", "Image", "image_resource")
        request_id = query_arg(req.query, "requestId")
        force = (query_arg(req.query, "forceCreate") or "false").lower() == "true"
        with self.lock:
            if replayed := self._replayed(project, request_id):
                return replayed
            name = body["name"]
            path = f"projects/{project}/global/images/{name}"
            sources = [k for k in ("sourceDisk", "sourceImage", "sourceSnapshot", "rawDisk") if body.get(k)]
            if len(sources) != 1:
                # "Invalid resource usage: 'Must specify exactly one source for an image.'", 400
                # (ansible-collections/google.cloud#378); the reason as for the API's other
                # "Invalid resource usage" errors (see delete_instance).
                raise ApiError(
                    400, "invalidResourceUsage", "Invalid resource usage: 'Must specify exactly one source for an image.'."
                )
            if sources != ["sourceDisk"]:
                raise errors.invalid(f"localcloud: images.insert from {sources[0]} is not emulated; use sourceDisk.")
            if (project, name) in self.custom_images:
                raise errors.already_exists(path)
            family = body.get("family")
            if family is not None and not NAME.fullmatch(family):
                raise errors.invalid_field_value("resource.family", family, f"Must be a match of regex '{NAME.pattern}'")
            check_labels(body.get("labels") or {}, "resource.labels")
            inst, disk, disk_path = self._source_disk(project, body["sourceDisk"])
            if inst.status != "TERMINATED" and not force:
                # The disk of a VM that runs (or is not yet stopped) is in use: "The disk resource
                # 'projects/P/zones/Z/disks/D' is already being used by 'projects/P/zones/Z/instances/I'",
                # 400 resourceInUseByAnotherResource (hashicorp/terraform#23698 gives the body;
                # ansible/ansible#61634 the same message from images.insert of an attached disk).
                # Compute Engine's docs: stop the VM first, or pass forceCreate.
                raise ApiError(
                    400,
                    "resourceInUseByAnotherResource",
                    f"The disk resource '{disk_path}' is already being used by '{inst.path}'",
                )
            self.image_sequence += 1
            resource = {
                **{k: copy.deepcopy(v) for k, v in body.items() if k != "params"},
                "kind": "compute#image",
                "id": new_id(),
                "creationTimestamp": now_rfc3339(),
                "name": name,
                "sourceDisk": Link(disk_path),
                "sourceDiskId": inst.boot_disk_id,
                "sourceType": "RAW",
                "status": "PENDING",
                "diskSizeGb": disk.get("diskSizeGb", "10"),
                "labelFingerprint": new_fingerprint(),
                # The default storage location is the multi-region of the disk's region.
                "storageLocations": [region_of(inst.zone).split("-", 1)[0]],
                "selfLink": Link(path),
            }
            image = CustomImage(
                project, resource, self.state_dir / "images" / project / f"{name}-{resource['id']}", self.image_sequence
            )
            self.custom_images[(project, name)] = image
            op = self._register_operation(project, None, "insert", path, resource["id"], request_id)
        threading.Thread(target=self._run_image_insert, args=(image, inst, op), daemon=True).start()
        return copy.deepcopy(op)

    def _run_image_insert(self, image: CustomImage, inst: Instance, op: dict) -> None:
        self._op_running(op)
        try:
            with inst.work_lock:  # the disk's files hold still while they are copied
                if inst.vm is None or not inst.vm.root.is_dir():
                    raise RuntimeError(f"the disk of {inst.path} has no files")
                size = disk_images.capture(inst.vm.root, inst.image_dir, image.image_dir)
        except Exception as exc:
            log.exception("image %s failed", image.name)
            with self.changed:
                image.resource["status"] = "FAILED"
            self._op_done(op, ("INTERNAL_ERROR", f"localcloud: {exc}"), 500)
            return
        with self.changed:
            image.resource["status"] = "READY"
            image.resource["archiveSizeBytes"] = str(size)
        self._op_done(op)

    def delete_image(self, project: str, image: str, req: Request) -> dict:
        request_id = query_arg(req.query, "requestId")
        with self.lock:
            if replayed := self._replayed(project, request_id):
                return replayed
            found = self.custom_images.get((project, image))
            if found is None:
                raise errors.not_found(f"projects/{project}/global/images/{image}")
            if found.resource["status"] == "PENDING":
                raise errors.not_ready(f"projects/{project}/global/images/{image}")
            found.resource["status"] = "DELETING"
            op = self._register_operation(
                project, None, "delete", f"projects/{project}/global/images/{image}", found.resource["id"], request_id
            )
        threading.Thread(target=self._run_image_delete, args=(found, op), daemon=True).start()
        return copy.deepcopy(op)

    def _run_image_delete(self, image: CustomImage, op: dict) -> None:
        self._op_running(op)
        with self.lock:
            if self.custom_images.get((image.project, image.name)) is image:
                del self.custom_images[(image.project, image.name)]
        # VMs booted from it hold copies of its files: removing the folder takes nothing from them.
        shutil.rmtree(image.image_dir, ignore_errors=True)
        self._op_done(op)

    def _resolve_boot_image(self, project: str, disk: dict, field: str) -> Path | None:
        if disk.get("source"):
            raise errors.not_found(relative_url(disk["source"]))
        source = (disk.get("initializeParams") or {}).get("sourceImage")
        if not source:
            raise errors.invalid_field_value(f"{field}.initializeParams.sourceImage", "", "Source image must be specified.")
        rel = relative_url(source)
        patterns = (
            r"projects/(?P<p>[^/]+)/global/images/family/(?P<f>[^/]+)",
            r"projects/(?P<p>[^/]+)/zones/[^/]+/imageFamilyViews/(?P<f>[^/]+)",
            r"projects/(?P<p>[^/]+)/global/images/(?P<f>[^/]+)",
            r"global/images/family/(?P<f>[^/]+)",
            r"global/images/(?P<f>[^/]+)",
        )
        for pattern in patterns:
            m = re.fullmatch(pattern, rel)
            if m:
                image_project = m.groupdict().get("p") or project
                family = m.group("f")
                by_family = "family" in pattern or "FamilyViews" in pattern
                # The project's own images (images.insert) first: by name, or the newest usable
                # one of a family; then the local base images this emulator was given.
                if by_family:
                    custom = self._newest_of_family(image_project, family)
                else:
                    custom = self.custom_images.get((image_project, family))
                    if custom is not None and not custom.usable:
                        raise errors.not_ready(f"projects/{image_project}/global/images/{family}")
                if custom is not None:
                    return custom.image_dir
                key = f"{image_project}/{family}"
                if key in self.images:
                    image_dir = self.images[key]
                    return image_dir if image_dir.is_dir() else None
                kind = "images/family" if "family" in pattern or "FamilyViews" in pattern else "images"
                raise errors.not_found(f"projects/{image_project}/global/{kind}/{family}")
        raise errors.invalid_field_value(f"{field}.initializeParams.sourceImage", source, "Invalid image URL.")

    def add_base_images(self, images: dict[str, str]) -> dict[str, str]:
        """Add local base images ("PROJECT/FAMILY" → folder; the control call); all of them now."""
        with self.lock:
            self.images.update({key: Path(value) for key, value in images.items()})
            return {key: str(value) for key, value in self.images.items()}
