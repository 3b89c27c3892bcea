#!/usr/bin/env bash
# The GPU run: build with CUDA, run the tests, the CUDA sanitizers, `mlakv check` and `mlakv bench`,
# writing every log under $LOGS and printing only short summaries (last, so that a tool that keeps
# the tail of stdout keeps them). $OUT receives few files: summary.txt, bench.txt / bench.json (and
# bench_h<H>.txt / .json, BENCH_HEADS) when the bench ran, and logs.tar.gz with every log. Meant
# for a machine without network: header-only dependencies and googletest come from .deps/
# (scripts/vendor_deps.sh).
#
#   scripts/gpu_run.sh [stage...]     stages: build test sanitize check bench python profile
#                                     default: build test sanitize check bench
#   One call that must finish in 10 minutes: run the stages in groups, e.g. `build`, then
#   `test check`, then `sanitize`, then `bench` (the build folder stays between calls).
#
# Environment:
#   OUT              results folder (default build-gpu/gpu-out)
#   LOGS             folder of the full logs (default build-gpu/gpu-logs)
#   BUILD_DIR        build folder (default build-gpu)
#   JOBS             build parallelism (default 16)
#   SANITIZE_FILTER  gtest filter of the sanitizer runs (default: the CUDA-parameterized tests)
#   STAGE_TIMEOUT    seconds per stage command before it is killed (default 540)
#   CALL_SECONDS     seconds the whole call may take (default 570, for the device tool's 600 s
#                    limit): a command gets at most what is left of it less 15 s, and one with
#                    under 30 s left is skipped, so that the results so far reach $OUT
#   SANITIZE_TIMEOUT the same for the sanitizer runs (default STAGE_TIMEOUT)
#   SANITIZE_SHARDS  gtest shards a sanitizer tool runs in parallel (default 6; both tools at once)
#   BENCH_HEADS      query-head counts at which the bench stage also times the mla_rope_cache
#                    workloads, after the default table at 128 (default 16: DeepSeek-V3 at
#                    tensor parallelism 8; empty: none); bench_h<H>.txt / .json
#   PROFILE_CASES    workload:T pairs that `profile` runs under Nsight Compute (one fused-kernel
#                    launch each; default: decode_nope_in_q_out:1 decode_bf16:1 decode_bf16:2048
#                    prefill_bf16:8192); rmsnorm_quant_qc:T and mla_rmsnorm_quant:T profile the
#                    rmsnorm_quant kernels
#   CMAKE_ARGS       more configure arguments, e.g. '-DMLAKV_CUDA_GENCODE=-gencode=arch=compute_90a,code=sm_90a'
#                    (Hopper code only, no PTX: a faster build for a short verification run)
#   WERROR           ON to build with -DMLAKV_WERROR=ON (default OFF: a new compiler warning must
#                    not cost a whole GPU run; the summary counts warnings instead; ptxas's spill
#                    reports stay warnings either way)
#   PREBUILT         a folder holding `mlakv` and `mlakv_tests` (and optionally `mlakv_faulty`,
#                    for tests/cli/cuda_faults.sh) built elsewhere from this tree (a
#                    CUDA build on a machine without a GPU saves the GPU machine's build minutes),
#                    plus any shared library they need that the GPU machine lacks (libgomp.so.1):
#                    the build stage copies them into BUILD_DIR instead of building, and the test
#                    stage runs mlakv_tests itself (there is no ctest file)
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BUILD_DIR=${BUILD_DIR:-$ROOT/build-gpu}
OUT=${OUT:-$BUILD_DIR/gpu-out}
LOGS=${LOGS:-$BUILD_DIR/gpu-logs}
JOBS=${JOBS:-16}
# CudaPdlProducer needs kernels to overlap, which the sanitizers prevent (they serialize them);
# CudaRefusals* provoke CUDA API errors on purpose, which memcheck reports as errors.
SANITIZE_FILTER=${SANITIZE_FILTER:-*cuda*:*Cuda*:*CUDA*:-CudaPdlProducer.*:CudaRefusals*}
STAGE_TIMEOUT=${STAGE_TIMEOUT:-540}
CALL_SECONDS=${CALL_SECONDS:-570}
SANITIZE_SHARDS=${SANITIZE_SHARDS:-6}
WERROR=${WERROR:-OFF}
if [[ $(realpath -m "$LOGS") == $(realpath -m "$OUT") ]]; then
  echo "LOGS must be a folder of its own (it is emptied first), not OUT" >&2
  exit 2
