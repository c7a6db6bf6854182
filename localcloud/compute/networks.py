"""VPC networks and subnetworks: read-only through the API (networks.get, subnetworks.get);
tests create them with the control call POST /_localcloud/networks (`set_network`).

Every project has the auto-mode network `default` (what a new project gets), with a subnetwork
named like it in each region; other networks exist once a test makes them. An instance insert
is checked against them as Compute Engine checks it (see `nic_network`): a custom-mode network
needs a subnetwork, and a subnetwork must exist, in the project that owns it (a Shared VPC's host
project). The subnetwork's region against the instance's zone, and a subnetwork of another network
than the one named, are not checked: no public capture of those refusals of an instance insert
was found (preflight checks both before a run inserts anything).

Owns: NetworkResources (the networks table), Network. Imports operations, resources and errors.
"""

from __future__ import annotations

import dataclasses
import re

from . import errors
from .operations import Operations
from .resources import NAME, Link, Request, new_id, now_rfc3339, region_of, relative_url

DEFAULT_NETWORK = "default"
_NETWORK = re.compile(r"(?:projects/(?P<project>[^/]+)/)?global/networks/(?P<name>[^/]+)")
_SUBNETWORK = re.compile(r"(?:projects/(?P<project>[^/]+)/)?regions/(?P<region>[^/]+)/subnetworks/(?P<name>[^/]+)")


@dataclasses.dataclass
class Network:
    """A VPC network: auto mode (a subnetwork in every region, named like the network) or custom
    mode (only the subnetworks made for it: {region: {name: ip_cidr_range}})."""

    project: str
    name: str
    auto: bool
    subnetworks: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    id: str = dataclasses.field(default_factory=new_id)

    @property
    def path(self) -> str:
        return f"projects/{self.project}/global/networks/{self.name}"

    def subnetwork_range(self, region: str, name: str) -> str | None:
        if self.auto and name == self.name:
            return "10.128.0.0/20"  # an auto-mode subnetwork's range varies by region; one stands for all
        return self.subnetworks.get(region, {}).get(name)


