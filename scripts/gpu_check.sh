#!/usr/bin/env bash
# The GPU check, one command, for a lent GPU machine: Python with torch (CUDA), pytest,
# wrapt, packaging; NO vLLM, NO network, nothing installed (no pip).
#
#   python3 scripts/gpu_release_code.py     # BEFORE, where the unpacked wheels are: copies
#                                           # 0.17.0/0.22.0/0.24.0's extract_hidden_states.py
#                                           # into gpu-release-code/ (git-ignored; carry it)
#   bash scripts/gpu_check.sh               # on the GPU machine; results under $OUT
#
# Steps (each one's output in $OUT/<step>.txt, pytest's junit in $OUT/<step>-junit.xml):
#   release-code       the copied release files are there (the tests need them)
#   tests              tests/gpu/test_gpu.py: both replacements (bytes, no host sync, CUDA-graph
#                      capture + replay with new inputs, contiguous and strided) and the
#                      releases' own basic_cache in a padded CUDA graph (the original
#                      overwrites a live request's last slot, the patched one never does);
#                      on CUDA nothing may be skipped
#   planted-<kind>     the same tests with a WRONG replacement swapped in
#                      (VLLM_HSFIX_CHECK_PLANT): they must fail, and only the replacement
#                      tests: proof that this check can fail
#   bench              benchmarks/bench_scatter.py: ratios against upstream's formula,
#                      measured in the same run; exits 1 on wrong bytes
#
# Exit: 0 every step passed; 1 a step failed; 2 cannot run here (no CUDA GPU, or torch
# does not import), with the reason on stderr and in $OUT/summary.txt; 3 a step timed
# out or crashed. Several steps: the worst. Under 8 minutes in all (per-step timeouts).
#
# VLLM_HSFIX_CHECK_STEPS="tests bench": run only these steps (of: release-code tests
# planted bench; default all).
# VLLM_HSFIX_CHECK_DEVICE=cpu: a dry run of the same steps on CPU tensors where there is
# no GPU (sync and graph tests skip with a reason; "syncs" is not planted: only CUDA can
# catch it). It says so everywhere: it is NOT a GPU result.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
PY="${PYTHON:-python3}"
DEVICE="${VLLM_HSFIX_CHECK_DEVICE:-cuda}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_HSFIX_RELEASE_CODE="${VLLM_HSFIX_RELEASE_CODE:-$PWD/gpu-release-code}"
export VLLM_HSFIX_REQUIRE_RELEASE_CODE=1
export VLLM_HSFIX_CHECK_DEVICE="$DEVICE"
RELEASES=(0.17.0 0.22.0 0.24.0)
STEPS="${VLLM_HSFIX_CHECK_STEPS:-release-code tests planted bench}"
wanted() { [[ " $STEPS " == *" $1 "* ]]; }

say() { echo "$*" | tee -a "$SUMMARY"; }

# --- can it run here? ---------------------------------------------------------------
reason=$("$PY" - "$DEVICE" $STEPS 2>&1 <<'PY'
import sys

device, *steps = sys.argv[1:]
unknown = sorted(set(steps) - {"release-code", "tests", "planted", "bench"})
if unknown or not steps:
    print(f"VLLM_HSFIX_CHECK_STEPS: unknown step(s) {unknown}, or none")
    sys.exit(2)
if device not in ("cuda", "cpu"):
    print(f"VLLM_HSFIX_CHECK_DEVICE={device!r}: expected 'cuda' or 'cpu'")
    sys.exit(2)
try:
    import torch
except Exception as exc:  # noqa: BLE001 - any failure to import means: cannot run here
    print(f"torch does not import with {sys.executable}: {exc!r}")
    sys.exit(2)
if device == "cpu":
    print(f"CPU DRY RUN (VLLM_HSFIX_CHECK_DEVICE=cpu), torch {torch.__version__}: "
          "byte checks on CPU tensors, no sync or CUDA-graph checks: NOT a GPU result")
    sys.exit(0)
if not torch.cuda.is_available():
    print(f"no CUDA GPU: torch {torch.__version__} (built for CUDA {torch.version.cuda}) "
          "sees no device, torch.cuda.is_available() is False")
    sys.exit(2)
print(f"torch {torch.__version__} CUDA {torch.version.cuda} on "
      f"{torch.cuda.get_device_name(0)} (x{torch.cuda.device_count()})")
PY
)
if [ $? -ne 0 ]; then
  printf 'gpu_check: cannot run here: %s\ngpu_check: exit 2\n' "${reason##*$'\n'}" |
    tee -a "$SUMMARY" >&2
  exit 2
