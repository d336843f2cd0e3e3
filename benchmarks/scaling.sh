#!/usr/bin/env bash
# Speed-up against workers for threads and processes on every workload, for a machine with many
# cores. Usage: bash benchmarks/scaling.sh [OUTPUT_DIR]   (needs gradmap[plot] installed)
# SWEEP (default 1,2,4,8,... up to the cores) sets the worker counts of the sweep; REPS (default 3)
# the timed repetitions; WORKLOADS (default all) the workloads.
set -euo pipefail
out="${1:-.}"
mkdir -p "$out"
python="${PYTHON:-python3}"
cores=$("$python" -c "from gradmap._executors import available_cores; print(available_cores())")
if [ -z "${SWEEP:-}" ]; then
  SWEEP=1
  w=2
  while [ "$w" -lt "$cores" ]; do SWEEP="$SWEEP,$w"; w=$((w * 2)); done
  SWEEP="$SWEEP,$cores"
fi
workloads=()
if [ -n "${WORKLOADS:-}" ]; then workloads=(--workloads "$WORKLOADS"); fi
{
  echo "# $(date -u +%FT%TZ) $(uname -srm), $(nproc) cores, sweep $SWEEP"
  uptime
  "$python" -m gradmap bench --reps "${REPS:-3}" "${workloads[@]}" \
    --variants loop1,loop,tmap,tsum,tmap-proc,tsum-proc,raw,serial \
    --sweep "$SWEEP" --json "$out/scaling.json" --plot "$out/scaling.png"
  uptime
} 2>&1 | tee "$out/scaling.txt"
