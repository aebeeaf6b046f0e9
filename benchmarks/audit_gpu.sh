#!/bin/bash
# The GPU part of the audit on one H200, resumable across runs:
#   k3 ablate --grid $GRID (default: default; factorial, balance896)  and  k3 scaling --sweep $SWEEP (default: gpu;
#   gpu5), side by side, each with --jobs,
# until DEADLINE seconds; then the finished runs' summaries + metrics (not the checkpoints) go to
# audit.tgz and Triton's autotune results to autotune.tgz, both in the folder named by $OUT (default /tmp/out). Unpack audit.tgz into runs/ and
# rerun to continue: finished runs are skipped from their summary.json.
# Usage: DEADLINE=540 [GRID=factorial SWEEP=gpu5 ABLATE_JOBS=5 SCALING_JOBS=4 WARM=--no-warm-first] \
#          bash benchmarks/audit_gpu.sh
set -u
DIR=${AUDIT_DIR:-runs/audit-gpu}
DEADLINE=${DEADLINE:-540}
OUTD=${OUT:-/tmp/out}
mkdir -p "$DIR" "$OUTD"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUTD/gpu.txt" 2>&1
GRID=${GRID:-default}
SWEEP=${SWEEP:-gpu}
timeout -k 5 "$DEADLINE" python -m k3 ablate --grid "$GRID" --out "$DIR/ablate-$GRID" --jobs "${ABLATE_JOBS:-5}" ${WARM:-} \
  > "$OUTD/ablate.log" 2>&1 &
timeout -k 5 "$DEADLINE" python -m k3 scaling --sweep "$SWEEP" --irreducible --out "$DIR/scaling-$SWEEP" \
  --jobs "${SCALING_JOBS:-4}" ${WARM:-} \
  > "$OUTD/scaling.log" 2>&1 &
( sleep 90; nvidia-smi > "$OUTD/nvidia-smi-90s.txt" 2>&1 ) &
wait
pkill -9 -f "multiprocessing.spawn" 2>/dev/null
sleep 1
cd "$DIR" && find . \( -name summary.json -o -name metrics.jsonl -o -name train_config.json -o -path "*/mqar/*.json" \
  -o -name tokenizer.json -o -name "*.md" -o -name "results.json" -o -name "scaling.json" -o -name "*.png" \
  -o -name grid.json -o -name sweep.json -o -name expert_loads.json \) -print0 | tar czf "$OUTD/audit.tgz" --null -T -
cd - > /dev/null
[ -n "${TRITON_CACHE_DIR:-}" ] && (cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" -print0 |
  tar czf "$OUTD/autotune.tgz" --null -T -)
ls -la "$OUTD"
