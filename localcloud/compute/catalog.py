"""The zones the emulator knows and the machine types each offers.

A zone or machine type missing here is refused the way Compute Engine refuses one that does
not exist (see errors.unknown_zone, errors.unknown_machine_type), so a typo in a run's conf
fails locally as it would in the cloud. The table is a subset of the real one: what the
project, its tests and the tutorial use, and their neighbours.

Sources:
- TPU machine types and the zones of each TPU generation: Google's "TPU regions and zones"
  (cloud.google.com/tpu/docs/types-zones; v6e: us-central1-b, us-east1-d, us-east5-a,
  us-east5-b, ...; v5e: us-central1-a, us-south1-a, us-west1-c, us-west4-a, us-east5-a/b/c;
  v5p: us-central1-a, us-east5-a, ...) and "Plan TPUs in GKE"
  (cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus), whose tables name the
  single-host machine types ct6e-standard-1t/4t/8t (v6e), ct5lp-hightpu-1t/4t/8t (v5e) and
  ct5p-hightpu-4t (v5p).
- E2 and N2 machine types: Google's "General-purpose machine family"
  (cloud.google.com/compute/docs/general-purpose-machines), offered in every zone listed.
"""

from __future__ import annotations

# Single-host TPU machine types, by generation.
TPU_V6E = ("ct6e-standard-1t", "ct6e-standard-4t", "ct6e-standard-8t")
TPU_V5E = ("ct5lp-hightpu-1t", "ct5lp-hightpu-4t", "ct5lp-hightpu-8t")
TPU_V5P = ("ct5p-hightpu-4t",)

GENERAL_PURPOSE = (
    "e2-micro", "e2-small", "e2-medium",
    *(f"e2-standard-{n}" for n in (2, 4, 8, 16, 32)),
    *(f"n2-standard-{n}" for n in (2, 4, 8, 16, 32, 48, 64, 80, 96, 128)),
)

_TPU_ZONES = {
    "us-central1-a": TPU_V5E + TPU_V5P,
    "us-central1-b": TPU_V6E,
    "us-central1-c": (),
    "us-central1-f": (),
    "us-east1-b": (),
    "us-east1-c": (),
    "us-east1-d": TPU_V6E,
    "us-east5-a": TPU_V6E + TPU_V5E + TPU_V5P,
    "us-east5-b": TPU_V6E + TPU_V5E + TPU_V5P,
    "us-east5-c": TPU_V6E + TPU_V5E + TPU_V5P,
    "us-south1-a": TPU_V5E,
    "us-west1-c": TPU_V5E,
    "us-west4-a": TPU_V5E,
    "europe-west4-a": (),
    "europe-west4-b": (),
}

# zone → the machine types it offers.
MACHINE_TYPES: dict[str, frozenset[str]] = {
    zone: frozenset(GENERAL_PURPOSE + tpus) for zone, tpus in _TPU_ZONES.items()
}


def known_zone(zone: str) -> bool:
    return zone in MACHINE_TYPES


def offers(zone: str, machine_type: str) -> bool:
    return machine_type in MACHINE_TYPES.get(zone, ())


def is_tpu(machine_type: str) -> bool:
    """TPU VMs (ct*): their hosts cannot live-migrate."""
    return machine_type in TPU_V6E + TPU_V5E + TPU_V5P
