"""install_maxtext.sh's full install path, with recording stand-ins for what needs the internet.

cloud-init, sudo, curl, uv and MaxText's extra-deps installer are replaced by scripts that write
their arguments to a log; the test asserts the tutorial's commands, in the tutorial's order, each
apt call as a first boot needs it (cloud-init waited for first; apt's settings on sudo's command
line, dpkg's lock waited for, conffile questions answered), then that a second run installs nothing.
"""

from __future__ import annotations

import re
import subprocess
import textwrap
from pathlib import Path

import pytest

from maxtext_sft.vm.steps import vm_scripts_dir

RECORD = 'printf "%s\\n" "$(basename "$0")${UV_TORCH_BACKEND:+ [UV_TORCH_BACKEND=$UV_TORCH_BACKEND]} $*" >>"$RECORD_LOG"'

# What the uv installer that the curl stand-in serves puts in place: a recording uv whose
# `venv` makes a venv-shaped folder and whose `pip install` "installs" the requested version.
UV = textwrap.dedent(
    f"""\
    #!/bin/bash
    {RECORD}
    case "$1 $2" in
      "venv --python")
        mkdir -p "$5/bin"
        printf 'export PATH="%s/bin:$PATH"\\n' "$PWD/$5" >"$5/bin/activate"
        cat >"$5/bin/python" <<'PY'
    #!/bin/bash
    cat "$(dirname "$0")/../installed-version" 2>/dev/null || exit 1
    PY
        chmod +x "$5/bin/python"
        cat >"$5/bin/install_tpu_post_train_extra_deps" <<'DEPS'
    #!/bin/bash
    {RECORD}
    DEPS
        chmod +x "$5/bin/install_tpu_post_train_extra_deps"
        ;;
      "pip install")
        venv=$(dirname "$(dirname "$(command -v python)")")
        echo "${{3##*==}}" >"$venv/installed-version"
        ;;
    esac
    """
)


@pytest.fixture
def machine(tmp_path):
    """A home, a PATH whose cloud-init, sudo and curl record instead of acting, and the command log."""
    home = tmp_path / "home"
    home.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sudo").write_text(f"#!/bin/bash\n{RECORD}\n")
    (bin_dir / "cloud-init").write_text(f"#!/bin/bash\n{RECORD}\n")
    served = tmp_path / "uv-installer.sh"
    served.write_text(
        "mkdir -p \"$HOME/.local/bin\"\n"
        f"cat >\"$HOME/.local/bin/uv\" <<'UV'\n{UV}UV\n"
        "chmod +x \"$HOME/.local/bin/uv\"\n"
        "echo 'export PATH=\"$HOME/.local/bin:$PATH\"' >\"$HOME/.local/bin/env\"\n"
    )
    (bin_dir / "curl").write_text(f"#!/bin/bash\n{RECORD}\ncat {served}\n")
    for tool in ("sudo", "cloud-init", "curl"):
        (bin_dir / tool).chmod(0o755)
    log = tmp_path / "commands.log"
    log.touch()

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(vm_scripts_dir() / "install_maxtext.sh"), "~", "0.2.2"],
            env={"HOME": str(home), "PATH": f"{bin_dir}:/usr/bin:/bin", "RECORD_LOG": str(log)},
            capture_output=True,
            text=True,
            timeout=60,
        )

    return run, log, home


def test_installs_with_the_tutorials_commands_in_order_then_skips(machine):
    run, log, home = machine
    first = run()
    assert first.returncode == 0, first.stdout + first.stderr
    apt = ("sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900"
           " -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold")
    # The lock's timeout is what is left of the bound (900 s): a second may have passed.
    assert [re.sub(r"Timeout=899\b", "Timeout=900", line.rstrip()) for line in log.read_text().splitlines()] == [
        "cloud-init status --wait",
        f"{apt} update",
        f"{apt} upgrade -y --fix-missing",
        f"{apt} install -y build-essential cmake ninja-build",
        "curl -LsSf https://astral.sh/uv/install.sh",
        "uv python install 3.12",
        "uv venv --python 3.12 --seed maxtext_venv",
        "uv [UV_TORCH_BACKEND=cpu] pip install maxtext[tpu-post-train]==0.2.2 --resolution=lowest",
        "install_tpu_post_train_extra_deps",
    ]
    assert "MaxText 0.2.2 installed" in first.stdout
    assert Path(home / "maxtext_venv" / "installed-version").read_text().strip() == "0.2.2"

    before = log.read_text()
    second = run()
    assert second.returncode == 0
    assert "already installed" in second.stdout
    assert log.read_text() == before  # nothing ran again


def test_an_install_that_does_not_yield_the_version_fails(machine, tmp_path):
    run, log, home = machine
    # A venv that exists but whose pip install "installs" nothing.
    venv = home / "maxtext_venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "activate").write_text(f'export PATH="{venv}:$PATH"\n')
    (venv / "python").write_text("#!/bin/bash\necho 0.1.0\n")
    (venv / "python").chmod(0o755)
    (venv / "install_tpu_post_train_extra_deps").write_text("#!/bin/bash\ntrue\n")
    (venv / "install_tpu_post_train_extra_deps").chmod(0o755)
    result = run()
    assert result.returncode != 0
    assert "did not install" in result.stderr
    assert "uv venv" not in log.read_text()  # the existing venv was kept
