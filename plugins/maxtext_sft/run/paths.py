"""Folders of the project on a worker: include/ (VM scripts, declared jobs, eval) and where runs
without an output location keep their export.

Beside plugins/ by default (the Astronomer and docker-compose layout); inside the package when it
is installed from its wheel (the VM scripts, eval and rehearsal files are its package data, and
the example jobs; a team's own jobs are in the folder MAXTEXT_SFT_JOBS_DIR names). The environment variable
MAXTEXT_SFT_INCLUDE_DIR names the folder instead where a deployment puts it elsewhere, e.g.
Composer's bucket data/ folder, mounted at /home/airflow/gcs/data. Read at call time, with no
network or database, so DAG parsing stays cheap.
"""

from __future__ import annotations

import os
from pathlib import Path


def include_dir() -> Path:
    """MAXTEXT_SFT_INCLUDE_DIR; else the installed distribution's package data (maxtext_sft/include,
    pyproject.toml); else the repository's include/, beside plugins/."""
    if override := os.environ.get("MAXTEXT_SFT_INCLUDE_DIR"):
        return Path(override)
    packaged = packaged_include_dir()
    return packaged if packaged.is_dir() else packaged.parents[2] / "include"


def packaged_include_dir() -> Path:
    """maxtext_sft/include: the wheel's package data (absent in a checkout)."""
    return Path(__file__).resolve().parents[1] / "include"  # this file being maxtext_sft/run/paths.py


def local_output_dir() -> Path:
    """Where runs without an output location keep their export: `[maxtext_sft] local_output_dir`."""
    from airflow.sdk import conf  # imported when used: include_dir() stays free of Airflow (spec layer)

    default = Path(os.environ.get("AIRFLOW_HOME", Path.home() / "airflow")) / "maxtext-sft-outputs"
    return Path(conf.get("maxtext_sft", "local_output_dir", fallback=str(default)))