class NetworkResources(Operations):
    def __init__(self) -> None:
        super().__init__()
        self.networks: dict[tuple[str, str], Network] = {}

    def _network(self, project: str, name: str) -> Network | None:
        """The project's network `name` (under the lock); `default` exists in every project."""
        found = self.networks.get((project, name))
        if found is None and name == DEFAULT_NETWORK:
            found = self.networks[(project, name)] = Network(project, name, auto=True)
        return found

    def _subnetwork(self, project: str, region: str, name: str) -> tuple[Network, str] | None:
        """(its network, its range) for subnetwork `name` of `project` in `region` (under the lock)."""
        self._network(project, DEFAULT_NETWORK)
        for network in [n for (p, _), n in self.networks.items() if p == project]:
            cidr = network.subnetwork_range(region, name)
            if cidr is not None:
                return network, cidr
        return None

    def nic_network(self, project: str, zone: str, index: int, nic: dict) -> tuple[str, str]:
        """(network path, subnetwork path) of an insert's network interface `index` (under the
        lock), as Compute Engine resolves them: the network is inferred from the subnetwork when
        only that is given, and `default` is taken when neither is (the v1 discovery document,
        NetworkInterface.network). Refusals, each as the API words it:
        - a subnetwork that does not exist: 400 invalid, "Invalid value for field
          'resource.networkInterfaces[0].subnetwork': '<as sent>'. The referenced subnetwork
          resource cannot be found." (hashicorp/terraform-provider-google#2140, a Shared VPC's);
        - a custom-mode network without a subnetwork: 400 invalid, "Invalid value for field
          'resource.networkInterfaces[0]': ''. Subnetwork should be specified for custom subnetmode
          network" (datastax-archive/google-compute-engine-dse#27 shows the whole error body;
          GoogleCloudDataproc/bdutil#88 and hashicorp/terraform-provider-google#175 the same message);
        - a network that does not exist: 404 notFound, "The resource 'projects/P/global/networks/N'
          was not found" (the API's notFound, errors.not_found; public reports quote it, "Error 404:
          ..., notFound", for a firewall insert and for `gcloud compute images export`'s check of a
          missing network; a capture of an instance insert's own was not found)."""
        sent_subnet = nic.get("subnetwork")
        if sent_subnet:
            m = _SUBNETWORK.fullmatch(relative_url(sent_subnet))
            found = self._subnetwork(m.group("project") or project, m.group("region"), m.group("name")) if m else None
            if found is None:
                raise errors.invalid_field_value(
                    f"resource.networkInterfaces[{index}].subnetwork", sent_subnet,
                    "The referenced subnetwork resource cannot be found.",
                )
            network, _ = found
            subnet_path = f"projects/{network.project}/regions/{m.group('region')}/subnetworks/{m.group('name')}"
            return network.path, subnet_path
        sent_network = nic.get("network") or f"global/networks/{DEFAULT_NETWORK}"
        m = _NETWORK.fullmatch(relative_url(sent_network))
        owner, name = (m.group("project") or project, m.group("name")) if m else (project, sent_network)
        network = self._network(owner, name)
        if network is None:
            raise errors.not_found(f"projects/{owner}/global/networks/{name}")
        if not network.auto:
            raise errors.invalid_field_value(
                f"resource.networkInterfaces[{index}]", "", "Subnetwork should be specified for custom subnetmode network"
            )
        return network.path, f"projects/{owner}/regions/{region_of(zone)}/subnetworks/{name}"

    def _network_resource(self, network: Network) -> dict:
        """compute#network as networks.get returns it (under the lock)."""
        regions = sorted(network.subnetworks)
        return {
            "kind": "compute#network",
            "id": network.id,
            "creationTimestamp": "2024-01-01T00:00:00.000-00:00",
            "name": network.name,
            "selfLink": Link(network.path),
            "autoCreateSubnetworks": network.auto,
            "subnetworks": [
                Link(f"projects/{network.project}/regions/{region}/subnetworks/{name}")
                for region in regions
                for name in sorted(network.subnetworks[region])
            ],
            "routingConfig": {"routingMode": "REGIONAL"},
            "networkFirewallPolicyEnforcementOrder": "AFTER_CLASSIC_FIREWALL",
            "mtu": 1460,
        }

    def get_network(self, project: str, network: str, req: Request) -> dict:
        with self.lock:
            found = self._network(project, network)
            if found is None:
                raise errors.not_found(f"projects/{project}/global/networks/{network}")
            return self._network_resource(found)

    def get_subnetwork(self, project: str, region: str, subnetwork: str, req: Request) -> dict:
        with self.lock:
            found = self._subnetwork(project, region, subnetwork)
            path = f"projects/{project}/regions/{region}/subnetworks/{subnetwork}"
            if found is None:
                raise errors.not_found(path)
            network, cidr = found
            return {
                "kind": "compute#subnetwork",
                "id": new_id(),
                "creationTimestamp": now_rfc3339(),
                "name": subnetwork,
                "network": Link(network.path),
                "ipCidrRange": cidr,
                "region": Link(f"projects/{project}/regions/{region}"),
                "selfLink": Link(path),
                "privateIpGoogleAccess": False,
                "purpose": "PRIVATE",
                "stackType": "IPV4_ONLY",
            }

    def set_network(self, settings: object) -> dict:
        """Create or replace a network (the control call; Compute Engine's own inserts are not
        emulated): {"project", "name", "auto": bool, "subnetworks"?: [{"region", "name",
        "ip_cidr_range"}]}. Returns it as networks.get does."""
        expected = (
            'Expected {"project", "name", "auto": true | false, '
            '"subnetworks"?: [{"region", "name", "ip_cidr_range"}]}.'
        )
        if not isinstance(settings, dict) or not {"project", "name", "auto"} <= set(settings) <= {
            "project", "name", "auto", "subnetworks"
        }:
            raise errors.invalid(expected)
        project, name, auto = settings["project"], settings["name"], settings["auto"]
        if not isinstance(project, str) or not project or not isinstance(auto, bool):
            raise errors.invalid(expected)
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise errors.invalid_field_value("name", name, f"Must be a match of regex '{NAME.pattern}'")
        subnetworks: dict[str, dict[str, str]] = {}
        for subnet in settings.get("subnetworks") or []:
            if not isinstance(subnet, dict) or set(subnet) != {"region", "name", "ip_cidr_range"}:
                raise errors.invalid(expected)
            if not NAME.fullmatch(str(subnet["name"])):
                raise errors.invalid_field_value("name", subnet["name"], f"Must be a match of regex '{NAME.pattern}'")
            subnetworks.setdefault(str(subnet["region"]), {})[subnet["name"]] = str(subnet["ip_cidr_range"])
        with self.lock:
            network = Network(project, name, auto, subnetworks)
            self.networks[(project, name)] = network
            return self._network_resource(network)
