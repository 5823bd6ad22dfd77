#!/usr/bin/env bash
# The GPU measurements left open by the last stop, as one device call (about 7 minutes on an H100):
#
#   bash benchmarks/gpu_followups.sh          # on the GPU machine (the device tool: carry .whl
#                                             # and a copy of ../shared/upstream as .upstream)
#
# 1. host time of a replayed step(x, y) and step(data), three runs (issue 51; step(data)'s call
#    path went from 25 ddpgraph calls to 12 after fb2ebbd's 41.7 us): host-time-<n>.json
#    (benchmarks/probes/host_time_probe.py), the third with a cProfile table (host-profile.txt);
# 2. torchvision's train.py --amp as written and ported (issue 52's one GPU-only difference left):
#    tv-adamw-2.json, the AdamW-with-clipping set's seed-2 last update, with each side's
#    clip_grad_norm_ of that batch (its total norm: did it clip?) beside the fused AdamW write;
# 3. complete_cv_example.py's figure with the step held eager while OneCycleLR rewrites Adam's
#    betas (issue 52 item 5; 0.88x at fb2ebbd): upstream-ports-cv-amp.json
#    (benchmarks/upstream_ports.py);
# 4. where that eager port's extra time goes: cv-eager-profile.json, torch.profiler over three
#    held-eager updates of the script and of its port (benchmarks/probes/eager_ops_per_update.py
#    --profile: wall, host and device ms per update and the ops taking the most device time).
# 5. (PARTS=ab, not in the default) the host time of part 1 for another tree's src/ (AB_SRC=DIR,
#    carried beside this one) and for this one, alternating three times on the same machine:
#    host-ab-before-<n>.json / host-ab-after-<n>.json, a change's effect with its baseline.
# 6. (PARTS=parts, not in the default) where a replayed step(x, y)'s host time goes, part by part
#    (benchmarks/probes/host_time_parts.py), three runs: host-parts-<n>.json.
# PARTS="host tv cv profile" (the default: all four) picks parts. Each part has its own time
# limit and writes its JSON into $OUT (default out/); a part that fails leaves the others' files.
# Without CUDA it refuses.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"
mkdir -p "$out"
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "gpu_followups.sh: no CUDA device here; run it on the GPU machine" >&2
  exit 2
}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/ddpgraph-site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/ddpgraph-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export DDPGRAPH_UPSTREAM="${DDPGRAPH_UPSTREAM:-$PWD/.upstream}"
parts=" ${PARTS:-host tv cv profile} "  # PARTS="tv cv": only those parts
want() { [[ "$parts" == *" $1 "* ]]; }
status=0
if want host; then
  for n in 1 2 3; do
    profile=()
    [ "$n" = 3 ] && profile=(--profile "$out/host-profile.txt")
    timeout 120 python3 benchmarks/probes/host_time_probe.py --label "run$n" "${profile[@]}" \
      --out "$out/host-time-$n.json" | tail -1 || status=1
  done
fi
if want ab; then  # AB_SRC=DIR (another tree's src/, carried): it and this src/, alternating
  [ -d "${AB_SRC:-}/ddpgraph" ] || { echo "gpu_followups.sh: part ab needs AB_SRC=DIR/src" >&2; exit 2; }
  for n in 1 2 3; do
    for side in before after; do
      src="$PWD/src"
      [ "$side" = before ] && src="$(cd "$AB_SRC" && pwd)"
      PYTHONPATH="$src:${PYTHONPATH#"$PWD/src:"}" timeout 120 python3 \
        benchmarks/probes/host_time_probe.py --label "$side$n" --out "$out/host-ab-$side-$n.json" \
        | tail -1 || status=1
    done
  done
fi
if want parts; then  # where a replayed step(x, y)'s host time goes, part by part, three runs
  for n in 1 2 3; do
    timeout 120 python3 benchmarks/probes/host_time_parts.py --out "$out/host-parts-$n.json" \
      | tail -1 || status=1
  done
fi
if want tv; then
  timeout 120 python3 benchmarks/probes/torchvision_amp_updates.py --opt adamw --seed 2 \
    --out "$out/tv-adamw-2.json" | tail -40 || status=1
fi
if want cv; then
  timeout 200 python3 benchmarks/upstream_ports.py --scripts cv --precisions amp \
    --out "$out/upstream-ports-cv-amp.json" | tail -5 || status=1
fi
if want profile; then
  timeout 240 python3 benchmarks/probes/eager_ops_per_update.py --device cuda --profile \
    --out "$out/cv-eager-profile.json" | tail -5 || status=1
fi
exit "$status"
