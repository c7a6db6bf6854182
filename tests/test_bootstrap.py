"""The README's commands on a stock Debian 12: `make` gets uv with only Debian's python3 on PATH
(EXTERNALLY-MANAGED, PEP 668: its pip refuses installs), without installing into it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from tests.conftest import REPO

DEBIAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def test_make_gets_uv_into_a_folder_of_its_own_with_only_debians_python(tmp_path):
    python3 = shutil.which("python3", path=DEBIAN_PATH)
    assert python3, "no python3 on Debian's PATH"
    stdlib = subprocess.run([python3, "-c", "import sysconfig; print(sysconfig.get_path('stdlib'))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    # The Python the bootstrap must not install into: Debian's, marked externally managed.
    assert (Path(stdlib) / "EXTERNALLY-MANAGED").is_file(), stdlib
    assert shutil.which("uv", path=DEBIAN_PATH) is None, "a uv on Debian's PATH: nothing to bootstrap"
    before = subprocess.run([python3, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True).stdout

    bootstrap = tmp_path / "uv-bootstrap"
    env = {"PATH": DEBIAN_PATH, "HOME": str(tmp_path), "LANG": "C.UTF-8",
           **{k: v for k, v in os.environ.items() if k.startswith(("PIP_", "UV_INDEX", "UV_CACHE"))}}
    done = subprocess.run(["make", "-s", "-C", str(REPO), "uv", f"UV_BOOTSTRAP={bootstrap}"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    version = re.search(r"^UV_VERSION := (\S+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    uv = bootstrap / "bin" / "uv"
    assert subprocess.run([str(uv), "--version"], capture_output=True, text=True, check=True).stdout.split()[1] == version
    # Debian's Python is as it was; the uv lives in the bootstrap's own virtualenv.
    after = subprocess.run([python3, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True).stdout
    assert after == before and "uv==" not in after
    assert uv.resolve().is_relative_to(bootstrap / "venv")
    # Once there, it is the uv every recipe finds: a second `make uv` installs nothing.
    again = subprocess.run(["make", "-s", "-C", str(REPO), "uv", f"UV_BOOTSTRAP={bootstrap}"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "Installing" not in again.stdout, again.stdout + again.stderr