fi
mkdir -p "$OUT" "$LOGS"
rm -f "$LOGS"/*
if [[ -d /usr/local/cuda/bin ]]; then export PATH=/usr/local/cuda/bin:$PATH; fi
if [[ -n ${PREBUILT:-} ]]; then
  PREBUILT=$(realpath "$PREBUILT")
  export LD_LIBRARY_PATH=$PREBUILT${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

stages=("$@")
((${#stages[@]} == 0)) && stages=(build test sanitize check bench)

SUMMARY=$LOGS/summary.txt
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
# run_logged NAME LOG COMMAND...: runs the command with a timeout, output to LOG; notes the status.
run_logged() {
  local name=$1 log=$2
  shift 2
  local start=$SECONDS limit=$STAGE_TIMEOUT
  local left=$((CALL_SECONDS - SECONDS - 15))
  if ((left < 30)); then
    note "[$name] SKIPPED: $((CALL_SECONDS - SECONDS)) s left of CALL_SECONDS=$CALL_SECONDS"
    return 124
  fi
  ((left < limit)) && limit=$left
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$log" 2>&1
  local rc=$?
  local status="ok"
  ((rc == 124 || rc == 137)) && status="TIMED OUT after ${limit}s"
  ((rc != 0 && rc != 124 && rc != 137)) && status="FAILED (exit $rc)"
  note "[$name] $status in $((SECONDS - start)) s -> $(basename "$log")"
  publish  # what has run so far reaches $OUT even if the next command outlives the call
  return $rc
}

# gtest_shards N PREFIX COMMAND...: a gtest binary (COMMAND, with its flags) in N shards at once,
# shard i's output in PREFIX.i.log, then all of them in order on stdout; fails if a shard does.
gtest_shards() {
  local n=$1 prefix=$2 i pid rc=0 pids=()
  shift 2
  for ((i = 0; i < n; i++)); do
    GTEST_TOTAL_SHARDS=$n GTEST_SHARD_INDEX=$i "$@" >"$prefix.$i.log" 2>&1 &
    pids+=($!)
  done
  # By pid, not `jobs -p`: that no longer lists a shard which has already ended.
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  for ((i = 0; i < n; i++)); do cat "$prefix.$i.log"; done
  rm -f "$prefix".[0-9]*.log
  return $rc
}
export -f gtest_shards

# gtest_sum LOG: "R ran: P passed, S skipped, F failed" over every gtest summary in LOG (shards,
# run with --gtest_brief=1: its summary has no failed count, and each failed test is one
# "[  FAILED  ] Name" line).
gtest_sum() {
  awk '/^\[==========\] [0-9]+ tests? from/ {r += $2}
    /^\[  PASSED  \] [0-9]/ {p += $4} /^\[  SKIPPED \] [0-9]/ {s += $4}
    /^\[  FAILED  \] [A-Za-z]/ {f += 1}
    END {printf "%d ran: %d passed, %d skipped, %d failed", r, p, s, f}' "$1"
}

# The built tool's `mlakv info` into info.txt, its backends in the summary; fails if it does not
# run.
record_info() {
  "$BUILD_DIR/mlakv" info >"$LOGS/info.txt" 2>&1 || {
    head -5 "$LOGS/info.txt" | tee -a "$SUMMARY"
    return 1
  }
  sed -n '/backends:/,$p' "$LOGS/info.txt" | tee -a "$SUMMARY"
}

stage_build_prebuilt() {
  note "[build] prebuilt binaries from $PREBUILT"
  mkdir -p "$BUILD_DIR"
  cp "$PREBUILT/mlakv" "$PREBUILT/mlakv_tests" "$BUILD_DIR/" || return 1
  if [[ -f $PREBUILT/mlakv_faulty ]]; then cp "$PREBUILT/mlakv_faulty" "$BUILD_DIR/"; fi
  record_info
}

stage_build() {
  if [[ -n ${PREBUILT:-} ]]; then
    stage_build_prebuilt
    return
  fi
  local cmake_args=()
  read -ra cmake_args <<<"${CMAKE_ARGS:-}"  # split on spaces, no glob expansion
  {
    nvidia-smi -L 2>&1 || true
    nvcc --version 2>&1 | tail -2
    cmake --version | head -1
  } >"$LOGS/machine.txt"
  run_logged configure "$LOGS/configure.log" \
    cmake -S "$ROOT" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DMLAKV_CUDA=ON \
    -DMLAKV_DEPS_DIR="$ROOT/.deps" -DMLAKV_WERROR="$WERROR" "${cmake_args[@]}" || return 1
  run_logged build "$LOGS/build.log" cmake --build "$BUILD_DIR" -j"$JOBS" || {
    grep -E "error|Error" "$LOGS/build.log" | head -20 | tee -a "$SUMMARY"
    return 1
  }
  note "  build.log: $(grep -c 'warning' "$LOGS/build.log") warning lines," \
    "$(grep -c 'spilled' "$LOGS/build.log") register-spill lines"
  record_info
}

stage_test() {
  if [[ ! -f $BUILD_DIR/CTestTestfile.cmake ]]; then  # prebuilt: the test binary, in shards
    local shards=8
    run_logged mlakv_tests "$LOGS/ctest.log" bash -c 'gtest_shards "$@"' _ "$shards" \
      "$LOGS/shard" env OMP_NUM_THREADS=2 "$BUILD_DIR/mlakv_tests" --gtest_brief=1
    local rc=$?
    note "  $(gtest_sum "$LOGS/ctest.log") ($shards shards)"
    grep -E "^\[  FAILED  \] [A-Za-z]" "$LOGS/ctest.log" | head -20 | tee -a "$SUMMARY"
    if [[ -f $BUILD_DIR/mlakv_faulty ]]; then  # ctest's cli.fault.cuda
      run_logged cuda_faults "$LOGS/cuda_faults.log" \
        sh tests/cli/cuda_faults.sh "$BUILD_DIR/mlakv_faulty"
      local faults_rc=$?
      ((faults_rc != 0 && faults_rc != 77)) && rc=1  # 77: skipped (no CUDA device or backend)
      grep -E "^(ok|FAILED) |cuda_faults.sh" "$LOGS/cuda_faults.log" | tee -a "$SUMMARY"
    fi
    return $rc
  fi
  run_logged ctest "$LOGS/ctest.log" \
    ctest --test-dir "$BUILD_DIR" --output-on-failure -j8 --timeout 300
  local rc=$?
  grep -E "tests passed|tests failed|Total Test time" "$LOGS/ctest.log" | tee -a "$SUMMARY"
  grep -E "^\s+[0-9]+ - .*\((Failed|Timeout|SEGFAULT|Subprocess)" "$LOGS/ctest.log" | head -20 |
    tee -a "$SUMMARY"
  return $rc
}

stage_sanitize() {
  local tool rc=0 STAGE_TIMEOUT=${SANITIZE_TIMEOUT:-$STAGE_TIMEOUT}
  # Both tools at once, each over SANITIZE_SHARDS gtest shards in parallel (one GPU serves them
  # all; the sanitizers' time is mostly host-side). <tool>.log holds the shards' logs in order.
  run_logged "compute-sanitizer memcheck + racecheck, $SANITIZE_SHARDS shards each" \
    "$LOGS/sanitize.log" bash -c '
      n=$1 bin=$2 logs=$3 filter=$4 pids=()
      for tool in memcheck racecheck; do
        gtest_shards "$n" "$logs/$tool" env OMP_NUM_THREADS=1 \
          compute-sanitizer --tool "$tool" --error-exitcode 1 --print-limit 20 \
          "$bin" --gtest_filter="$filter" --gtest_brief=1 >"$logs/$tool.log" &
        pids+=($!)
      done
      rc=0
      for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
      exit $rc' _ "$SANITIZE_SHARDS" "$BUILD_DIR/mlakv_tests" "$LOGS" "$SANITIZE_FILTER" || rc=1
  local i done_shards reported shard_logs
  for tool in memcheck racecheck; do
    # Stopped by the time limit, gtest_shards leaves its shards' own logs behind (it joins them
    # only once all have ended): join them here, so that the count below holds the shards that
    # finished and the errors any shard reported before it was stopped.
    shard_logs=()
    for ((i = 0; i < SANITIZE_SHARDS; i++)); do
      [[ -e $LOGS/$tool.$i.log ]] && shard_logs+=("$LOGS/$tool.$i.log")
    done
    if ((${#shard_logs[@]} > 0)); then
      done_shards=$(grep -lE 'ERROR SUMMARY|RACECHECK SUMMARY' "${shard_logs[@]}" | wc -l)
      reported=$(cat "${shard_logs[@]}" | grep -cE '^========= (Invalid|Error|Warning|Program hit)')
      cat "${shard_logs[@]}" >>"$LOGS/$tool.log"
      rm -f "${shard_logs[@]}"
      note "  $tool: stopped before the end: $done_shards of $SANITIZE_SHARDS shards finished;" \
        "$reported errors or hazards reported by then (the finished shards' tests are counted below)"
    fi
    note "  $tool: $(gtest_sum "$LOGS/$tool.log") ($SANITIZE_SHARDS shards);" \
      "$(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOGS/$tool.log" | sort | uniq -c | tr -s ' ' |
        paste -sd ';' -)"
    grep -hE '^\[  FAILED  \] [A-Za-z]' "$LOGS/$tool.log" | head -10 | tee -a "$SUMMARY"
  done
  # `mlakv check`'s random layouts, indices and shapes (every op) under memcheck, a few seeds.
  run_logged "compute-sanitizer memcheck: mlakv check" "$LOGS/memcheck_check.log" \
    compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 20 \
    "$BUILD_DIR/mlakv" check --backend cuda --seeds 4 || rc=1
  grep -E "ERROR SUMMARY|^summary" "$LOGS/memcheck_check.log" | tee -a "$SUMMARY"
  return $rc
}

stage_check() {
  run_logged "mlakv check" "$LOGS/check.txt" "$BUILD_DIR/mlakv" check --backend all
  local rc=$?
  grep -E "PASS|FAIL|MISMATCH|summary|skipped" "$LOGS/check.txt" | tail -24 | tee -a "$SUMMARY"
  return $rc
}

stage_bench() {
  run_logged "mlakv bench" "$LOGS/bench.txt" \
    "$BUILD_DIR/mlakv" bench --json "$LOGS/bench.json"
  local rc=$? h
  cat "$LOGS/bench.txt" >>"$SUMMARY"
  for h in ${BENCH_HEADS-16}; do
    run_logged "mlakv bench --heads $h" "$LOGS/bench_h$h.txt" \
      "$BUILD_DIR/mlakv" bench --heads "$h" --json "$LOGS/bench_h$h.json" --workload \
      decode_bf16,decode_bf16_norm,decode_fp8,decode_nope_in_q_out,prefill_bf16,mixed_bf16 || rc=1
    cat "$LOGS/bench_h$h.txt" >>"$SUMMARY"
  done
  return $rc
}

stage_python() {
  if [[ ! -f scripts/test_python.sh ]]; then
    note "[python] scripts/test_python.sh missing: skipped"
    return 0
  fi
  MLAKV_PY_SYSTEM=1 MLAKV_PY_CUDA=1 CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
    run_logged python "$LOGS/python.log" bash scripts/test_python.sh
  local rc=$?
  tail -n 5 "$LOGS/python.log" | tee -a "$SUMMARY"
  return $rc
}

# One launch of the fused kernel per workload:T under ncu (clocks left alone): duration, memory
# throughput, occupancy, warp stall reasons and the hottest source lines.
stage_profile() {
  local spec w t kernel rc=0 r STALL_METRICS=""
  for r in long_scoreboard imc_miss no_instruction wait lg_throttle drain barrier membar \
    short_scoreboard mio_throttle math_pipe_throttle branch_resolving dispatch_stall not_selected \
    selected misc sleeping tex_throttle; do
    STALL_METRICS+="${STALL_METRICS:+,}smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
  done
  for spec in ${PROFILE_CASES:-decode_nope_in_q_out:1 decode_bf16:1 decode_bf16:2048 prefill_bf16:8192}; do
    w=${spec%%:*}
    t=${spec##*:}
    case $w in
      rmsnorm_quant_qc | mla_rmsnorm_quant) kernel=rmsnorm_quant ;;
      *) kernel=mla_rope_cache_kernel ;;
    esac
    run_logged "ncu $spec" "$LOGS/ncu_${w}_${t}.txt" \
      ncu --clock-control none --cache-control none -k "regex:$kernel" --launch-skip 8 --launch-count 1 \
      --section SpeedOfLight --section LaunchStats --section Occupancy \
      --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      --section SourceCounters --metrics "$STALL_METRICS" \
      "$BUILD_DIR/mlakv" bench --backend cuda --workload "$w" --tokens "$t" --iters 20 \
      --skip-check || rc=1
    grep -E "^\s+(Duration|DRAM Throughput|Memory Throughput|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued Instruction|Block Limit [A-Z])|issue_stalled" \
      "$LOGS/ncu_${w}_${t}.txt" | sed 's/  */ /g' | tee -a "$SUMMARY"
  done
  return $rc
}

