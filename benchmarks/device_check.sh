#!/usr/bin/env bash
# The accelerator check for issues 15 and 17, at most 10 minutes on one H100/H200:
#   1. the masked LM head against the whole head (bfloat16 and float32 hidden states), each
#      TMAX_JAX_F32_DOT algorithm's error and speed on a head-shaped float32 matmul, then the Pallas
#      delta-rule kernels against the pure-JAX path (values, VJP; last: they hung on GPUs so far);
#   2. attention: the Triton flash-attention kernel (attention_kernels: pallas, JAX's Pallas GPU
#      kernel) against the JAX flash form at the 2B shape (values, VJP), then fwd+bwd ms, TFLOP/s and
#      compiled temporaries of both at 32K and 64K tokens (attention is the 32K step's super-linear part);
#   3. 2B train steps at 8K, 32K and 64K tokens with TMAX_JAX_F32_DOT=bf16x6 (the float32 head on
#      tensor cores) and remat "layers" (no period-level recompute), and at 8K with the default
#      (exact float32 on CUDA cores, remat "full", as the earlier runs) as the baseline of the same
#      machine: tokens/s, MFU, peak device memory;
#   4. the rollout engine's 0.8B bfloat16 decode at 64 and 256 slots: ms per step, tokens/s; then at
#      64 slots a speculative engine (k=3) with a draft that is always right: a verify step's cost
#      against a plain step, tokens per step, the acceptance rate where it breaks even;
#   5. a profile of one 2B step at 8K tokens (bf16x6): its busiest GPU kernels (trace copied to $OUT);
#   6. the delta rule's ms, tokens/s, TFLOP/s and compiled temporaries, JAX path vs kernels (T=32K).
# Each part runs in its own process under its own limit (a crash or hang loses only that part); the
# limits add up to under 10 minutes with their kill grace. Figures of the last runs: tpu/README.md.
#   bash benchmarks/device_check.sh            # on the accelerator host
#   bash benchmarks/device_check.sh --smoke    # tiny sizes on a CPU, to prove the script runs
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/tmax-jax-device-check-cache}"
PY="${PYTHON:-python3}"
SMOKE=()
SCALE=1
if [ "${1:-}" = "--smoke" ]; then SMOKE=(--smoke); SCALE=3; fi  # 2 shared CPU cores compile slowly
START=$SECONDS
BUDGET=$((560 * SCALE))

part() {
  local limit=$(( $1 * SCALE )); shift
  local left=$(( BUDGET - (SECONDS - START) ))
  if [ "$left" -lt 20 ]; then echo "=== skipped: $* (budget spent)"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $* (limit ${limit}s, $((SECONDS - START))s into the check)"
  timeout -k 5 "$limit" "$PY" benchmarks/device_check.py "${SMOKE[@]}" "$@"
  local rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then echo "=== $*: timed out after ${limit}s"
  elif [ "$rc" -ne 0 ]; then echo "=== $*: exited with status $rc"; fi
}

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
part 70 --part check
part 70 --part attention  # GPU attention kernel vs the JAX form (the 32K step's super-linear part)
part 200 --part train --size 2b --tokens 8192,32768,65536 --f32-dot bf16x6 --remat layers  # the MFU aim: 2B at 32K
part 60 --part train --size 2b --tokens 8192 --f32-dot highest  # the baseline on the same machine
part 80 --part engine --size 0.8b  # issue 17: bf16 decode at 64 and 256 slots
part 50 --part engine --size 0.8b --slots 64 --speculative 3  # issue 17: a verify step's cost
part 50 --part profile --size 2b --tokens 8192 --f32-dot bf16x6  # where the step's time goes
part 60 --part kernel
echo "=== device check done in $((SECONDS - START))s"
