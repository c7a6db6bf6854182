#!/usr/bin/env bash
# The rehearsal's step before convert: make WORK_DIR/rehearsal-kit, with which MaxText's
# gemma3-4b runs at toy size on a CPU VM. Nothing is downloaded: the toy is made here, from the
# MaxText venv's own packages. The kit holds
#   model/ tokenizer/ datasets/ hf_home/ toy.json   made by make_toy_inputs.py
#   site/sitecustomize.py   MaxText's patches for the toy. lib.sh's activate_maxtext_venv puts
#                           site/ first on PYTHONPATH whenever the kit exists: the kit's
#                           presence is what makes this VM a rehearsal VM
#   toy_args.json           the extra MaxText args of each step, paths written as "{kit}/..."
#   recipe                  what the kit was made from (its sources' sha256, package versions)
# Safe to run twice: a kit made from the same recipe is kept; otherwise one is made in a
# temporary folder beside it and renamed into place, so a kit is never seen half made.
# The sources (make_toy_inputs.py, sitecustomize.py, toy_args.json) are include/rehearsal, found
# beside this script's folder (a checkout; the VM's copy of include/ has the same layout) or in
# this script's folder.
# Prints "MAXTEXT_SFT_RESULT rehearsal_kit=PATH".
# Usage: prepare_rehearsal.sh WORK_DIR
set -euo pipefail
source "$(dirname "$0")/lib.sh"
work_dir=$(resolve_dir "$1")
note_contact "$work_dir"
kit="$work_dir/rehearsal-kit"
sources=(make_toy_inputs.py sitecustomize.py toy_args.json)

script_dir=$(cd "$(dirname "$0")" && pwd)
source_dir=""
for candidate in "$script_dir/../rehearsal" "$script_dir"; do
  if [ -f "$candidate/${sources[0]}" ] && [ -f "$candidate/${sources[1]}" ] && [ -f "$candidate/${sources[2]}" ]; then
    source_dir=$(cd "$candidate" && pwd)
    break
  fi
done
if [ -z "$source_dir" ]; then
  echo "no rehearsal sources (${sources[*]}) in $script_dir/../rehearsal or $script_dir" >&2
  exit 2
fi

# The generator must see MaxText's own gemma3-4b config, not one a kit made before shrinks.
outer_pythonpath=${PYTHONPATH:-}
activate_maxtext_venv "$work_dir"

# The kit depends on its sources and on the venv's MaxText (configs, tokenizer) and transformers.
recipe="$(cd "$source_dir" && sha256sum "${sources[@]}")
$(python3 -c 'import importlib.metadata as m; print(*(f"{p} {m.version(p)}" for p in ("maxtext", "transformers")))')"

print_kit() {
  echo "Rehearsal kit: $kit"
  # -l: hf_home/ holds hard links to the model's and tokenizer's files
  (cd "$kit" && du -shl -- */ toy.json toy_args.json | sed 's/^/  /')
  echo "Extra MaxText args per step, and the dataset, with this kit:"
  python3 - "$kit" <<'PY'
import json
import sys

kit = sys.argv[1]
for step, value in json.loads(open(f"{kit}/toy_args.json").read()).items():
    if isinstance(value, dict):
        value = [f"{key}={item}" for key, item in value.items()]
    print(f"  {step}: {' '.join(value).replace('{kit}', kit)}")
PY
}

if [ "$(cat "$kit/recipe" 2>/dev/null)" = "$recipe" ]; then
  echo "The rehearsal kit in $kit was made from these sources; keeping it"
  print_kit
  report_result rehearsal_kit "$kit"
  exit 0
fi

tmp=$(mktemp -d "$work_dir/.rehearsal-kit.XXXXXX")
# shellcheck disable=SC2016  # expanded when the hook runs
on_exit 'rm -rf "$tmp"'
echo "Making the rehearsal kit in $kit from $source_dir"
started=$SECONDS
# Quieter: TensorFlow's start-up lines and Google's Python-version warnings say nothing here.
PYTHONPATH=$outer_pythonpath TF_CPP_MIN_LOG_LEVEL=2 PYTHONWARNINGS=ignore::FutureWarning \
  python3 "$source_dir/make_toy_inputs.py" "$tmp/kit"
mkdir "$tmp/kit/site"
cp "$source_dir/sitecustomize.py" "$tmp/kit/site/"
cp "$source_dir/toy_args.json" "$tmp/kit/"
printf '%s\n' "$recipe" >"$tmp/kit/recipe"
if [ -e "$kit" ]; then
  echo "Replacing the kit made from other sources"
  mv -T "$kit" "$tmp/old"
fi
# -T: never into a kit another run put in place meanwhile (that kit is then as good as ours).
if ! mv -T "$tmp/kit" "$kit" && [ "$(cat "$kit/recipe" 2>/dev/null)" != "$recipe" ]; then
  echo "could not put the kit in place at $kit" >&2
  exit 1
fi
echo "Made the rehearsal kit in $((SECONDS - started)) s"
print_kit
report_result rehearsal_kit "$kit"
