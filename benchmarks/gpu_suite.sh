#!/usr/bin/env bash
# tests/gpu whole on one GPU machine, in parts that each fit a 10-minute call, and the GPU receipt.
#
#   bash benchmarks/gpu_wheels.sh            # once, on a machine with pip: what the GPU image lacks
#   bash benchmarks/gpu_suite.sh 1           # on the GPU machine (the device tool: carry .whl)
#   bash benchmarks/gpu_suite.sh 2
#   python benchmarks/gpu_receipt.py merge PART1_DIR PART2_DIR --expect-head \
#       --out benchmarks/results/gpu-tests-h200.json
#
# PART is 1 or 2 (the test files, sorted, split in two halves), "all" (one run, on a machine
# with no call limit) or "only" (the files FILES names: a check, not a receipt). Each part leaves
# gpu-tests-PART.xml (JUnit), gpu-env-PART.json (tree hashes, versions) and gpu-tests-PART.log in
# $OUT (default ./out). Wheels in .whl/ are installed first: the GPU image has torch but not
# msgspec (a core dependency), trl, datasets or jsonargparse.
set -uo pipefail
cd "$(dirname "$0")/.."
part="${1:-all}"
out="${OUT:-out}"
mkdir -p "$out"
mapfile -t files < <(ls tests/gpu/test_*.py | sort)
half=$(((${#files[@]} + 1) / 2))
case "$part" in
  1) selected=("${files[@]:0:half}") ;;
  2) selected=("${files[@]:half}") ;;
  all) selected=("${files[@]}") ;;
  only) read -ra selected <<<"${FILES:-}"  # FILES="tests/gpu/a.py tests/gpu/b.py": those alone
    [ "${#selected[@]}" -gt 0 ] || { echo "gpu_suite.sh only: set FILES to the test files" >&2; exit 2; } ;;
  *) echo "gpu_suite.sh: PART must be 1, 2, all or only (with FILES), not '$part'" >&2; exit 2 ;;
esac
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/ddpgraph-site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/ddpgraph-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

python3 benchmarks/gpu_receipt.py env --out "$out/gpu-env-$part.json" || exit 1
# A part stops itself well inside the device's 10-minute call so its JUnit file is still written
# (SIGINT: pytest ends the session as on Ctrl-C and writes what ran; KILL 30 s later).
timeout -s INT -k 30 "${SUITE_TIMEOUT:-560}" python3 -m pytest -q -p no:cacheprovider -rfEs --durations=10 \
  --junitxml="$out/gpu-tests-$part.xml" ${PYTEST_ARGS:-} "${selected[@]}" 2>&1 \
  | tee "$out/gpu-tests-$part.log" | tail -40
status=${PIPESTATUS[0]}
[ -s "$out/gpu-tests-$part.xml" ] || echo "gpu_suite.sh: part $part wrote no JUnit file (status $status)" >&2
exit "$status"
