"""Builds the VM image directories of the local cloud.

An image is a directory whose `skel/` becomes a VM user's home (the VM
emulator copies it, symlinks preserved). Images are cached outside the
checkout, under `<cache root>/<kind>-<recipe hash>`, and rebuilt only when
their recipe changes. A build happens in a temporary directory that is
renamed into place, so a reader (or a concurrent builder) never sees half an
image. Everything in an image is world-readable: the VM user is not root.

Kinds:
  fast  `skel/maxtext_venv/`: a venv of Debian's /usr/bin/python3 holding the
        MaxText stand-in (localcloud/maxtext_standin) installed as maxtext 0.2.2.
        (/root's pyenv Python would not do: /root is private to root.)
  real  the real MaxText 0.2.2 and toy-size inputs made locally (see build_real_image):
          maxtext_venv/         venv of Debian's /usr/bin/python3, installed from the locks in
                                localcloud/image_recipes/ (CPU torch, no TPU/CUDA packages)
          skel/maxtext_venv ->  <image>/maxtext_venv (absolute symlink: a new VM user's home
                                gets the link, not 6 GB of copies)
          toy/                  made by the rehearsal kit's include/rehearsal/make_toy_inputs.py
                                with the venv's python
        The venv's site-packages has localcloud_toy.pth + toy_site.py (image_recipes/toy_site.py):
        offline Hugging Face defaults, and the rehearsal kit's MaxText patches
        (include/rehearsal/sitecustomize.py, there as maxtext_rehearsal_patches.py) applied to the
        image's toy: MaxText's gemma3-4b HF config shrunk to the toy model, and the export's shard
        threshold lowered so that the toy export is sharded like a 4B one.

  bare  no MaxText: install_maxtext.sh installs the stand-in for real, offline (build_bare_image).

CLI: `python -m localcloud.images fast|real|bare` builds if needed and prints the image dir.
"""

import argparse
import base64
import compileall
import datetime
import fcntl
import hashlib
import json
import os
import py_compile
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

# Bump when the way images are built changes, to invalidate cached images.
BUILDER_VERSION = 1
DEFAULT_CACHE_ROOT = Path("/var/cache/maxtext-sft-localcloud/images")
CACHE_ENV = "LOCALCLOUD_IMAGE_CACHE"
SYSTEM_PYTHON = "/usr/bin/python3"
STANDIN_SOURCE = Path(__file__).resolve().parent / "maxtext_standin"
STANDIN_VERSION = "0.2.2"  # the MaxText version the stand-in imitates
VENV_NAME = "maxtext_venv"
# The tutorial's boot image ("image_project/image_family"), the key under which the
# Compute Engine emulator is given an image directory.
TUTORIAL_IMAGE = "ubuntu-os-accelerator-images/ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e"


# Folders a sandbox VM mounts its own copy over. The real image's skel links to its venv by
# absolute path, so that image must live elsewhere (the fast one is copied, so it may not).
VM_PRIVATE_DIRS = ("/tmp", "/var/tmp", "/home", "/root", "/run", "/dev/shm", "/etc/ssh")


def cache_root_default() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_ROOT)


def check_cache_root(cache_root: Path) -> Path:
    resolved = Path(os.path.realpath(cache_root))
    for private in VM_PRIVATE_DIRS:
        if resolved == Path(private) or Path(private) in resolved.parents:
            raise ValueError(
                f"image cache {cache_root} is under {private}, which every VM replaces with its own; "
                f"choose another folder (e.g. the default {DEFAULT_CACHE_ROOT}) for {CACHE_ENV}"
            )
    return resolved


