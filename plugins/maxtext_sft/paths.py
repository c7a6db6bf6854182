"""Where the project's include/ folder is: VM scripts (vm/), declared jobs (jobs/), eval (eval/).

Beside plugins/ by default (the Astronomer and docker-compose layout). The environment variable
MAXTEXT_SFT_INCLUDE_DIR names the folder instead where a deployment puts it elsewhere, e.g.
Composer's bucket data/ folder, mounted at /home/airflow/gcs/data. Read at call time, with no
network or database, so DAG parsing stays cheap.
"""

from __future__ import annotations

import os
from pathlib import Path


def include_dir() -> Path:
    override = os.environ.get("MAXTEXT_SFT_INCLUDE_DIR")
    return Path(override) if override else Path(__file__).resolve().parents[2] / "include"
