#!/bin/bash
# The GPU part of the audit (docs/audit/README.md) on one CUDA GPU: `k3 ablate --grid G` for each G in $GRID, one
# after the other, and `k3 scaling --sweep $SWEEP` beside them, each with --jobs. Both skip finished runs (their
# summary.json) and resume checkpointed ones, so a run stopped by DEADLINE, or by anything else, continues when
# the script is started again on the same AUDIT_DIR.
#
# Usage (from the repository root):  [VAR=value ...] bash benchmarks/audit_gpu.sh
#   AUDIT_DIR    the runs (AUDIT_DIR/ablate-G, AUDIT_DIR/scaling-S) and their logs ablate.log, scaling.log, plus
#                gpu.txt (the GPU) (default runs/audit-gpu)
#   GRID         the grids, run in turn (default "default"; also factorial, balance896; none: no grid)
#   SWEEP        the sweep (default gpu; also gpu5; none: no sweep)
#   SWEEP_DATA   train the sweep on this data (a path or a built-in corpus) instead of its own; k3 scaling refuses
#                a sweep that would repeat its data
#   ABLATE_JOBS, SCALING_JOBS   their --jobs (default 5 and 4)
#   WARM         one more flag for both, e.g. --no-warm-first
#   MPS=1        run the jobs under CUDA's Multi-Process Service (benchmarks/mps.sh; started here, stopped at the end)
#   DEADLINE     stop both after this many seconds (default 0: run to the end)
#   ARCHIVE      also pack the runs' summaries, metrics, reports and expert loads (not their checkpoints) into this
#                .txz file
# Each job runs under setsid, and it and its workers are stopped by their session id, so no other process is
# touched. Exits non-zero when a job failed or was stopped.
set -u
DIR=${AUDIT_DIR:-runs/audit-gpu}
GRID=${GRID:-default}
SWEEP=${SWEEP:-gpu}
DEADLINE=${DEADLINE:-0}
case $DEADLINE in '' | *[!0-9]*)
  echo "audit_gpu.sh: DEADLINE=$DEADLINE must be a whole number of seconds" >&2
  exit 2
  ;;
esac
mkdir -p "$DIR"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$DIR/gpu.txt" 2>&1
source "$(dirname "$0")/mps.sh"
[ "${MPS:-0}" = 1 ] && mps_start "$DIR/mps.txt"
sids=()
if [ "$GRID" != none ]; then
  setsid bash -c 'rc=0; for g in $1; do python -m k3 ablate --grid "$g" --out "$2/ablate-$g" --jobs "$3" $4 || rc=1
    done; exit $rc' _ "$GRID" "$DIR" "${ABLATE_JOBS:-5}" "${WARM:-}" > "$DIR/ablate.log" 2>&1 &
  sids+=($!)
fi
if [ "$SWEEP" != none ]; then
  setsid python -m k3 scaling --sweep "$SWEEP" --irreducible --out "$DIR/scaling-$SWEEP" --jobs "${SCALING_JOBS:-4}" \
    ${WARM:-} ${SWEEP_DATA:+--data "$SWEEP_DATA"} > "$DIR/scaling.log" 2>&1 &
  sids+=($!)
fi
stop() {  # signal: to every process whose session id is one of the jobs'
  for s in ${sids[@]+"${sids[@]}"}; do pkill "-$1" -s "$s" 2>/dev/null; done
}
watcher=""
if [ "$DEADLINE" -gt 0 ] && [ ${#sids[@]} -gt 0 ]; then
  (
    trap 'kill $nap 2>/dev/null; exit' TERM
    sleep "$DEADLINE" & nap=$!
    wait $nap
    stop TERM
    sleep 5
    stop KILL
  ) &
  watcher=$!
fi
rc=0
for s in ${sids[@]+"${sids[@]}"}; do wait "$s" || rc=1; done
[ -n "$watcher" ] && kill "$watcher" 2>/dev/null
stop KILL  # workers a job left behind
mps_stop
if [ -n "${ARCHIVE:-}" ]; then
  archive=$(realpath -m "$ARCHIVE")
  (cd "$DIR" && find . \( -name summary.json -o -name metrics.jsonl -o -name train_config.json -o -path "*/mqar/*.json" \
    -o \( -name tokenizer.json -not -path "*/runs/*" \) -o -name "*.md" -o -name "results.json" -o -name "scaling.json" \
    -o -name "*.png" -o -name grid.json -o -name sweep.json -o -name expert_loads.json \) -print0 |
    tar cJf "$archive" --null -T -) || rc=1
fi
exit $rc