def _recipe_hash(kind: str, files: list[Path], base: Path | None, extra: str = "") -> str:
    """Hash of everything an image is built from: kind, builder version, source files (each named
    by its path under `base`, or with no base by its file name alone: unique names from several
    folders, as the real image's are)."""
    digest = hashlib.sha256(f"{kind}\n{BUILDER_VERSION}\n{os.path.realpath(SYSTEM_PYTHON)}\n".encode())
    if extra:
        digest.update(f"{extra}\n".encode())
    for path in files:
        digest.update(f"{path.name if base is None else path.relative_to(base)}\n".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _make_world_readable(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue  # chmod would follow the link (e.g. to /usr/bin/python3)
        if path.is_dir() or os.access(path, os.X_OK):
            path.chmod(0o755)
        else:
            path.chmod(0o644)


def _image_dir(kind: str, recipe: str, cache_root: Path | None) -> Path:
    cache_root = Path(cache_root) if cache_root is not None else cache_root_default()
    return cache_root / f"{kind}-{recipe[:16]}"


def _build_cached(kind: str, recipe: str, build, cache_root: Path | None) -> Path:
    """Return `<cache root>/<kind>-<recipe>`, building it with build(image_dir) if it is missing."""
    image_dir = _image_dir(kind, recipe, cache_root)
    cache_root = image_dir.parent
    if image_dir.is_dir():  # only ever created by a rename of a finished build
        return image_dir
    cache_root.mkdir(parents=True, exist_ok=True)
    # One build at a time per image: a parallel test worker waits for the first builder's image
    # instead of spending minutes of a 2-core machine building its own copy.
    with open(cache_root / f".{image_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if image_dir.is_dir():
            return image_dir
        _build_into(kind, recipe, build, image_dir)
    return image_dir


def _say(text: str) -> None:
    """A build's progress, as it goes (`make run` prints it; a test captures it)."""
    print(f"  image: {text}", flush=True)


def _build_into(kind: str, recipe: str, build, image_dir: Path) -> None:
    cache_root = image_dir.parent
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".tmp-{kind}-", dir=cache_root))
    started = time.monotonic()
    _say(f"building the {kind} image into {image_dir} (once per recipe) ...")
    try:
        build(tmp_dir)
        (tmp_dir / "image.json").write_text(json.dumps({
            "kind": kind, "recipe": recipe, "builder_version": BUILDER_VERSION,
            "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        }, indent=2) + "\n")
        _make_world_readable(tmp_dir)
        try:
            os.rename(tmp_dir, image_dir)
        except OSError:
            if not image_dir.is_dir():
                raise
            # A concurrent builder finished first; its image is as good as ours.
        _say(f"the {kind} image built in {time.monotonic() - started:.0f} s")
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _standin_files() -> list[Path]:
    package = STANDIN_SOURCE / "maxtext"
    return sorted(path for path in package.rglob("*.py") if "__pycache__" not in path.parts)


def _record_line(site_packages: Path, path: Path) -> str:
    """One RECORD line of a wheel install: path, urlsafe-base64 sha256 without padding, size."""
    data = path.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path.relative_to(site_packages)},sha256={digest},{len(data)}"


def _build_fast(image_dir: Path) -> None:
    venv = image_dir / "skel" / VENV_NAME
    venv.parent.mkdir(parents=True)
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True)
    # The build path is wrong once skel/ is copied to a home: make activate use the home.
    for script in ("activate", "activate.csh", "activate.fish"):
        path = venv / "bin" / script
        path.write_text(path.read_text().replace(str(venv), f'"$HOME/{VENV_NAME}"'))

    python = str(venv / "bin" / "python3")
    site_packages = Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip())
    _install_standin(site_packages)

    # Refuse to publish an image whose venv does not work.
    check = "import importlib.metadata as m, maxtext; print(m.version('maxtext'), maxtext.__file__)"
    output = subprocess.run([python, "-c", check], check=True, capture_output=True, text=True, cwd=image_dir).stdout
    if not output.startswith(f"{STANDIN_VERSION} {site_packages}"):
        raise RuntimeError(f"the fast image's venv does not work: {output!r}")


def _install_standin(site_packages: Path) -> None:
    """Put the MaxText stand-in into `site_packages` as an installed maxtext distribution: the
    package, hash-checked .pyc files and a dist-info that importlib.metadata reads."""
    # Copy the source (not a link to the checkout): the VM user may not be able to read the checkout.
    for source in _standin_files():
        target = site_packages / source.relative_to(STANDIN_SOURCE)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    # Hash-checked .pyc files stay valid when the home copy changes mtimes.
    compileall.compile_dir(site_packages / "maxtext", quiet=1,
                           invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)

    dist_info = site_packages / f"maxtext-{STANDIN_VERSION}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: maxtext\nVersion: {}\n"
        "Summary: Local-cloud stand-in for MaxText (not MaxText; see maxtext/__init__.py)\n".format(STANDIN_VERSION))
    (dist_info / "INSTALLER").write_text("localcloud.images\n")
    (dist_info / "top_level.txt").write_text("maxtext\n")
    installed = sorted(path for path in site_packages.rglob("*") if path.is_file())
    lines = [_record_line(site_packages, path) for path in installed]
    lines.append(f"{dist_info.name}/RECORD,,")
    (dist_info / "RECORD").write_text("\n".join(lines) + "\n")