fi
say "gpu_check: $reason"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
  echo "$reason"
} >"$OUT/device.txt"

# --- steps ---------------------------------------------------------------------------
worst=0
declare -a ROWS=()

# run NAME TIMEOUT_S COMMAND...: output to $OUT/NAME.txt; sets RC (its exit status) and SECS.
run() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$OUT/$name.txt" 2>&1
  RC=$?
  SECS=$((SECONDS - t0))
  if [ $RC -eq 124 ] || [ $RC -eq 137 ]; then
    echo "gpu_check: timed out after $limit s" >>"$OUT/$name.txt"
  fi
}

# crashed RC: true when an exit status means timed out or killed (step result 3).
crashed() { [ "$1" -eq 124 ] || [ "$1" -ge 128 ]; }

# record NAME RESULT NOTE: RESULT 0 passed, 1 failed, 3 timed out or crashed.
record() {
  ROWS+=("$(printf '%-20s %-6s %4d s  %s' "$1" "$([ "$2" -eq 0 ] && echo ok || echo "FAIL$2")" \
    "$SECS" "$3")")
  [ "$2" -gt $worst ] && worst=$2
  return 0
}

# plain_step NAME TIMEOUT_S COMMAND...: passes when the command exits 0.
plain_step() {
  local name=$1
  run "$@"
  if [ $RC -eq 0 ]; then record "$name" 0 "$OUT/$name.txt"
  elif crashed $RC; then record "$name" 3 "exit $RC: $OUT/$name.txt"
  else record "$name" 1 "exit $RC: $OUT/$name.txt"; fi
}

# verify_junit XML MODE [REQUIRED_PREFIX...]: judge a pytest run by its junit report.
#   clean:   at least one test ran, none failed; on CUDA none skipped, on the CPU only the
#            CUDA-only tests skipped
#   planted: at least one failure, every failure is a test of the replacement, and every
#            test whose name starts with a REQUIRED_PREFIX failed (and there is one)
verify_junit() {
  "$PY" - "$@" <<'PY'
import os
import sys
import xml.etree.ElementTree as ET

path, mode, *required = sys.argv[1:]
cases = []
for tc in ET.parse(path).iter("testcase"):
    if tc.find("failure") is not None or tc.find("error") is not None:
        state = "failed"
    elif tc.find("skipped") is not None:
        state = "skipped: " + (tc.find("skipped").get("message") or "")
    else:
        state = "passed"
    cases.append((tc.get("name") or "", state))
failed = [n for n, s in cases if s == "failed"]
skipped = [(n, s) for n, s in cases if s.startswith("skipped")]
passed = [n for n, s in cases if s == "passed"]
print(f"{path}: {len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped")
bad = []
if mode == "clean":
    if not passed:
        bad.append("no test passed")
    bad += [f"failed: {n}" for n in failed]
    cpu = os.environ.get("VLLM_HSFIX_CHECK_DEVICE") == "cpu"
    for n, s in skipped:
        if not cpu or "CUDA" not in s:
            bad.append(f"must not be skipped here: {n} ({s})")
else:
    if not failed:
        bad.append("the planted replacement failed no test")
    bad += [f"a test that does not test the replacement failed: {n}"
            for n in failed if "replacement" not in n]
    for prefix in required:
        mine = [(n, s) for n, s in cases if n.split("[")[0] == prefix]
        if not mine:
            bad.append(f"no test {prefix} ran")
        bad += [f"the planted replacement passed: {n} ({s})" for n, s in mine if s != "failed"]
    print("caught by: " + ", ".join(sorted({n.split("[")[0] for n in failed})))
for b in bad:
    print("BAD: " + b)
sys.exit(1 if bad else 0)
PY
}

check_release_code() {
  local missing=0
  for r in "${RELEASES[@]}"; do
    f="$VLLM_HSFIX_RELEASE_CODE/vllm-$r/extract_hidden_states.py"
    if [ -f "$f" ]; then
      echo "$r: $f ($(wc -c <"$f") bytes, sha256 $(sha256sum <"$f" | cut -c1-16))"
    else
      echo "MISSING $r: $f (run python3 scripts/gpu_release_code.py where the overlays are," \
        "and carry gpu-release-code)"
      missing=1
    fi
  done
  return $missing
}

