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
A "real" kind with the real MaxText can be added to IMAGE_KINDS later.

CLI: `python -m localcloud.images fast` builds if needed and prints the image dir.
"""

import argparse
import base64
import compileall
import datetime
import hashlib
import json
import os
import py_compile
import shutil
import subprocess
import tempfile
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


def cache_root_default() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_ROOT)


def _recipe_hash(kind: str, files: list[Path], base: Path) -> str:
    """Hash of everything an image is built from: kind, builder version, source files."""
    digest = hashlib.sha256(f"{kind}\n{BUILDER_VERSION}\n{os.path.realpath(SYSTEM_PYTHON)}\n".encode())
    for path in files:
        digest.update(f"{path.relative_to(base)}\n".encode())
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


def _build_cached(kind: str, recipe: str, build, cache_root: Path | None) -> Path:
    """Return `<cache root>/<kind>-<recipe>`, building it with build(image_dir) if it is missing."""
    cache_root = Path(cache_root) if cache_root is not None else cache_root_default()
    image_dir = cache_root / f"{kind}-{recipe[:16]}"
    if image_dir.is_dir():  # only ever created by a rename of a finished build
        return image_dir
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".tmp-{kind}-", dir=cache_root))
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
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return image_dir


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

    # Refuse to publish an image whose venv does not work.
    check = "import importlib.metadata as m, maxtext; print(m.version('maxtext'), maxtext.__file__)"
    output = subprocess.run([python, "-c", check], check=True, capture_output=True, text=True, cwd=image_dir).stdout
    if not output.startswith(f"{STANDIN_VERSION} {site_packages}"):
        raise RuntimeError(f"the fast image's venv does not work: {output!r}")


def build_fast_image(cache_root: Path | None = None) -> Path:
    """The image whose skel/maxtext_venv runs the MaxText stand-in; built once per recipe."""
    recipe = _recipe_hash("fast", _standin_files(), STANDIN_SOURCE)
    return _build_cached("fast", recipe, _build_fast, cache_root)


IMAGE_KINDS = {"fast": build_fast_image}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m localcloud.images", description="Build a local-cloud VM image.")
    parser.add_argument("kind", choices=sorted(IMAGE_KINDS))
    parser.add_argument("--cache-root", type=Path, default=None,
                        help=f"default: ${CACHE_ENV} or {DEFAULT_CACHE_ROOT}")
    args = parser.parse_args(argv)
    print(IMAGE_KINDS[args.kind](args.cache_root))


if __name__ == "__main__":
    main()