def build_fast_image(cache_root: Path | None = None) -> Path:
    """The image whose skel/maxtext_venv runs the MaxText stand-in; built once per recipe."""
    recipe = _recipe_hash("fast", _standin_files(), STANDIN_SOURCE)
    return _build_cached("fast", recipe, _build_fast, cache_root)


RECIPES_DIR = Path(__file__).resolve().parent / "image_recipes"
BARE_RECIPE_DIR = RECIPES_DIR / "bare"
# What install_maxtext.sh runs that needs the internet, as offline stand-ins (see build_bare_image).
# (sudo is Debian's real one and apt-get every VM's own, compute/first_boot.py.)
BARE_TOOLS = ("curl",)
BARE_LIBS = ("uv", "uv-installer.sh", "install_tpu_post_train_extra_deps")


def _bare_files() -> list[Path]:
    return sorted(BARE_RECIPE_DIR.iterdir())


def _build_bare(image_dir: Path, final_dir: Path) -> None:
    """A base image without MaxText, on which install_maxtext.sh does its real work offline."""
    (image_dir / "skel").mkdir()
    for folder, names in (("bin", BARE_TOOLS), ("lib", BARE_LIBS)):
        (image_dir / folder).mkdir()
        for name in names:
            text = (BARE_RECIPE_DIR / name).read_text().replace("@IMAGE_DIR@", str(final_dir))
            (image_dir / folder / name).write_text(text)
            (image_dir / folder / name).chmod(0o755)
    _install_standin(image_dir / "packages" / f"maxtext-{STANDIN_VERSION}")
    # The image's /etc/environment: its stand-ins come first on every SSH session's PATH.
    path = f"{final_dir}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    (image_dir / "environment.json").write_text(json.dumps({"PATH": path}, indent=1) + "\n")


def build_bare_image(cache_root: Path | None = None) -> Path:
    """The base image without MaxText (what the tutorial's image is): `install_maxtext.sh` installs
    it for real, offline. The internet tools it calls are stand-ins first on the VM's PATH
    (`bin/`: curl serves only uv's installer, which installs the `lib/uv` stand-in; its `sudo
    apt-get` calls meet Debian's real sudo and every VM's apt-get, compute/first_boot.py); that uv makes the venv with Debian's Python
    and installs `maxtext[tpu-post-train]==V` from `packages/maxtext-V/` (the MaxText stand-in,
    as the fast image has it) — only V = 0.2.2 exists, any other version fails to resolve."""
    recipe = _recipe_hash("bare", [*_bare_files(), *_standin_files()], Path(__file__).resolve().parent)
    cache_root = check_cache_root(Path(cache_root) if cache_root is not None else cache_root_default())
    final_dir = _image_dir("bare", recipe, cache_root)
    return _build_cached("bare", recipe, lambda image_dir: _build_bare(image_dir, final_dir), cache_root)


