#!/usr/bin/env bash
# One-time set-up (safe to run again): installs Poetry in .tools/ and the locked environment in .venv/.
set -euo pipefail
cd "$(dirname "$0")"

# EnvPool 1.2.x, rlax and distrax need Python >= 3.11; an older Python would resolve an EnvPool that
# does not import with current JAX, so refuse it here instead.
python=""
for candidate in python3.12 python3.11 python3; do
  if command -v "$candidate" >/dev/null &&
     "$candidate" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] <= (3, 12)))'; then
    python=$(command -v "$candidate"); break
  fi
done
[ -n "$python" ] || { echo "setup.sh: Cleanba needs Python 3.11 or 3.12 on PATH" >&2; exit 2; }

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

.tools/bin/poetry env use --quiet "$python"
.tools/bin/poetry install --no-interaction --quiet
echo "setup.sh: environment ready in .venv/ (python: $(.venv/bin/python --version))"
