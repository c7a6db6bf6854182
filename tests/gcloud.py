"""Runs the real gcloud CLI offline against the local Compute Engine emulator."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path


def gcloud_runner(config_dir: Path, compute_endpoint: str | None = None) -> Callable[..., subprocess.CompletedProcess]:
    """A function that runs a gcloud command line with its own config folder and a fixed token,
    asserting it succeeds (with `fails=True`: that it exits non-zero, a request the API refuses);
    `env` adds variables. With `compute_endpoint`, gcloud's compute API is the emulator."""
    if shutil.which("gcloud") is None:
        raise AssertionError("gcloud is not installed")
    base_env = {
        **os.environ,
        "CLOUDSDK_CONFIG": str(config_dir),
        "CLOUDSDK_AUTH_ACCESS_TOKEN": "x",
        "CLOUDSDK_CORE_DISABLE_PROMPTS": "1",
        # Keep gcloud off the network: no usage reports or update checks, and no "am I on
        # GCE?" probe (a DNS lookup of metadata.google.internal made for its user agent).
        "CLOUDSDK_CORE_DISABLE_USAGE_REPORTING": "true",
        "CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK": "true",
        "CLOUDSDK_CORE_CHECK_GCE_METADATA": "false",
        "CLOUDSDK_METRICS_ENVIRONMENT": "localcloud",
        "GCE_METADATA_ROOT": "127.0.0.1:1",
        "GCE_METADATA_IP": "127.0.0.1:1",
    }
    if compute_endpoint:
        base_env["CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE"] = compute_endpoint

    def run(command: str, env: dict[str, str] | None = None, *, fails: bool = False) -> subprocess.CompletedProcess:
        args = shlex.split(command)
        assert args[0] == "gcloud"
        done = subprocess.run(args, env={**base_env, **(env or {})}, capture_output=True, text=True, timeout=120)
        assert (done.returncode != 0) == fails, f"{command}\n{done.stdout}\n{done.stderr}"
        return done

    return run
