"""The recipes' commands that can run here, run as the docs print them (issue 52's "recipes that
work as written"): the VM login key and its SSH connection from docs/google-cloud.md."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def recipe(page: Path, name: str) -> str:
    """The first fenced block after the page's `<!-- recipe: NAME -->` marker, unindented."""
    text = page.read_text()
    after = text[text.index(f"<!-- recipe: {name} -->"):]
    block = re.search(r"```\n(.*?)\n\s*```", after, re.S).group(1)
    return "\n".join(line.strip() for line in block.splitlines())


def test_the_ssh_connection_recipe_makes_a_connection_whose_key_the_ssh_hook_loads(tmp_path, monkeypatch):
    commands = recipe(REPO / "docs" / "google-cloud.md", "ssh-connection")
    # python3 as a deployment's shell finds one; this interpreter's folder first on PATH.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=tmp_path, env=env, check=True, timeout=60)
    connection = (tmp_path / "maxtext_sft_vm_ssh.json").read_text()
    assert json.loads(connection)["extra"]["private_key"].startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    monkeypatch.setenv("AIRFLOW_CONN_MAXTEXT_SFT_VM_SSH", connection)
    from airflow.providers.ssh.hooks.ssh import SSHHook

    hook = SSHHook(ssh_conn_id="maxtext_sft_vm_ssh", remote_host="unused")
    public = (tmp_path / "maxtext_sft_vm_key.pub").read_text().split()
    assert (hook.username, hook.pkey.get_name(), hook.pkey.get_base64()) == ("maxtext", public[0], public[1])
