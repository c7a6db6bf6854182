#!/bin/sh
# localcloud stand-in for uv's installer (what curl serves for https://astral.sh/uv/install.sh):
# like the real one, puts uv in ~/.local/bin and writes ~/.local/bin/env, which adds that folder
# to PATH when sourced. The uv it installs is this image's stand-in (lib/uv).
set -eu
mkdir -p "$HOME/.local/bin"
cp "@IMAGE_DIR@/lib/uv" "$HOME/.local/bin/uv"
chmod 755 "$HOME/.local/bin/uv"
cat >"$HOME/.local/bin/env" <<'ENV'
case ":${PATH}:" in
  *:"$HOME/.local/bin":*) ;;
  *) export PATH="$HOME/.local/bin:$PATH" ;;
esac
ENV
echo "installing to $HOME/.local/bin (localcloud stand-in)"
echo "  uv"
echo "everything's installed!"
