#!/usr/bin/env bash
# Adds EnvPool's Procgen to the GPU machine's bundle, which ../shared/gpu/bundle.sh builds without it. For CPython
# 3.12 (the GPU image's) EnvPool's wheel carries the Qt 6 Core and Gui libraries Procgen's engine loads (in
# envpool.libs/, needing only glibc), which the bundle leaves out; for 3.11 (setup.sh's .venv) it needs Qt 5 from
# PyQt5-Qt5 instead. Writes .gpu/procgen.tar.gz (~33 MiB: the engine, the two Qt libraries, Procgen's sprites from
# envpool-assets, the bundle's engine list with Procgen added, and imageio, which cleanba/evaluate.py imports to play
# unseen levels) and a line of .gpu/env.sh that unpacks it over the bundle: .gpu/ is then ~51 MiB, under the 64 MiB
# that travel to the GPU machine with the working tree.
#
#   bash ../shared/gpu/bundle.sh && bash tests/benchmarks/gpu_procgen_bundle.sh
#   bash ../shared/gpu/simulate.sh python cleanba/cleanba_ppo.py --env-id StarpilotEasy-v0 ...   # try it here
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
[ -f .gpu/env.sh ] || { echo "gpu_procgen_bundle.sh: build the bundle first (bash ../shared/gpu/bundle.sh)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
locked() { awk -v n="$1" '$0=="name = \""n"\""{getline; gsub(/"/,"",$3); print $3}' poetry.lock | sort -V | tail -1; }
platforms=""
for p in manylinux_2_28_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms="$platforms --platform $p"
done
for spec in "envpool==$(locked envpool)" "envpool-assets==$(locked envpool-assets)" "imageio==$(locked imageio)"; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $platforms -d "$work/wheels" "$spec" 2>&1 | grep -v 'is ignored' || true
done
unzip -q "$work"/wheels/envpool-*.whl 'envpool/procgen/*' 'envpool.libs/libQt6*' -d "$work/site"
unzip -q "$work"/wheels/envpool_assets-*.whl 'envpool_assets/procgen/*' -d "$work/site"  # its sprites
unzip -q "$work"/wheels/imageio-*.whl 'imageio/*' 'imageio-*.dist-info/*' -d "$work/site"  # pure Python; the GPU image has numpy and pillow
# The bundle's engine list (its envpool/entry.py) with Procgen added.
tar xzf .gpu/site.tar.gz -C "$work" site/envpool/entry.py
sed -i 's|mujoco.gym"|mujoco.gym procgen"|' "$work/site/envpool/entry.py"
grep -q 'procgen"' "$work/site/envpool/entry.py" || { echo "gpu_procgen_bundle.sh: the bundle's entry.py changed" >&2; exit 1; }
tar czf .gpu/procgen.tar.gz -C "$work" site
line='[ -f /tmp/cleanba-gpu-site/site/imageio/__init__.py ] || tar xzf "$here/procgen.tar.gz" -C /tmp/cleanba-gpu-site'
grep -qxF "$line" .gpu/env.sh || echo "$line" >> .gpu/env.sh
echo "gpu_procgen_bundle.sh: .gpu/procgen.tar.gz is $(du -m .gpu/procgen.tar.gz | cut -f1) MiB; .gpu/ $(du -sm .gpu | cut -f1) MiB in all"
