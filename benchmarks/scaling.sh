#!/usr/bin/env bash
# Speed-up against workers for threads and processes on every workload, for a machine with many
# cores. Usage: bash benchmarks/scaling.sh [OUTPUT_DIR]   (needs gradmap[plot] installed)
set -euo pipefail
out="${1:-.}"
mkdir -p "$out"
python="${PYTHON:-python3}"
{
  echo "# $(date -u +%FT%TZ) $(uname -srm), $(nproc) cores"
  uptime
  "$python" -m gradmap bench --reps 3 --variants loop1,loop,tmap,tsum,tmap-proc,tsum-proc \
    --json "$out/scaling.json" --plot "$out/scaling.png"
  uptime
} 2>&1 | tee "$out/scaling.txt"
