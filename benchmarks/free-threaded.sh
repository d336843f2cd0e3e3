#!/usr/bin/env bash
# The test suite and the bench on a free-threaded CPython (3.13t and later), GIL off.
# Usage: bash benchmarks/free-threaded.sh PYTHON [pytest arguments]
#   PYTHON: the python of a free-threaded venv with torch (../shared/tools/free-threaded-python.sh
#   makes one). Installs gradmap there (editable) with its test clients, builds the native walk,
#   runs the suite with PYTHON_GIL=0 (Ray and JAX skip where their wheels do not exist), then
#   `gradmap bench` on threads. BENCH=0 skips the bench; BENCH_ARGS replaces its arguments.
set -euo pipefail
py=${1:?usage: benchmarks/free-threaded.sh PYTHON [pytest arguments]}
shift
cd "$(dirname "$0")/.."
export PYTHON_GIL=0  # keeps the GIL off when a module without free-threading support is imported
"$py" -c "import sys; assert not sys._is_gil_enabled(), 'this python runs with the GIL'"
# The machine-wide pip constraints name releases for the standard build; they do not apply here.
PIP_CONFIG_FILE=/dev/null "$py" -m pip install -q --no-deps -e .
PIP_CONFIG_FILE=/dev/null "$py" -m pip install -q optree cloudpickle ninja pytest "hypothesis<6.130" \
  tqdm torchdiffeq torch-geometric linear-operator
"$py" -m gradmap build
{
  echo "# $(date -u +%FT%TZ) $("$py" -c 'import sys, torch; print(sys.version.split()[0], "GIL", sys._is_gil_enabled(), "torch", torch.__version__)'), $(nproc) cores"
  uptime
} >&2
"$py" -m pytest -q -p no:cacheprovider "$@"
if [[ ${BENCH:-1} != 0 ]]; then
  # shellcheck disable=SC2086
  "$py" -m gradmap bench ${BENCH_ARGS:---reps 3 --variants loop1,loop,tmap,tsum}
  uptime
fi
