#!/usr/bin/env bash
# Tutorial step 2: install MaxText into WORK_DIR/maxtext_venv.
# Skips when the venv already has the pinned version (e.g. a custom image that ships it).
# Usage: install_maxtext.sh WORK_DIR MAXTEXT_VERSION
set -euo pipefail
source "$(dirname "$0")/lib.sh"
work_dir=$(resolve_dir "$1")
note_contact "$work_dir"
version=$2
venv="$work_dir/maxtext_venv"

installed_version() {
  "$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("maxtext"))' 2>/dev/null || true
}

if [ "$(installed_version)" = "$version" ]; then
  echo "MaxText $version is already installed in $venv; nothing to do"
  exit 0
fi

echo "Installing MaxText $version into $venv"
# The tutorial's apt commands, through lib.sh's apt_get: on a VM still in its first boot they wait
# for cloud-init and for dpkg's lock (bounded), and answer apt's and dpkg's questions themselves.
wait_for_cloud_init
apt_get update
apt_get upgrade -y --fix-missing
apt_get install -y build-essential cmake ninja-build
if ! command -v uv >/dev/null && [ ! -x "$HOME/.local/bin/uv" ]; then
  curl -LsSf https://astral.sh/uv/install.sh | sh
fi
# shellcheck disable=SC1091
source "$HOME/.local/bin/env"
uv python install 3.12
mkdir -p "$work_dir"
cd "$work_dir"
if [ ! -f maxtext_venv/bin/activate ]; then
  uv venv --python 3.12 --seed maxtext_venv
fi
# shellcheck disable=SC1091
source maxtext_venv/bin/activate
UV_TORCH_BACKEND=cpu uv pip install "maxtext[tpu-post-train]==$version" --resolution=lowest
install_tpu_post_train_extra_deps

if [ "$(installed_version)" != "$version" ]; then
  echo "MaxText $version did not install: the venv reports '$(installed_version)'" >&2
  exit 1
fi
echo "MaxText $version installed in $venv"