# The summary and the bench results into $OUT.
publish() {
  cp "$SUMMARY" "$OUT/"
  local f
  for f in "$LOGS"/bench.txt "$LOGS"/bench.json "$LOGS"/bench_h*.txt "$LOGS"/bench_h*.json; do
    [[ -f $f ]] && cp "$f" "$OUT/"
  done
}

# Killed from outside (the caller's time limit): leave what has run in $OUT.
trap 'publish; tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null; exit 143' TERM INT

failed=()
for stage in "${stages[@]}"; do
  case "$stage" in
    build | test | sanitize | check | bench | python | profile) ;;
    *)
      echo "unknown stage '$stage' (build test sanitize check bench python profile)" >&2
      exit 2
      ;;
  esac
  echo "== $stage" >>"$SUMMARY"
  "stage_$stage" >/dev/null || failed+=("$stage")
  # What has run so far reaches $OUT even if a later stage outlives the caller's time limit.
  publish
  if [[ $stage == build && ${#failed[@]} -gt 0 ]]; then break; fi
done

publish
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null
echo
echo "===== gpu_run summary (logs in $LOGS, copied to $OUT/logs.tar.gz) ====="
cat "$SUMMARY"
if ((${#failed[@]} > 0)); then
  echo "FAILED stages: ${failed[*]}"
  exit 1
fi
echo "all stages ok: ${stages[*]}"
