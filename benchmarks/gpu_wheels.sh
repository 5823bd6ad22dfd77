#!/usr/bin/env bash
# Wheels for what the GPU image lacks (it has torch, transformers, accelerate, lightning, peft,
# timm), for its Python 3.12 on x86-64, into .whl/ (git ignores it). The versions are those the
# CPU tests run with; gpu_suite.sh installs them before the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=(
  msgspec==0.23.0              # core dependency of ddpgraph (the object codec)
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19   # TRL's trainers
  evaluate==0.4.6              # run_glue_no_trainer.py's metric (benchmarks/upstream_ports.py)
  jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0   # LightningCLI
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${wheels[@]}"
ls .whl
