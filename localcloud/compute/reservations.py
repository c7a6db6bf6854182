"""Reservations: read-only through the API (reservations.get, list and aggregatedList); tests
create them with the control call POST /_localcloud/reservations (`set_reservation`).

An insert that targets a reservation by name (SPECIFIC_RESERVATION) fails on its operation, as
Compute Engine reports it (CONDITION_NOT_MET), when the reservation is missing from the zone,
reserves another machine type or is fully used (see the error catalog, error_catalog.py);
otherwise the instance consumes one unit of it until it is deleted or stopped (see
`ReservationResources.reservation_in_use`).

Owns: ReservationResources (the reservations table), Reservation, ReservationRefused,
RESERVATION_NAME_KEY. Imports operations, resources, catalog and errors; reads the instances
table (instances.py) through the emulator.
"""

from __future__ import annotations

import dataclasses
import re

from . import catalog, errors
from .operations import Operations
from .resources import NAME, Link, Request, aggregated_list, new_id, now_rfc3339, relative_url, zonal_list

# reservationAffinity.key that names a reservation (SPECIFIC_RESERVATION).
RESERVATION_NAME_KEY = "compute.googleapis.com/reservation-name"


@dataclasses.dataclass
class Reservation:
    """A specific reservation of `count` VMs of one machine type in one zone."""

    project: str
    zone: str
    name: str
    count: int
    machine_type: str  # a name, as the reservation's instanceProperties.machineType holds it
    shared_with: tuple[str, ...] = ()  # consumer projects besides its own (SPECIFIC_PROJECTS)
    id: str = dataclasses.field(default_factory=new_id)
    creation_timestamp: str = dataclasses.field(default_factory=now_rfc3339)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.project, self.zone, self.name)

    @property
    def path(self) -> str:
        return f"projects/{self.project}/zones/{self.zone}/reservations/{self.name}"


class ReservationRefused(Exception):
    """A specific reservation the insert names cannot take it: the INSTANCE_ERRORS preset to fail with."""

    def __init__(self, preset: str) -> None:
        super().__init__(preset)
        self.preset = preset


