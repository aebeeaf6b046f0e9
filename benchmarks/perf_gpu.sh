#!/bin/bash
# The GPU tests, the training-step profile and the performance benchmarks on one CUDA GPU, by step name (the
# published figures in benchmarks/results come from one H200). Needs k3's GPU extra (pip install -e '.[gpu]',
# fla-core); the kernels step's fla layer also needs flash-linear-attention.
#
# Usage (from the repository root):  [VAR=value ...] bash benchmarks/perf_gpu.sh [STEP ...]   (default: tests)
#   PERF_OUT       summary.txt (each step's exit status and time) and logs/STEP.log (default runs/perf-gpu)
#   K3_BENCH_OUT   where the benchmarks write their results (default PERF_OUT/results; benchmarks/results updates
#                  the committed ones)
#   STEP_TIMEOUT   seconds a step may run before it is stopped (default 0: no limit)
#   TESTS_K        the pytest -k expression of tests_k (default: the tests of the decode kernels and graphs)
#   TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR   keep these caches between runs: fla autotunes every new kernel
#                  variant (about a minute each) and the compiled steps compile again on a cold cache
# Exits non-zero when a step failed or an unknown step was named. Steps run in the order below:
#   tests             the GPU tests (tests/gpu, -m gpu); tests_k: those matching $TESTS_K
#   profile, profile_stacks    the training step of small-1b at 8 x 2048, op table / with stacks
#   train             k3 bench model: the training step, transformers' peer and the step's floor (k3/bench/floor.py)
#   attn_res, attn_res_compiled, train_ac   the AttnRes and activation-checkpointing cases of k3 bench model
#   decode            k3 bench decode --quick (with the compiled-step cases); decode_targets: the target cases only;
#                     decode_nopeer: the quick decode bench without the transformers peer
#   profile_decode    the compiled decode step with every decode kernel on (the default) and off
#   ab_kernels_a, ab_kernels_b   each of the router top-k, input-maps, MoE routing and fused up-projection kernels
#                     off alone against the default, in one process
#   profile_attn_res  the decode step of small-1b with AttnRes none / snapshot
#   kernels           k3 bench kernels (full: MoE and KDA rows at 4K / 16K / 64K)
#   moe_decode        grouped_mm against the Triton small-groups kernel; decode_grouped_mm: decode with grouped_mm
#   tune_mla, multi_linear, small_groups, profile_kernels   the kernels' launch configurations and profiles
#   train_fp8         the training step with FP8 experts against bf16
#   train_accum       262,144 tokens an optimizer step, bf16 and FP8 experts
#   precision         bf16 against FP8 experts over 3 seeds of 2000 steps, under MPS (benchmarks/mps.sh)
#   attn_res_depth    AttnRes at K3's depth: none / snapshot / block_sum / full
#   serve_load        k3 serve under load (random small-1b)
set -u
OUTD=${PERF_OUT:-runs/perf-gpu}
LOGS=$OUTD/logs
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True K3_BENCH_OUT=${K3_BENCH_OUT:-$OUTD/results}
STEP_TIMEOUT=${STEP_TIMEOUT:-0}
case $STEP_TIMEOUT in '' | *[!0-9]*)
  echo "perf_gpu.sh: STEP_TIMEOUT=$STEP_TIMEOUT must be a whole number of seconds" >&2
  exit 2
  ;;
esac
requested=${*:-tests}
known=""
failed=0
step() {  # name, command...: with MODE=list only records the name
  local name=$1
  shift
  if [ "$MODE" = list ]; then
    known="$known $name"
    return
  fi
  case " $requested " in *" $name "*) ;; *) return ;; esac
  local t0=$SECONDS rc
  if [ "$STEP_TIMEOUT" -gt 0 ]; then
    timeout -k 5 "$STEP_TIMEOUT" "$@" > "$LOGS/$name.log" 2>&1
  else
    "$@" > "$LOGS/$name.log" 2>&1
  fi
  rc=$?
  [ $rc = 0 ] || failed=1
  echo "$name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUTD/summary.txt"
}
T="python -m pytest -q -m gpu tests/gpu -p no:cacheprovider --durations=8 --tb=short --show-capture=no"
TESTS_K=${TESTS_K:-mla or one_graph or cuda_graph_decode or router or multi_linear or moe_route or fused_up_glu or conv_step or kda_decode_core}
OFF=router_topk=torch,multi_linear=torch,moe_route=torch,moe_up_glu=torch,conv_step=torch,kda_decode_core=torch  # the decode kernels off
steps() {
  step tests $T
  step tests_k $T -k "$TESTS_K"
  step profile python benchmarks/profile_train_step.py --preset small-1b --batch-size 8 --seq-len 2048
  step profile_stacks python benchmarks/profile_train_step.py --preset small-1b --batch-size 8 --seq-len 2048 \
    --steps 2 --stacks
  step train python -m k3 bench model --cases train,peer,floor
  step attn_res python -m k3 bench model --cases attn_res
  step attn_res_compiled python -m k3 bench model --cases attn_res_compiled
  step train_ac python -m k3 bench model --cases train_ac
  step decode python -m k3 bench decode --quick
  step decode_targets python -m k3 bench decode --cases targets
  step decode_nopeer python -c "from k3.bench import decode; decode.run('$K3_BENCH_OUT/nopeer', quick=True, peer_budget_s=0)"
  step profile_decode python benchmarks/profile_decode.py --compiled --top 400 --kernels $OFF
  step ab_kernels_a python benchmarks/profile_decode.py --compiled --cases 64x32768,1x4096 --top 60 \
    --kernels router_topk=torch --kernels multi_linear=torch
  step ab_kernels_b python benchmarks/profile_decode.py --compiled --cases 64x32768,1x4096 --top 60 \
    --kernels moe_route=torch --kernels moe_up_glu=torch --kernels $OFF
  step profile_attn_res bash -c "for m in none snapshot; do python benchmarks/profile_decode.py --preset small-1b \
    --attn-res \$m --cases 16x4096 --compiled || exit 1; done"
  step kernels python -m k3 bench kernels
  step moe_decode python benchmarks/moe_decode_mm.py
  step decode_grouped_mm env K3_KERNELS=moe_small_groups=grouped_mm python -m k3 bench decode --quick \
    --out "$K3_BENCH_OUT/grouped_mm"
  step tune_mla python benchmarks/tune_mla_decode.py
  step multi_linear python benchmarks/multi_linear_configs.py --batches 64
  step small_groups python benchmarks/small_groups_configs.py
  step profile_kernels python benchmarks/profile_kernels.py
  step train_fp8 python -m k3 bench model --cases train,train_fp8
  step train_accum python -m k3 bench model --cases train_accum,train_accum_fp8
  step precision bash -c "source benchmarks/mps.sh; mps_start $OUTD/mps.txt; trap mps_stop EXIT; \
    python benchmarks/precision_convergence.py --arms bf16,fp8 --seeds 0,1,2 --steps 2000 --jobs 6"
  step attn_res_depth python benchmarks/attn_res_depth.py
  step serve_load python benchmarks/serve_load.py --preset small-1b --device cuda --concurrency 1,8,32,64 \
    --max-batch 64
}
MODE=list steps
for name in $requested; do
  case " $known " in *" $name "*) ;; *)
    echo "perf_gpu.sh: unknown step '$name' (steps:$known)" >&2
    exit 2
    ;;
  esac
done
mkdir -p "$LOGS" "$K3_BENCH_OUT"
nvidia-smi -L > "$OUTD/summary.txt" 2>&1
MODE=run steps
exit $failed
