"""prepare_rehearsal.sh (the rehearsal kit on the VM) and lib.sh's rule that a kit puts its
sitecustomize.py on PYTHONPATH.

Most tests run the scripts with bash on a small venv whose make_toy_inputs.py is a stand-in that
writes a kit-shaped folder in milliseconds; the last ones make a real kit with the real image's
MaxText venv (marked real_maxtext, as the other tests of that image).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from localcloud import images
from maxtext_sft.vm.steps import vm_scripts_dir
from tests.conftest import REPO

REHEARSAL_SOURCES = REPO / "include" / "rehearsal"
RESULT = "MAXTEXT_SFT_RESULT rehearsal_kit="

# Stands in for make_toy_inputs.py: the kit's top-level layout, one line per run in $GENERATIONS
# (with the PYTHONPATH it saw), and a failure half-way when $FAIL_GENERATOR is set.
FAKE_GENERATOR = textwrap.dedent(
    """\
    import json, os, sys
    from pathlib import Path

    out = Path(sys.argv[1])
    out.mkdir()
    with open(os.environ["GENERATIONS"], "a") as log:
        log.write(json.dumps({"out": str(out), "pythonpath": os.environ.get("PYTHONPATH", "")}) + "\\n")
    (out / "model").mkdir()
    if os.environ.get("FAIL_GENERATOR"):
        sys.exit("generator failed")
    (out / "model" / "config.json").write_text("{}")
    for folder in ("tokenizer", "datasets", "hf_home"):
        (out / folder).mkdir()
    (out / "toy.json").write_text("{}")
    """
)


def bash_env(home: Path, **extra: str) -> dict[str, str]:
    return {"HOME": str(home), "PATH": "/usr/bin:/bin", **extra}


def small_venv(path: Path) -> Path:
    """A real venv (of this interpreter) in which importlib.metadata finds maxtext and transformers."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    purelib = subprocess.run(
        [str(path / "bin" / "python3"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    for name, version in (("maxtext", "0.2.2"), ("transformers", "5.8.0")):
        info = Path(purelib) / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return path


@pytest.fixture(scope="module")
def module_venv(tmp_path_factory) -> Path:
    return small_venv(tmp_path_factory.mktemp("venv") / "maxtext_venv")


class Machine:
    """A home with the venv linked in as install_maxtext.sh leaves it, and copies of the step
    scripts and the rehearsal sources in the repository's layout (so a test may change them)."""

    def __init__(self, root: Path, venv: Path, layout: str = "repository"):
        self.home = root / "home"
        self.home.mkdir()
        (self.home / "maxtext_venv").symlink_to(venv)
        self.generations = root / "generations.jsonl"
        self.generations.touch()
        scripts = root / "scripts"
        self.vm = scripts / "vm"
        self.sources = scripts / "rehearsal" if layout == "repository" else self.vm
        self.sources.mkdir(parents=True, exist_ok=True)
        self.vm.mkdir(exist_ok=True)
        for name in ("lib.sh", "prepare_rehearsal.sh"):
            shutil.copy(vm_scripts_dir() / name, self.vm / name)
        for name in ("sitecustomize.py", "toy_args.json"):
            shutil.copy(REHEARSAL_SOURCES / name, self.sources / name)
        (self.sources / "make_toy_inputs.py").write_text(FAKE_GENERATOR)
        self.kit = self.home / "rehearsal-kit"

    def prepare(self, work_dir: str = "~", check: bool = True, **env: str) -> subprocess.CompletedProcess:
        result = subprocess.run(
            ["bash", str(self.vm / "prepare_rehearsal.sh"), work_dir],
            capture_output=True, text=True, timeout=120, cwd=self.home,
            env=bash_env(self.home, GENERATIONS=str(self.generations), **env),
        )
        if check:
            assert result.returncode == 0, result.stdout + result.stderr
        return result

    def runs(self) -> list[dict]:
        return [json.loads(line) for line in self.generations.read_text().splitlines()]

    def leftovers(self) -> list[str]:
        return sorted(p.name for p in self.home.iterdir() if p.name.startswith(".rehearsal-kit"))


@pytest.fixture
def machine(tmp_path, module_venv) -> Machine:
    return Machine(tmp_path, module_venv)


def test_makes_the_kit_once_and_keeps_it(machine):
    first = machine.prepare()
    assert f"{RESULT}{machine.kit}" in first.stdout
    assert (machine.kit / "site" / "sitecustomize.py").read_bytes() == (REHEARSAL_SOURCES / "sitecustomize.py").read_bytes()
    assert (machine.kit / "toy_args.json").read_bytes() == (REHEARSAL_SOURCES / "toy_args.json").read_bytes()
    recipe = (machine.kit / "recipe").read_text()
    assert "make_toy_inputs.py" in recipe and "maxtext 0.2.2 transformers 5.8.0" in recipe
    # What it made, with each step's args as they apply to this kit.
    assert f"tokenizer_path={machine.kit}/tokenizer" in first.stdout
    config = machine.kit / "model" / "config.json"
    made = config.stat()

    second = machine.prepare()
    assert "keeping it" in second.stdout and f"{RESULT}{machine.kit}" in second.stdout
    assert len(machine.runs()) == 1
    assert (config.stat().st_ino, config.stat().st_mtime_ns) == (made.st_ino, made.st_mtime_ns)
    assert machine.leftovers() == []


def test_a_kit_from_other_sources_is_made_again_without_the_old_kits_patches(machine):
    machine.prepare()
    toy_args = machine.sources / "toy_args.json"
    toy_args.write_text(toy_args.read_text().replace("max_target_length=256", "max_target_length=128"))
    again = machine.prepare()
    assert "Replacing the kit" in again.stdout
    assert "max_target_length=128" in (machine.kit / "toy_args.json").read_text()
    assert machine.leftovers() == []
    first, second = machine.runs()
    # The old kit's site/ is on PYTHONPATH once the venv is active; the generator must not see it.
    assert "rehearsal-kit" not in first["pythonpath"] + second["pythonpath"]


def test_a_failed_generator_leaves_no_kit_and_keeps_an_old_one(machine):
    failed = machine.prepare(check=False, FAIL_GENERATOR="1")
    assert failed.returncode != 0 and "generator failed" in failed.stderr
    assert not machine.kit.exists() and machine.leftovers() == []

    machine.prepare()
    (machine.sources / "make_toy_inputs.py").write_text(FAKE_GENERATOR + "\n# changed\n")
    failed = machine.prepare(check=False, FAIL_GENERATOR="1")
    assert failed.returncode != 0
    assert (machine.kit / "model" / "config.json").is_file() and machine.leftovers() == []


def test_finds_sources_uploaded_beside_the_script(tmp_path, module_venv):
    flat = Machine(tmp_path, module_venv, layout="flat")
    assert not (flat.vm.parent / "rehearsal").exists()
    flat.prepare()
    assert (flat.kit / "site" / "sitecustomize.py").is_file()


def test_work_dir_under_home(machine):
    (machine.home / "work").mkdir()
    (machine.home / "work" / "maxtext_venv").symlink_to(os.readlink(machine.home / "maxtext_venv"))
    result = machine.prepare("~/work")
    assert f"{RESULT}{machine.home}/work/rehearsal-kit" in result.stdout


def test_without_sources_it_says_what_is_missing(machine):
    (machine.sources / "sitecustomize.py").unlink()
    result = machine.prepare(check=False)
    assert result.returncode == 2 and "no rehearsal sources" in result.stderr


# lib.sh's activate_maxtext_venv and PYTHONPATH: a kit with site/sitecustomize.py makes a rehearsal VM.
ACTIVATE_AND_SHOW = 'source "$LIB"; activate_maxtext_venv "$HOME"; activate_maxtext_venv "$HOME"; printf "%s" "${PYTHONPATH-<unset>}"'


@pytest.fixture
def tiny_home(tmp_path) -> Path:
    """A home whose maxtext_venv is only an activate script (all lib.sh checks for)."""
    (tmp_path / "maxtext_venv" / "bin").mkdir(parents=True)
    (tmp_path / "maxtext_venv" / "bin" / "activate").write_text('export VIRTUAL_ENV="$HOME/maxtext_venv"\n')
    return tmp_path


def pythonpath_after_activate(home: Path, pythonpath: str | None = None) -> str:
    env = bash_env(home, LIB=str(vm_scripts_dir() / "lib.sh"))
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    result = subprocess.run(["bash", "-c", ACTIVATE_AND_SHOW], capture_output=True, text=True, env=env, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_without_a_kit_pythonpath_is_left_alone(tiny_home):
    assert pythonpath_after_activate(tiny_home) == "<unset>"
    assert pythonpath_after_activate(tiny_home, "/mine") == "/mine"
    (tiny_home / "rehearsal-kit" / "site").mkdir(parents=True)  # a folder is no kit: no sitecustomize.py
    assert pythonpath_after_activate(tiny_home) == "<unset>"


def test_a_kit_puts_its_site_first_once(tiny_home):
    site = tiny_home / "rehearsal-kit" / "site"
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text("")
    assert pythonpath_after_activate(tiny_home) == str(site)
    assert pythonpath_after_activate(tiny_home, "/mine") == f"{site}:/mine"


def test_the_kits_sitecustomize_wins_at_python_start_up(tmp_path):
    """On PYTHONPATH, the kit's sitecustomize.py is the one site.py imports (PYTHONPATH precedes the
    standard library, where Debian keeps its own), and it installs the kit's patches at start-up."""
    site = tmp_path / "rehearsal-kit" / "site"
    site.mkdir(parents=True)
    shutil.copy(REHEARSAL_SOURCES / "sitecustomize.py", site)
    code = (
        "import json, os, sys, sitecustomize; "
        "finders = [f for f in sys.meta_path if getattr(f, 'maxtext_rehearsal_patches', False) is True]; "
        "print(json.dumps({'file': sitecustomize.__file__, 'configs': [str(f.model_config) for f in finders], "
        "'jax': os.environ.get('JAX_PLATFORMS')}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report == {"file": str(site / "sitecustomize.py"),
                      "configs": [str(tmp_path / "rehearsal-kit" / "model" / "config.json")], "jax": "cpu"}


# The real kit, made with the real image's MaxText venv (the image's own toy hook off, offline).
@pytest.fixture(scope="module")
def real_kit(tmp_path_factory):
    image = images.build_real_image()
    home = tmp_path_factory.mktemp("rehearsal-home")
    (home / "maxtext_venv").symlink_to(image / "maxtext_venv")
    env = bash_env(home, LOCALCLOUD_TOY_SITE="0", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

    def prepare() -> tuple[subprocess.CompletedProcess, float]:
        started = time.monotonic()
        result = subprocess.run(["bash", str(vm_scripts_dir() / "prepare_rehearsal.sh"), "~"], capture_output=True,
                                text=True, timeout=600, cwd=home, env=env)
        assert result.returncode == 0, result.stdout + result.stderr[-3000:]
        return result, time.monotonic() - started

    first, _ = prepare()
    return home, env, first, prepare


@pytest.mark.real_maxtext
def test_a_real_kit_is_made_once(real_kit):
    home, _, first, prepare = real_kit
    kit = home / "rehearsal-kit"
    assert "Made the rehearsal kit" in first.stdout
    config = json.loads((kit / "model" / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert config["text_config"]["num_hidden_layers"] == 34 and config["text_config"]["hidden_size"] == 64
    assert (kit / "tokenizer" / "tokenizer.json").is_file()
    assert (kit / "datasets" / "ultrachat_200k" / "data" / "train_sft-00000-of-00001.parquet").is_file()
    weights = kit / "model" / "model.safetensors"
    made = weights.stat()

    second, seconds = prepare()
    assert "keeping it" in second.stdout
    assert seconds < 15, seconds  # no MaxText import, no model made
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns) == (made.st_ino, made.st_mtime_ns)
    assert sorted(p.name for p in home.iterdir() if p.name.startswith(".rehearsal-kit")) == []


@pytest.mark.real_maxtext
def test_in_the_real_venv_the_kits_patches_apply(real_kit):
    """With the kit, MaxText's gemma3-4b config is the kit model's, patched by the kit's own
    sitecustomize: also when the image's toy hook is on (the kit's replaces its patches)."""
    home, env, _, _ = real_kit
    # The module is loaded through the installed finder, skipping `import maxtext` (12 s of JAX and
    # TensorFlow imports), as tests/localcloud/test_real_image.py does.
    code = textwrap.dedent(
        """
        import importlib.util, json, sys, sysconfig
        [finder] = [f for f in sys.meta_path if getattr(f, "maxtext_rehearsal_patches", False) is True]
        utils = sysconfig.get_paths()["purelib"] + "/maxtext/checkpoint_conversion/utils"
        spec = finder.find_spec("maxtext.checkpoint_conversion.utils.hf_model_configs", [utils])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        text = module.HF_MODEL_CONFIGS["gemma3-4b"].text_config
        print(json.dumps({"module": type(finder).__module__, "config": str(finder.model_config),
                          "widths": [text.hidden_size, text.intermediate_size, text.head_dim, text.num_hidden_layers]}))
        """
    )
    for toy_site in ("0", "1"):
        result = subprocess.run(
            ["bash", "-c", 'source "$LIB"; activate_maxtext_venv "$HOME"; python3 -c "$CODE"'],
            capture_output=True, text=True, timeout=120, cwd=home,
            env={**env, "LOCALCLOUD_TOY_SITE": toy_site, "LIB": str(vm_scripts_dir() / "lib.sh"), "CODE": code},
        )
        assert result.returncode == 0, result.stderr[-3000:]
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert report == {"module": "sitecustomize", "config": str(home / "rehearsal-kit" / "model" / "config.json"),
                          "widths": [64, 128, 32, 34]}, toy_site
