#!/usr/bin/env bash
# The one-GPU checks in one go, for a borrowed GPU machine with little time on it: the GPU
# tests, the packed-attention kernels, 1B-shape throughput against a transformers loop, the
# ranks-per-GPU check, the CUDA-visible model tests and checkpoint I/O. Each step has its own
# time limit and a failure does not stop the next one; every step's output is also written to
# $OUT (default /tmp/gpu-suite), one file per step, and a summary line per step at the end.
#
#   benchmarks/gpu_suite.sh [STEP ...]     # steps: gpu-tests attention rope throughput staging
#                                          #        fusions kernels torchtitan profile ranks
#                                          #        model-tests checkpoint
#
# The default (gpu-tests attention throughput ranks model-tests) took ~5.5 min on an H200
# (2026-11-26: gpu-tests 115 s, attention 49, throughput 97, ranks 16, model-tests 63): one
# device call. On 2026-11-27 one call ran "throughput staging fusions kernels torchtitan" with
# SIDES=hpc-mca,bf16 SAVE_STEPS=5 and three FUSIONS in 520 s (throughput 145 s with its three
# 18 GB saves; fusions ~65 s a setting, so give FUSIONS_LIMIT 80 s a setting; kernels 37 s;
# torchtitan 33 s; staging's three ways need ~90 s, over its old 70 s limit). rope
# (Megatron's per-document RoPE against hpc-mca's one pass), profile (the throughput
# comparison with two profiled steps per side and their operator tables) and checkpoint (the
# 2-rank CPU benchmark on the box's disk, 216 s there) have their own calls.
# On 2026-11-28 (15 minutes of device time in all) one call ran, with SIDES=hpc-mca
# SAVE_STEPS=5 PROFILE=1 TITAN_MICRO_BATCHES="2 4" and FUSIONS="[layer,cross_entropy]
# --micro-batch 4", "throughput torchtitan kernels fusions gpu-tests" past its 590 s: throughput
# ~150 s, torchtitan (two sizes, one profiled) ~120 s, kernels ~40 s, fusions ~90 s; the GPU
# tests, now 17 with the model families' bf16 runs (each a fresh `hpc-mca train` process), need
# ~7 minutes alone: give them a call of their own (GPU_TESTS_LIMIT=450), first.
#
# Runs from the repository root with the python3 that has torch+CUDA; megatron-core and
# submitit may come from PYTHONPATH (wheels installed with pip --target).
set -uo pipefail

out="${OUT:-/tmp/gpu-suite}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH="${PWD}${PYTHONPATH:+:${PYTHONPATH}}"
py="${PYTHON:-python3}"
# Training runs write their end-of-run checkpoint (~18 GB for the 1B shape) to memory when
# /dev/shm has room; checkpoint I/O measures the disk, so it always writes under /tmp.
shm_free="$(df -Pm /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')"
if [[ "${shm_free:-0}" -gt 40000 ]]; then work="$(mktemp -d /dev/shm/gpu-suite.XXXXXX)"; else work="$(mktemp -d)"; fi
disk="$(mktemp -d /tmp/gpu-suite-disk.XXXXXX)"
summary=()

step() {  # step NAME SECONDS FUNCTION: run it, keep its output, note its exit status
  local name="$1" limit="$2" function="$3" start rc
  start="$(date +%s)"
  echo "=== ${name} (limit ${limit} s)"
  timeout "${limit}" bash -c "${function}" 2>&1 | tee "${out}/${name}.txt"
  rc="${PIPESTATUS[0]}"
  summary+=("${name}: rc ${rc} in $(( $(date +%s) - start )) s")
}

gpu_tests() {
  "$py" -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py tests/test_packed_kernels.py \
    tests/test_cross_entropy.py
}

attention() {  # the long-tailed SFT mix of packing_efficiency.py (log-normal 6 +- 1, <= 4096)
  "$py" benchmarks/attention_packed.py --device cuda --dtype bfloat16 --tokens 65536 \
    --heads 32 --kv-heads 8 --head-dim 64 --log-mean 6 --log-std 1 --max-len 4096
}

throughput() {  # SIDES (default all three), SAVE_STEPS (a save every N steps: first-save
  # time) and PROFILE (non-empty: two more profiled steps a side, their operator tables)
  local extra=()
  [[ -z "${SAVE_STEPS:-}" ]] || extra=(--train-arg "training.save_steps=${SAVE_STEPS}"
                                       --train-arg training.save_total_limit=1)
  [[ -z "${PROFILE:-}" ]] || extra+=(--profile)
  "$py" benchmarks/gpu_throughput.py --dir "$work" --sides "${SIDES:-hpc-mca,bf16,fp32-master}" \
    "${extra[@]}"
}

staging() {  # a first save's host staging: cudaHostAlloc vs cudaHostRegister vs pageable
  "$py" benchmarks/pinned_staging.py
}

kernels() {  # liger-kernel against Megatron's and compiled fusions, piece by piece
  "$py" benchmarks/kernel_options.py
}

