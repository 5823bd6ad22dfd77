#!/usr/bin/env bash
# One GPU session's runs, in one call (device time is scarce): the GPU tests, then the benchmarks
# named in $RUNS. Results land in $OUT (or ./out): pytest logs and benchmark JSON.
#   DDPGRAPH_COMMIT=$(git rev-parse HEAD) RUNS="tests varlen loader" bash benchmarks/h200_session.sh
# RUNS: tests varlen hf (transformers models with masks) ports (examples/ports on one GPU)
#       loader (with the device_data feed) watchdog bench (BENCH_ARGS)
#       probe (steps per replay, with and without DDP)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-out}"
mkdir -p "$out"
runs="${RUNS:-tests}"
has() { [[ " $runs " == *" $1 "* ]]; }
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), torch.cuda.get_device_name())"
if has tests; then
  timeout "${TESTS_TIMEOUT:-420}" python -m pytest -q tests/gpu -p no:cacheprovider -rs \
    --durations=15 ${PYTEST_ARGS:-} 2>&1 | tee "$out/gpu_tests.log" | tail -60
fi
if has varlen; then
  timeout 200 python -m ddpgraph bench --varlen --repeats 3 --out "$out/varlen-h200.json" 2>&1 | tail -8
fi
if has hf; then
  timeout "${HF_TIMEOUT:-300}" python -m ddpgraph bench --varlen --hf ${HF_NAMES:-} \
    --repeats "${HF_REPEATS:-3}" --steps 48 --out "$out/hf-masked-h200.json" 2>&1 | grep "^run " | tail -40
fi
if has ports; then
  timeout "${PORTS_TIMEOUT:-400}" python examples/ports/run_gpu.py --out "$out/ports-h200.json" \
    --timeout "${PORT_TIMEOUT:-150}" 2>&1 | tail -30
fi
if has loader; then
  timeout 240 python benchmarks/loader.py ${LOADER_ARGS:-} --out "$out/loader-h200.json" 2>&1 | tail -25
fi
if has probe; then
  timeout 120 python benchmarks/probes/steps_per_replay_probe.py --ks 1 2 8 \
    --out "$out/steps-per-replay-probe-h200.json" 2>&1 | grep "^mlp\|^resnet"
  timeout 120 python benchmarks/probes/steps_per_replay_probe.py --no-ddp --ks 1 2 8 \
    --out "$out/steps-per-replay-probe-noddp-h200.json" 2>&1 | grep "^mlp\|^resnet"
fi
if has watchdog; then
  timeout 120 python benchmarks/watchdog_overhead.py --out "$out/watchdog-overhead-h200.json" 2>&1 | tail -10
fi
if has bench; then
  timeout "${BENCH_TIMEOUT:-400}" python -m ddpgraph bench ${BENCH_ARGS:-} --out "$out/bench-h200.json" 2>&1 | tail -20
fi
