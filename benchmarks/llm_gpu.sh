#!/usr/bin/env bash
# LLM fine-tuning on one GPU, plain against graphed, as one command (issue 49):
#
#   bash benchmarks/llm_gpu.sh            # on the GPU machine (the device tool: carry .whl)
#   SMOKE=1 bash benchmarks/llm_gpu.sh    # on a CPU: a tiny run through the CPU graph engine
#   MODELS=small bash benchmarks/llm_gpu.sh   # the small model only
#   DEVICE=cpu MODELS=small bash benchmarks/llm_gpu.sh   # a CPU trial of the small model
#
# TRL's SFTTrainer, SFT packed and a PEFT LoRA Trainer (benchmarks/llm.py), on a small Llama
# (512 x 4) and a ~300M one (1024 x 20), bf16, 200 steps each: steps/s, tokens/s, the replayed
# fraction, the logged losses. JSON per model in $OUT (default benchmarks/results):
# llm-small-<gpu>.json, llm-300m-<gpu>.json. Without CUDA (and without SMOKE=1 or DEVICE=cpu)
# it refuses. DEVICE=cpu runs each model on the CPU through the CPU graph engine, fp32, 20 steps
# of 2 x 64 tokens (STEPS=, BATCH=, SEQ=, WORKLOADS= change them): llm-<model>-cpu.json, marked
# "figures": "cpu-trial" (the path and the fields, never GPU figures).
# Wheels in .whl/ are installed for the GPU run only, once the device is found (the GPU image
# lacks trl, peft, datasets: gpu_wheels.sh builds them for its Python); the CPU trials and the
# refusals use the environment as it is.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
python="${PYTHON:-python3}"

if [ "${SMOKE:-0}" = 1 ]; then
  exec "$python" benchmarks/llm.py --smoke --out "$out/llm-cpu-smoke.json"
fi
shape=()
[ -n "${STEPS:-}" ] && shape+=(--steps "$STEPS")
[ -n "${BATCH:-}" ] && shape+=(--batch "$BATCH")
[ -n "${SEQ:-}" ] && shape+=(--seq "$SEQ")
[ -n "${WORKLOADS:-}" ] && shape+=(--workloads "$WORKLOADS")  # e.g. WORKLOADS=sft,lora
case "${DEVICE:-cuda}" in
  cuda) ;;
  cpu)
    status=0
    for model in ${MODELS:-small 300m}; do
      "$python" benchmarks/llm.py --model "$model" --cpu "${shape[@]}" \
        --out "$out/llm-$model-cpu.json" || status=$?
    done
    exit "$status" ;;
  *) echo "llm_gpu.sh: DEVICE=${DEVICE} is not cuda or cpu" >&2; exit 2 ;;
esac
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "llm_gpu.sh: no CUDA device here; it measures the GPU. Run it on a GPU machine, or" \
    "DEVICE=cpu MODELS=small bash benchmarks/llm_gpu.sh (SMOKE=1: tiny) for a CPU trial." >&2
  exit 2
fi
if compgen -G ".whl/*.whl" >/dev/null; then  # after the refusals: wheels for the GPU's Python
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/ddpgraph-site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/ddpgraph-site:$PYTHONPATH"
fi
gpu=$("$python" -c 'import torch; print(torch.cuda.get_device_name().split()[1].lower())')
status=0
for model in ${MODELS:-small 300m}; do  # MODELS=small: one model
  # each model well inside the device's 10-minute call
  timeout "${MODEL_TIMEOUT:-280}" "$python" benchmarks/llm.py --model "$model" "${shape[@]}" \
    --out "$out/llm-$model-$gpu.json" || status=$?
done
exit "$status"