REAL_LOCK = RECIPES_DIR / "real-maxtext.lock"
REAL_WHEEL_LOCK = RECIPES_DIR / "real-maxtext-wheel.lock"
# The rehearsal kit's (product code, include/rehearsal): the image's toy is made, and MaxText
# patched for it, exactly as on a rehearsal VM.
REHEARSAL_DIR = Path(__file__).resolve().parents[1] / "include" / "rehearsal"
TOY_GENERATOR = REHEARSAL_DIR / "make_toy_inputs.py"
REHEARSAL_PATCHES = REHEARSAL_DIR / "sitecustomize.py"
REHEARSAL_PATCHES_MODULE = "maxtext_rehearsal_patches"  # its name in the venv (toy_site imports it)
TOY_SITE = RECIPES_DIR / "toy_site.py"
# Bump when _build_real changes in a way that changes the image.
REAL_BUILDER_VERSION = 2
# The CPU build of torch 2.13.0 (Python 3.11) that this machine kind keeps on disk; real-maxtext.lock
# pins it (PyPI's torch is a multi-GB CUDA build). uv does not look there unless told.
TORCH_WHEEL_DIR = Path("/opt/wheels")


def _real_files() -> list[Path]:
    return [REAL_LOCK, REAL_WHEEL_LOCK, TOY_GENERATOR, REHEARSAL_PATCHES, TOY_SITE]


def _uv() -> str:
    uv = shutil.which("uv")
    if uv is None:
        raise RuntimeError("the real image is built with uv: install it (e.g. `pip install uv`, as `make venv` does)")
    return uv


def _run_uv(*args: str) -> None:
    # UV_PYTHON_DOWNLOADS=never: uv must use Debian's Python, never fetch one (only PyPI is reachable).
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never", "UV_NO_PROGRESS": "1"}
    for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(key, None)
    subprocess.run([_uv(), *args], check=True, env=env)


