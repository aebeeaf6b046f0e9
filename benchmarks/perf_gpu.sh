#!/bin/bash
# Runs the GPU tests, the training-step profile and the performance benchmarks on one GPU (an H200 for the
# published figures), each step under its own time limit so one slow step cannot take the others' time.
# Outputs go to the folder named by $OUT (default /tmp/out): summary.txt (each step's exit status and time),
# logs.tgz (each step's log and the result files it wrote), and Triton's cache as autotune.tgz (unpack it into
# .triton so later runs skip fla's autotuning): the whole cache with TorchInductor's (inductor.tgz, compiled kernels)
# when both fit in 40 MB, else the autotune results alone.
# Usage (from the repository root, with fla-core 0.6.0 and, for the kernels step's fla layer, flash-linear-attention
# 0.6.0 available as wheels in .whl/ and an optional Triton cache in .triton/):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=$PWD/.triton TORCHINDUCTOR_CACHE_DIR=$PWD/.inductor \
#     bash benchmarks/perf_gpu.sh [steps...]
# steps (default: tests, up to 8.7 minutes: 37 GPU tests, mostly compilation, plus fla's autotuning of any new
# kernel variant, about a minute per kernel; tests_compiled and tests_rest
# split it in two runs for a cold cache; tests_k: those matching $TESTS_K); train, decode_nopeer (the quick decode bench without the
# transformers peer), decode, decode_targets, profile, profile_stacks, attn_res, attn_res_compiled, train_ac,
# profile_decode, ab_kernels_a / ab_kernels_b (each of the router top-k, input-maps, MoE routing and fused up-projection
# kernels off alone), profile_attn_res,
# kernels (full), moe_decode, decode_grouped_mm, tune_mla, multi_linear, small_groups and profile_kernels on request,
# train_fp8 (the step with FP8 experts against bf16), train_accum (262,144 tokens an optimizer step, bf16 and FP8
# experts), precision (bf16 vs FP8 experts over 3 seeds, 2000 steps),
# attn_res_depth (AttnRes at K3's depth), serve_load (k3 serve under load, random small-1b),
# each under its own limit below (every step fits in 10 minutes)
set -u
OUTD=${OUT:-/tmp/out}
LOGS=$OUTD/logs
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True K3_BENCH_OUT=$LOGS
steps=${*:-tests}
step() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  case " $steps " in *" $name "*) ;; *) return ;; esac
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - t0)) s" | tee -a "$OUTD/summary.txt"
}
nvidia-smi -L > "$OUTD/summary.txt" 2>&1
T="python -m pytest -q -m gpu tests/gpu -p no:cacheprovider --durations=8 --tb=short --show-capture=no"
TESTS_K=${TESTS_K:-mla or one_graph or cuda_graph_decode or router or multi_linear or moe_route or fused_up_glu or conv_step or kda_decode_core}  # tests_k: the GPU tests of a change
OFF=router_topk=torch,multi_linear=torch,moe_route=torch,moe_up_glu=torch,conv_step=torch,kda_decode_core=torch  # the decode kernels off
COMPILED="compiled or cuda_graph or engine or activation_checkpointing or one_graph"  # ~5 of the ~9 minutes
step tests 520 $T
step tests_compiled 400 $T -k "$COMPILED"
step tests_rest 300 $T -k "not ($COMPILED)"
step tests_k 400 $T -k "$TESTS_K"
step profile 110 python benchmarks/profile_train_step.py --preset small-1b --batch-size 8 --seq-len 2048
step profile_stacks 170 python benchmarks/profile_train_step.py --preset small-1b --batch-size 8 --seq-len 2048 \
  --steps 2 --stacks
step train 420 python -m k3 bench model --cases train,peer,floor  # with the step's floor (k3/bench/floor.py)
step attn_res 240 python -m k3 bench model --cases attn_res
step attn_res_compiled 240 python -m k3 bench model --cases attn_res_compiled
step train_ac 150 python -m k3 bench model --cases train_ac
step decode 260 python -m k3 bench decode --quick  # with the compiled-step cases
step decode_targets 400 python -m k3 bench decode --cases targets  # only the target cases' compiled rows (~5 min)
step decode_nopeer 200 python -c "from k3.bench import decode; decode.run('$LOGS/nopeer', quick=True, peer_budget_s=0)"
step profile_decode 300 python benchmarks/profile_decode.py --compiled --top 400 \
  --kernels $OFF  # every kernel; the decode kernels on (the default) and off
step ab_kernels_a 540 python benchmarks/profile_decode.py --compiled --cases 64x32768,1x4096 --top 60 \
  --kernels router_topk=torch --kernels multi_linear=torch  # each decode kernel off alone vs the default, one process
step ab_kernels_b 540 python benchmarks/profile_decode.py --compiled --cases 64x32768,1x4096 --top 60 \
  --kernels moe_route=torch --kernels moe_up_glu=torch --kernels $OFF
step profile_attn_res 160 bash -c "for m in none snapshot; do python benchmarks/profile_decode.py --preset small-1b \
  --attn-res \$m --cases 16x4096 --compiled || exit 1; done"
step kernels 420 python -m k3 bench kernels  # full: MoE and KDA rows at 4K / 16K / 64K (fla autotunes new shapes)
step moe_decode 150 python benchmarks/moe_decode_mm.py  # grouped_mm vs the Triton small-groups kernel
step decode_grouped_mm 260 env K3_KERNELS=moe_small_groups=grouped_mm python -m k3 bench decode --quick --out "$LOGS/grouped_mm"
step tune_mla 90 python benchmarks/tune_mla_decode.py
step multi_linear 200 python benchmarks/multi_linear_configs.py --batches 64  # the input maps' launch configurations
step small_groups 300 python benchmarks/small_groups_configs.py  # the expert matmuls' configurations vs the autotuner
step profile_kernels 120 python benchmarks/profile_kernels.py
step train_fp8 420 python -m k3 bench model --cases train,train_fp8
step train_accum 570 python -m k3 bench model --cases train_accum,train_accum_fp8  # MFU at a realistic batch
step precision 570 bash -c "source benchmarks/mps.sh; mps_start $OUTD/mps.txt; trap mps_stop EXIT; \
  python benchmarks/precision_convergence.py --arms bf16,fp8 --seeds 0,1,2 --steps 2000 --jobs 6"  # under MPS
step attn_res_depth 560 python benchmarks/attn_res_depth.py  # none / snapshot / block_sum / full, compiles side by side
step serve_load 400 python benchmarks/serve_load.py --preset small-1b --device cuda --concurrency 1,8,32,64 \
  --max-batch 64
(cd "$LOGS" && tar czf "$OUTD/logs.tgz" .) && rm -rf "$LOGS"
if [ -n "${TRITON_CACHE_DIR:-}" ]; then
  if [ -n "${TORCHINDUCTOR_CACHE_DIR:-}" ] && [ "$(du -smc "$TRITON_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR" | tail -1 | cut -f1)" -le 40 ]; then
    tar czf "$OUTD/autotune.tgz" -C "$TRITON_CACHE_DIR" . && tar czf "$OUTD/inductor.tgz" -C "$TORCHINDUCTOR_CACHE_DIR" .
  else
    (cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" -print0 | tar czf "$OUTD/autotune.tgz" --null -T -)
  fi
fi
cat "$OUTD/summary.txt"