# pytest_step NAME TIMEOUT_S MODE PLANT [REQUIRED...] [-- PYTEST_ARGS...]: run
# tests/gpu/test_gpu.py; MODE clean passes when pytest passed and the report is clean, MODE
# planted when pytest FAILED (exit 1) exactly as verify_junit demands.
pytest_step() {
  local name=$1 limit=$2 mode=$3 plant=$4
  shift 4
  local required=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    required+=("$1")
    shift
  done
  [ $# -gt 0 ] && shift
  local xml="$OUT/$name-junit.xml" verdict=0
  run "$name" "$limit" env VLLM_HSFIX_CHECK_PLANT="$plant" \
    "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfEs tests/gpu/test_gpu.py \
    --junitxml="$xml" "$@"
  if crashed $RC; then
    record "$name" 3 "pytest exit $RC: $OUT/$name.txt"
  elif [ ! -f "$xml" ]; then
    record "$name" 1 "pytest exit $RC, no junit report: $OUT/$name.txt"
  elif [ "$mode" = planted ]; then
    verify_junit "$xml" planted "${required[@]}" >>"$OUT/$name.txt" 2>&1 || verdict=1
    [ $RC -eq 1 ] || verdict=1
    record "$name" $verdict "pytest exit $RC (must fail: 1): $OUT/$name.txt"
  else
    verify_junit "$xml" clean >>"$OUT/$name.txt" 2>&1 || verdict=1
    [ $RC -eq 0 ] || verdict=1
    record "$name" $verdict "pytest exit $RC: $OUT/$name.txt"
  fi
}

SECS=0
if ! wanted release-code; then
  :
elif check_release_code >"$OUT/release-code.txt" 2>&1; then
  record release-code 0 "$OUT/release-code.txt"
else
  record release-code 1 "missing release files: $OUT/release-code.txt"
fi

# A plant set from outside reaches this step (and must fail it); the planted steps
# below set their own.
wanted tests && pytest_step tests 120 clean "${VLLM_HSFIX_CHECK_PLANT:-}"

BYTES=(test_replacement_bytes test_release_replacement_keeps_the_live_last_slot)
GRAPH=(test_replacement_cuda_graph_replays_new_inputs
  test_release_replacement_in_cuda_graph_keeps_the_live_last_slot)
if ! wanted planted; then
  :
elif [ "$DEVICE" = cuda ]; then
  pytest_step planted-unclamped 60 planted unclamped "${BYTES[@]}" "${GRAPH[@]}"
  pytest_step planted-wrong-slot 60 planted wrong-slot "${BYTES[@]}" "${GRAPH[@]}"
  # Only the replacement tests: a capture that syncs aborts the capture, and what it
  # leaves behind must not be blamed on the release tests that follow.
  pytest_step planted-syncs 60 planted syncs test_replacement_no_host_sync "${GRAPH[@]}" \
    -- -k replacement
else
  pytest_step planted-unclamped 60 planted unclamped "${BYTES[@]}"
  pytest_step planted-wrong-slot 60 planted wrong-slot "${BYTES[@]}"
fi

if [ "$DEVICE" = cuda ]; then
  bench_args=(--device cuda --full --reps 50)
else
  bench_args=(--device cpu --quick --reps 3)
fi
wanted bench && plain_step bench 150 "$PY" benchmarks/bench_scatter.py --no-vllm \
  --release-code "$VLLM_HSFIX_RELEASE_CODE" "${bench_args[@]}"

# --- report --------------------------------------------------------------------------
say ""
say "step                 result   time  output"
for row in "${ROWS[@]}"; do say "$row"; done
say ""
[ -f "$OUT/tests.txt" ] && say "tests: $(grep -E -- '-junit.xml: ' "$OUT/tests.txt" | tail -1)"
for f in "$OUT"/planted-*.txt; do
  [ -f "$f" ] || continue
  say "$(basename "$f" .txt): $(grep -E '^caught by' "$f" | tail -1)" \
    "($(grep -c '^BAD' "$f") problem(s) with the planted run)"
done
if [ -f "$OUT/bench.txt" ]; then
  say "bench: $(grep -E '^(bytes:|BAD)' "$OUT/bench.txt" | head -1 || tail -1 "$OUT/bench.txt")"
  grep -E '/ upstream: median' "$OUT/bench.txt" | tee -a "$SUMMARY"
fi
[ "$STEPS" = "release-code tests planted bench" ] || say "ONLY THESE STEPS: $STEPS"
[ "$DEVICE" = cpu ] && say "CPU DRY RUN: not a GPU result"
case $worst in
  0) say "gpu_check: exit 0 (every step passed)" ;;
  1) say "gpu_check: exit 1 (a step failed: see its output)" ;;
  *) say "gpu_check: exit $worst (a step timed out or crashed: see its output)" ;;
esac
exit "$worst"
