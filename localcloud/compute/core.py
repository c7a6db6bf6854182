"""What every resource family of the compute emulator shares at run time: the one lock over all
of its tables, the condition (`changed`) that waiters park on, `closing`, and the settings the
emulator was made with.

Owns: EmulatorCore, the base of every family's mixin. ComputeEmulator (emulator.py) sets the
settings, then runs each family's __init__ through super(): each makes its own tables. Imports
only the standard library.
"""

from __future__ import annotations

import threading
from pathlib import Path


class EmulatorCore:
    # The settings; ComputeEmulator sets them before the families' __init__ run.
    state_dir: Path
    keep_deleted_shm: bool
    vm_env: dict[str, str]
    operation_wait_timeout: float
    vm_ready_timeout: float
    first_boot: object  # first_boot.FirstBoot: what each VM's boot goes through

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.closing = False
