"""Compute Engine v1 emulator whose VMs are real sshd processes on 127.0.0.N:22.

Run it as `python -m localcloud.compute --state-dir DIR [--port 0] [--images-file FILE]
[--vm-env-file FILE] [--first-boot-cloud-init S] [--first-boot-dpkg-lock S]`, or through `localcloud.cloud.LocalCloud`. Modules, each importing only
modules below it in this list:
- server: the HTTP server, the table of API routes, the /_localcloud/ controls
- emulator: ComputeEmulator, made of one mixin per resource family:
  - groups: multi-host TPU slices (resource policies, instance templates, instance groups)
  - images: custom images made from a boot disk, the boot image of an insert
  - guest_agent: instances.setMetadata, the guest agent's accounts, guest attributes
  - projects: projects (commonInstanceMetadata) and zones
  - lifecycle: the VMs behind the instances, time limits, the cloud's own terminations
  - instances: instances through the API (insert, get, list, delete, stop)
  - scheduling: a new instance's time limit and host maintenance, checked
  - reservations: reservations and what an instance consumes of one
  - networks: VPC networks and subnetworks, and the network an instance's interface joins
  - operations: zonal, regional and global operations (the base of every family)
  - core: the one lock and the settings every family shares
- faults: the faults tests switch on
- error_catalog: the API's wording of its refusals to create an instance
- iam: the permissions each API method needs, checked against a bound caller's
- leases: machine-wide leases of the VMs' loopback addresses
- resources: links, ids, timestamps, body checks and list paging every family shares
- vm: sandbox VMs (unshare'd sshd) and reaping of stale ones
- first_boot: a VM's first boot (cloud-init running, dpkg's lock held) and the VM's own apt-get,
  apt and cloud-init (the programs in guest_os/, run inside the VMs)
- guest_power: a power-off from inside a VM
- guest: the guest agent's account handling (ssh-keys metadata → users)
- disk_images: what an image of a boot disk holds
- schema: body validation against the discovery document
- filters: the `filter` parameter of list calls
- catalog: zones and the machine types each offers
- errors: error bodies in the real API's shape
- testing: helpers for tests (discovery client, insert body, operation wait)
"""

from .emulator import ComputeEmulator
from .server import make_server

__all__ = ["ComputeEmulator", "make_server"]