torchtitan() {  # the second peer: torchtitan on the same 1B shape (its wheels on PYTHONPATH),
  # at each of TITAN_MICRO_BATCHES (default 2); with PROFILE, the first one profiled too
  local size extra=()
  [[ -z "${PROFILE:-}" ]] || extra=(--profile)
  for size in ${TITAN_MICRO_BATCHES:-2}; do
    "$py" benchmarks/torchtitan_peer.py --micro-batch "${size}" "${extra[@]}"
    extra=()
  done
}

rope() {  # the same SFT mix, one query-shaped tensor of the 1B shape (32 heads x 64)
  "$py" benchmarks/rope_packed.py --device cuda --dtype bfloat16 --tokens 65536 --heads 32 \
    --head-dim 64 --log-mean 6 --log-std 1 --max-len 4096 --compiled
}

fusions() {  # hpc-mca train alone, one run per FUSIONS entry (";"-separated; default: no
  # fusion, Megatron's three, compiled layers alone and with the fused cross-entropy, then that
  # with micro-batch 4: the same 8 rows a step). Where the staging step found cudaHostRegister
  # working, these runs use it, so that their end-of-run (first) saves show its effect.
  local variant variants
  IFS=';' read -r -a variants <<< "${FUSIONS:-[];[swiglu,cross_entropy,rope];[layer];[layer,cross_entropy];[layer,cross_entropy] --micro-batch 4}"
  if grep -q '^cudaHostRegister x8 *[0-9]' "${out}/staging.txt" 2>/dev/null; then
    export PYTORCH_CUDA_ALLOC_CONF="pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
    echo "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF}"
  fi
  for variant in "${variants[@]}"; do
    echo "--- model.fusions=${variant}"
    # shellcheck disable=SC2086  # the last variant's extra option is meant to split
    "$py" benchmarks/gpu_throughput.py --dir "$work" --sides hpc-mca \
      --train-arg "model.fusions=${variant%% *}" ${variant#"${variant%% *}"} \
      | grep -E '^(hpc-mca|last progress|  checkpoint)'
  done
}

profile() {  # where each side's step time goes (torchtitan's too, where its wheels are there)
  "$py" benchmarks/gpu_throughput.py --dir "$work" --sides hpc-mca,bf16 --profile
  if "$py" -c "import torchtitan" 2>/dev/null; then
    "$py" benchmarks/torchtitan_peer.py --profile
  fi
}

ranks() {  # two ranks on one GPU: one line and exit 2, not an NCCL crash
  local rc=0
  CUDA_VISIBLE_DEVICES=0 "$py" -m hpc_mca.cli.forkrun --nproc-per-node 2 train \
    hpc_mca/assets/demo/sft_addition.yaml "training.output_dir=${work}/ranks" || rc=$?
  echo "exit status ${rc} (expected 2)"
  [[ "$rc" == 2 ]]
}

model_tests() {  # the CPU suite's model tests with CUDA visible: they must be device-agnostic
  "$py" -m pytest -m "gpu or not slow" -q -p no:cacheprovider tests/test_models.py
}

checkpoint() {  # 2 CPU ranks (two NCCL ranks cannot share one GPU); the disk is what is measured
  CUDA_VISIBLE_DEVICES='' "$py" benchmarks/checkpoint_io.py --dir "$disk"
}

export py work disk out
export -f gpu_tests attention rope throughput staging kernels torchtitan fusions profile ranks \
  model_tests checkpoint

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$py" -c 'import torch, transformers, megatron.core as m; print("torch", torch.__version__,
"transformers", transformers.__version__, "megatron-core", m.__version__)'

steps=("$@")
[[ ${#steps[@]} -gt 0 ]] || steps=(gpu-tests attention throughput ranks model-tests)
for name in "${steps[@]}"; do
  case "$name" in
    gpu-tests) step gpu-tests "${GPU_TESTS_LIMIT:-240}" gpu_tests ;;
    attention) step attention 60 attention ;;
    rope) step rope 90 rope ;;
    throughput) step throughput "${THROUGHPUT_LIMIT:-160}" throughput ;;
    fusions) step fusions "${FUSIONS_LIMIT:-420}" fusions ;;
    staging) step staging 100 staging ;;
    kernels) step kernels 60 kernels ;;
    torchtitan) step torchtitan "${TITAN_LIMIT:-100}" torchtitan ;;
    profile) step profile 260 profile ;;
    ranks) step ranks 40 ranks ;;
    model-tests) step model-tests 120 model_tests ;;
    checkpoint) step checkpoint 300 checkpoint ;;
    *) echo "unknown step ${name} (valid: gpu-tests attention rope throughput staging fusions" \
            "kernels torchtitan profile ranks model-tests checkpoint)" >&2
       exit 2 ;;
  esac
done
rm -rf "$work" "$disk"
printf '%s\n' "${summary[@]}" | tee "${out}/summary.txt"
