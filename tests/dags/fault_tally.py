"""The fault tests' tally: every test that injects a fault counts here, whichever file it is in.

tests/conftest.py prints it as the session's last line (when any fault test ran), adding up the
tallies of pytest-xdist's workers when the tests ran in parallel.
"""

from __future__ import annotations

TALLY = {"faults injected": 0, "VMs leaked": 0, "runs whose error named the cause": 0, "failed runs": 0}


def fault_injected() -> None:
    TALLY["faults injected"] += 1


def vms_left(vms: list) -> None:
    TALLY["VMs leaked"] += len(vms)


def failed_run(error: str, cause: str) -> None:
    """Count a failed run, and whether its error names the cause (asserted by the caller too)."""
    TALLY["failed runs"] += 1
    if cause in error:
        TALLY["runs whose error named the cause"] += 1


def add(counts: dict[str, int]) -> None:
    for key, value in counts.items():
        TALLY[key] += value


def tally_line() -> str:
    return "Fault matrix: " + ", ".join(f"{key}: {value}" for key, value in TALLY.items())