class ReservationResources(Operations):
    def __init__(self) -> None:
        super().__init__()
        self.reservations: dict[tuple[str, str, str], Reservation] = {}

    def reservation_in_use(self, reservation: Reservation) -> int:
        """How many instances consume `reservation` (under the lock): those not deleted and not
        stopped. A stopped (TERMINATED) instance gives its unit back on Compute Engine, and a
        restart consumes again; this emulator never restarts one, so it simply stops counting.
        An instance being deleted (STOPPING) still holds its unit until it is gone."""
        return sum(
            1 for inst in self.instances.values() if inst.reservation == reservation.key and inst.status != "TERMINATED"
        )

    def reservation_to_consume(
        self, project: str, zone: str, body: dict, resource: dict
    ) -> tuple[str, str, str] | None:
        """The reservation a new instance consumes (under the lock), or ReservationRefused naming
        the INSTANCE_ERRORS preset the insert's operation then fails with (see the error catalog:
        the sources show these errors on the operation).

        Only affinity SPECIFIC_RESERVATION by name (key compute.googleapis.com/reservation-name)
        is enforced; its value is a reservation of the instance's project, or
        "projects/OTHER/reservations/NAME" (a shared reservation), always in the instance's zone.
        Other affinities (any reservation, none, by label) consume nothing here.
        """
        affinity = body.get("reservationAffinity") or {}
        if affinity.get("consumeReservationType") != "SPECIFIC_RESERVATION":
            return None
        if affinity.get("key") != RESERVATION_NAME_KEY:
            return None
        values = affinity.get("values") or []
        if not values:
            raise errors.required_field("resource.reservationAffinity.values")
        m = re.fullmatch(r"(?:projects/(?P<project>[^/]+)/reservations/)?(?P<name>[^/]+)", relative_url(values[0]))
        key = (m.group("project") or project, zone, m.group("name")) if m else None
        reservation = self.reservations.get(key) if key else None
        if reservation is None:
            raise ReservationRefused("reservation_not_found")
        if project != reservation.project and project not in reservation.shared_with:
            # Only the owner project and the projects it is shared with may consume it (Google's
            # "Create a shared reservation"). How the API words the refusal was not found in a
            # public capture; the project cannot see the reservation, so it is answered as one
            # that does not exist (CA's isReservationNotFound shape, error_catalog.py).
            raise ReservationRefused("reservation_not_found")
        if resource["machineType"].path.rsplit("/", 1)[1] != reservation.machine_type:
            raise ReservationRefused("reservation_incompatible")
        if self.reservation_in_use(reservation) >= reservation.count:
            raise ReservationRefused("reservation_full")
        return reservation.key

    def _reservation_resource(self, reservation: Reservation) -> dict:
        """compute#reservation as the API returns it (under the lock); int64 counts are strings."""
        base = f"projects/{reservation.project}/zones/{reservation.zone}"
        return {
            "kind": "compute#reservation",
            "id": reservation.id,
            "creationTimestamp": reservation.creation_timestamp,
            "name": reservation.name,
            "zone": Link(base),
            "selfLink": Link(reservation.path),
            "status": "READY",
            "specificReservationRequired": True,
            # ShareSettings (v1 discovery document): LOCAL, or SPECIFIC_PROJECTS with a projectMap
            # of ShareSettingsProjectConfig keyed by project id.
            "shareSettings": (
                {
                    "shareType": "SPECIFIC_PROJECTS",
                    "projectMap": {p: {"projectId": p} for p in reservation.shared_with},
                }
                if reservation.shared_with
                else {"shareType": "LOCAL"}
            ),
            "specificReservation": {
                "count": str(reservation.count),
                "inUseCount": str(self.reservation_in_use(reservation)),
                "instanceProperties": {"machineType": reservation.machine_type},
            },
        }

    def get_reservation(self, project: str, zone: str, reservation: str, req: Request) -> dict:
        with self.lock:
            found = self.reservations.get((project, zone, reservation))
            if found is None:
                raise errors.not_found(f"projects/{project}/zones/{zone}/reservations/{reservation}")
            return self._reservation_resource(found)

    def list_reservations(self, project: str, zone: str, req: Request) -> dict:
        with self.lock:
            resources = [
                self._reservation_resource(r) for r in self.reservations.values() if (r.project, r.zone) == (project, zone)
            ]
        return zonal_list("compute#reservationList", f"projects/{project}/zones/{zone}/reservations", resources, req)

    def aggregated_list_reservations(self, project: str, req: Request) -> dict:
        """What `gcloud compute reservations list` asks: every zone's, grouped by zone."""
        with self.lock:
            resources = [self._reservation_resource(r) for r in self.reservations.values() if r.project == project]
        return aggregated_list("compute#reservationAggregatedList", project, "reservations", resources, req)

    def set_reservation(self, settings: object) -> dict:
        """Create a reservation, or change the count and machine type of an existing one (the
        control call; Compute Engine's own insert and resize are not emulated)."""
        expected = (
            "Expected {\"project\", \"zone\", \"name\", \"count\": N >= 1, \"machine_type\", "
            "\"shared_with\"?: [project, ...]}."
        )
        required = {"project", "zone", "name", "count", "machine_type"}
        if not isinstance(settings, dict) or not required <= set(settings) <= required | {"shared_with"}:
            raise errors.invalid(expected)
        shared_with = settings.get("shared_with") or []
        if not isinstance(shared_with, list) or not all(isinstance(p, str) and p for p in shared_with):
            raise errors.invalid(expected)
        project, zone, name = settings["project"], settings["zone"], settings["name"]
        count, machine_type = settings["count"], settings["machine_type"]
        if not all(isinstance(v, str) and v for v in (project, machine_type)):
            raise errors.invalid(expected)
        if not isinstance(zone, str) or not catalog.known_zone(zone):
            raise errors.unknown_zone(zone)
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise errors.invalid_field_value("name", name, f"Must be a match of regex '{NAME.pattern}'")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise errors.invalid(expected)
        with self.lock:
            reservation = self.reservations.get((project, zone, name))
            if reservation is None:
                reservation = Reservation(project, zone, name, count, machine_type, tuple(shared_with))
                self.reservations[reservation.key] = reservation
            else:
                reservation.count, reservation.machine_type = count, machine_type
                reservation.shared_with = tuple(shared_with)
            return self._reservation_resource(reservation)
