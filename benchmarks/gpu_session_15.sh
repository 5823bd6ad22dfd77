#!/usr/bin/env bash
# Issue 15's GPU session in one call: the GPU tests, then the HF masked sweep (JSON under $OUT).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-out}"; mkdir -p "$out"
python -c "import torch, transformers; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), transformers.__version__)"
if [[ "${RUNS:-tests hf}" == *tests* ]]; then
  timeout "${TESTS_TIMEOUT:-330}" python -m pytest -q tests/gpu -p no:cacheprovider -rs --timeout 300 \
    --durations=10 ${PYTEST_ARGS:-} 2>&1 | tee "$out/gpu_tests.log" | tail -40
fi
if [[ "${RUNS:-tests hf}" == *hf* ]]; then
  timeout "${HF_TIMEOUT:-200}" python -m ddpgraph bench --varlen --hf ${HF_NAMES:-} --repeats "${HF_REPEATS:-1}" \
    --steps "${HF_STEPS:-48}" --out "$out/hf-masked-h200.json" 2>&1 | grep -v Warning | tail -15
fi