def _toy_env() -> dict[str, str]:
    """Environment for running the image venv's python during the build: offline, no repo venv."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "HF_TOKEN")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NO_GCE_CHECK="True",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONWARNINGS="ignore::FutureWarning")
    return env


# Run in the finished venv before the image is published; prints one JSON line.
_REAL_CHECK = """
import importlib.metadata, json, os
from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS
from maxtext.checkpoint_conversion.utils.utils import shard_checkpoint
from transformers import AutoTokenizer
import maxtext.trainers.post_train.sft.train_sft  # the heaviest of the three entry points imports
tokenizer = AutoTokenizer.from_pretrained("google/gemma-3-4b-it")
print(json.dumps({
    "maxtext": importlib.metadata.version("maxtext"),
    "torch": importlib.metadata.version("torch"),
    "hidden_size": HF_MODEL_CONFIGS["gemma3-4b"].text_config.hidden_size,
    "tokenizer_size": len(tokenizer),
    "chat_template": bool(tokenizer.chat_template),
    "hf_hub_offline": os.environ.get("HF_HUB_OFFLINE"),
    "export_sharded_below_3_gib": shard_checkpoint.__defaults__[0] < 3 * 1024**3,  # toy_site's threshold
}))
"""


def _build_real(image_dir: Path, final_dir: Path) -> None:
    """Build the real image in image_dir; absolute links point at final_dir, its published name."""
    if not (TORCH_WHEEL_DIR / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").is_file():
        raise RuntimeError(f"the CPU torch wheel that real-maxtext.lock pins is not in {TORCH_WHEEL_DIR}")
    venv = image_dir / VENV_NAME
    # Relocatable: activate and console scripts find the venv from their own location, so they work
    # from the final image dir (the build happens in a temp dir) and through ~/maxtext_venv.
    _say("installing MaxText 0.2.2, JAX, the CPU torch and their locked dependencies into its venv (uv) ...")
    _run_uv("venv", "-q", "--relocatable", "--python", SYSTEM_PYTHON, str(venv))
    python = str(venv / "bin" / "python3")
    # Exactly the locked set: --no-deps (no resolution), hashes required; pyc compiled now because
    # the VM user cannot write __pycache__ into the image.
    _run_uv("pip", "install", "-q", "--python", python, "--no-deps", "--require-hashes", "--compile-bytecode",
            "--find-links", str(TORCH_WHEEL_DIR), "-r", str(REAL_LOCK))
    # The wheel declares Python >= 3.12 (the torch CPU wheel here is 3.11): --python-version 3.12
    # lets uv install it; --no-deps because its dependencies are the lock above.
    _run_uv("pip", "install", "-q", "--python", python, "--no-deps", "--require-hashes", "--compile-bytecode",
            "--python-version", "3.12", "-r", str(REAL_WHEEL_LOCK))

    _say("making the toy inputs (a tiny gemma3-4b-shaped checkpoint, a tokenizer, small chat datasets) ...")
    made = subprocess.run([python, str(TOY_GENERATOR), str(image_dir / "toy")], env=_toy_env(), cwd=image_dir,
                          capture_output=True, text=True)
    if made.returncode != 0:
        raise RuntimeError(f"making the toy inputs failed:\n{made.stderr[-4000:]}")

    site_packages = Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip())
    # Not as sitecustomize.py: Debian's would shadow it, and under that name it would patch for a
    # kit beside it rather than for the image's toy (toy_site does that).
    for source, name in ((REHEARSAL_PATCHES, REHEARSAL_PATCHES_MODULE), (TOY_SITE, "toy_site")):
        shutil.copyfile(source, site_packages / f"{name}.py")
        py_compile.compile(str(site_packages / f"{name}.py"), doraise=True)
    (site_packages / "localcloud_toy.pth").write_text("import toy_site\n")

    skel = image_dir / "skel"
    skel.mkdir()
    (skel / VENV_NAME).symlink_to(final_dir / VENV_NAME)

    # Refuse to publish an image whose venv does not work (HF_HUB_OFFLINE unset: the hook sets it).
    _say("checking the venv (MaxText's imports, the tokenizer) ...")
    env = _toy_env()
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(key)
    output = subprocess.run([python, "-c", _REAL_CHECK], check=True, capture_output=True, text=True,
                            cwd=image_dir, env=env).stdout.strip().splitlines()[-1]
    report = json.loads(output)
    toy = json.loads((image_dir / "toy" / "toy.json").read_text())
    expected = {"maxtext": "0.2.2", "torch": "2.13.0+cpu", "hidden_size": toy["maxtext_dims"]["base_emb_dim"],
                "tokenizer_size": 262144, "chat_template": True, "hf_hub_offline": "1",
                "export_sharded_below_3_gib": True}
    if report != expected:
        raise RuntimeError(f"the real image's venv does not work: {report} != {expected}")


def real_recipe() -> str:
    """The real image's recipe hash: its locks, toy generator, MaxText patches and start-up hook,
    builder version. Files are named without their folder: moving one changes no image."""
    return _recipe_hash("real", _real_files(), None, extra=f"real-builder {REAL_BUILDER_VERSION}")


def build_real_image(cache_root: Path | None = None) -> Path:
    """The image with the real MaxText 0.2.2 and toy inputs; built once per recipe (~6.5 GB, ~2 min)."""
    recipe = real_recipe()
    cache_root = check_cache_root(Path(cache_root) if cache_root is not None else cache_root_default())
    final_dir = _image_dir("real", recipe, cache_root)
    return _build_cached("real", recipe, lambda image_dir: _build_real(image_dir, final_dir), cache_root)


IMAGE_KINDS = {"fast": build_fast_image, "real": build_real_image, "bare": build_bare_image}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m localcloud.images", description="Build a local-cloud VM image.")
    parser.add_argument("kind", choices=sorted(IMAGE_KINDS))
    parser.add_argument("--cache-root", type=Path, default=None,
                        help=f"default: ${CACHE_ENV} or {DEFAULT_CACHE_ROOT}")
    args = parser.parse_args(argv)
    print(IMAGE_KINDS[args.kind](args.cache_root))


if __name__ == "__main__":
    main()
