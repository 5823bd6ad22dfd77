#!/usr/bin/env bash
# torchtitan's own step against TrainStep on CUDA, one command (issue 48 item 3): torchtitan's
# default step, its compile option, its CUDA-graph option (0.2.2: the experimental
# compiler_toolkit), and TrainStep; torchtitan's debugmodel and 12 layers x 1024 at seq 2048;
# steps/s and peak memory per run, merged into one JSON under benchmarks/results/.
#
#   bash benchmarks/titan_gpu.sh wheels     # once, where pip reaches an index: wheels into .whl/
#   bash benchmarks/titan_gpu.sh            # on the GPU machine (the device tool: carry .whl)
#
# CONFIGS and MODES (space-separated) pick parts, to fit a 10-minute call, e.g.
#   CONFIGS=debugmodel bash benchmarks/titan_gpu.sh;  CONFIGS=12x1024 bash benchmarks/titan_gpu.sh
# Each part runs in its own torchrun on every visible GPU (NGPU to choose) and leaves
# $OUT/titan-parts/titan-CONFIG-MODE.json; the merge writes RESULT (default
# benchmarks/results/titan-gpu-<gpu>.json) from every part found there. torchtitan 0.2.2 is the
# version that imports on the device image's torch 2.11 (0.3.0 needs DataParallelMeshDims).
set -uo pipefail
cd "$(dirname "$0")/.."

wheels=(
  torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 shtab==1.13.0 typeguard==4.6.1
  docstring-parser==0.18.0 einops==0.8.2 tomli==2.5.0
  msgspec==0.23.0   # core dependency of ddpgraph (the object codec)
)
if [ "${1:-}" = wheels ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${wheels[@]}" || exit 1
  ls .whl
  exit 0
fi
if [ $# -gt 0 ]; then
  echo "titan_gpu.sh: unknown argument '$1' (the only one is 'wheels'; parts: CONFIGS, MODES)" >&2
  exit 2
fi

# Refuse at once where there is no GPU: nothing here can be measured on a CPU.
python3 -c '
import sys, torch
if not torch.cuda.is_available():
    sys.exit(
        f"titan_gpu.sh: needs a CUDA GPU, and torch {torch.__version__} sees none on this "
        "machine (torch.cuda.is_available() is False). Run it on the GPU machine (the device "
        "tool), with .whl/ from `bash benchmarks/titan_gpu.sh wheels` carried along."
    )
' || exit 2

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/ddpgraph-titan-site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/ddpgraph-titan-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python3 -c 'import torchtitan.train' || {
  echo "titan_gpu.sh: torchtitan does not import (above); make the wheels: bash benchmarks/titan_gpu.sh wheels" >&2
  exit 1
}

out="${OUT:-out}"
parts="$out/titan-parts"
mkdir -p "$parts"
ngpu="${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}"
gpu="$(python3 -c 'import torch; print(torch.cuda.get_device_name().split()[-1].lower())')"
result="${RESULT:-benchmarks/results/titan-gpu-$gpu.json}"
status=0
for config in ${CONFIGS:-debugmodel 12x1024}; do
  for mode in ${MODES:-titan titan-compile titan-cudagraph trainstep}; do
    echo "== $config $mode ($ngpu GPU)"
    timeout "${PART_TIMEOUT:-300}" torchrun --standalone --nproc-per-node="$ngpu" \
      benchmarks/titan_bench.py --config "$config" --mode "$mode" --out "$parts" \
      2>&1 | tail -5
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "titan_gpu.sh: $config $mode failed" >&2; status=1; }
  done
done
python3 benchmarks/titan_bench.py merge "$parts" --out "$result" || status=1
echo "titan_gpu.sh: $result"
exit "$status"
