#!/bin/bash
# The GPU part of the audit on one H200, resumable:
#   k3 ablate --grid G for each G in $GRID, one after the other (default: default; also factorial, balance896), and
#   k3 scaling --sweep $SWEEP (default: gpu; also gpu5) beside them, each with --jobs
#   (GRID=none or SWEEP=none leaves one out),
# until DEADLINE seconds. Then the runs' summaries and metrics (not their checkpoints, nor the copies of the shared
# tokenizer) go to audit.txz and Triton's autotune results to autotune.tgz, both in the folder named by $OUT
# (default /tmp/out). Rerun on the same disk to continue (finished runs are skipped from their summary.json,
# checkpointed ones resume); on a fresh disk, unpack audit.txz into $AUDIT_DIR first to skip the finished runs.
# MPS=1 runs the jobs under CUDA's Multi-Process Service (benchmarks/mps.sh; started here, stopped at the end).
# Run one invocation at a time on a machine: at the end it kills every leftover multiprocessing worker there.
# SWEEP_DATA=SPEC trains the sweep on SPEC (a path or a built-in corpus) instead of its own data; k3 scaling
# refuses a sweep that would repeat its data.
# Usage: DEADLINE=540 [GRID="factorial balance896" SWEEP=gpu5 SWEEP_DATA=SPEC ABLATE_JOBS=5 SCALING_JOBS=4 MPS=1 \
#          WARM=--no-warm-first] \
#          bash benchmarks/audit_gpu.sh
set -u
DIR=${AUDIT_DIR:-runs/audit-gpu}
DEADLINE=${DEADLINE:-540}
OUTD=${OUT:-/tmp/out}
END=$((SECONDS + DEADLINE))
mkdir -p "$DIR" "$OUTD"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUTD/gpu.txt" 2>&1
GRID=${GRID:-default}
SWEEP=${SWEEP:-gpu}
source "$(dirname "$0")/mps.sh"
[ "${MPS:-0}" = 1 ] && mps_start "$OUTD/mps.txt"
if [ "$GRID" != none ]; then
  (for g in $GRID; do
    left=$((END - SECONDS))
    [ "$left" -gt 30 ] || break
    timeout -k 5 "$left" python -m k3 ablate --grid "$g" --out "$DIR/ablate-$g" --jobs "${ABLATE_JOBS:-5}" ${WARM:-}
  done) > "$OUTD/ablate.log" 2>&1 &
fi
if [ "$SWEEP" != none ]; then
  timeout -k 5 "$DEADLINE" python -m k3 scaling --sweep "$SWEEP" --irreducible --out "$DIR/scaling-$SWEEP" \
    --jobs "${SCALING_JOBS:-4}" ${WARM:-} ${SWEEP_DATA:+--data "$SWEEP_DATA"} > "$OUTD/scaling.log" 2>&1 &
fi
( sleep 90; nvidia-smi > "$OUTD/nvidia-smi-90s.txt" 2>&1 ) &
wait
pkill -9 -f "multiprocessing.spawn" 2>/dev/null
sleep 1
mps_stop
df -h "$DIR" > "$OUTD/disk.txt" 2>&1
cd "$DIR" && find . \( -name summary.json -o -name metrics.jsonl -o -name train_config.json -o -path "*/mqar/*.json" \
  -o \( -name tokenizer.json -not -path "*/runs/*" \) -o -name "*.md" -o -name "results.json" -o -name "scaling.json" \
  -o -name "*.png" -o -name grid.json -o -name sweep.json -o -name expert_loads.json \) -print0 |
  tar cJf "$OUTD/audit.txz" --null -T -
cd - > /dev/null
[ -n "${TRITON_CACHE_DIR:-}" ] && (cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" -print0 |
  tar czf "$OUTD/autotune.tgz" --null -T -)
ls -la "$OUTD"
