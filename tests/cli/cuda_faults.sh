#!/bin/sh
# mlakv tests: the CUDA half of the cli.fault.* tests. `mlakv check` and `mlakv bench` on the CUDA
# backend, over the deliberately faulty library (tests/cli/faulty_ops.cpp), must name each fault
# and exit non-zero: a check that cannot see a wrong byte on the GPU is the defect looked for.
#   cuda_faults.sh MLAKV_FAULTY
# Exits 77 (ctest: skipped) when the tool has no CUDA backend or sees no device, 1 when a case
# fails, 0 when all pass. ctest runs it as cli.fault.cuda (CUDA builds); scripts/gpu_run.sh runs it
# for prebuilt binaries.
faulty=$1
[ -x "$faulty" ] || { echo "cuda_faults.sh: not an executable: $faulty"; exit 2; }
here=$(dirname "$0")
if ! "$faulty" info 2>&1 | grep -q "^  cuda: built, [1-9][0-9]* visible device"; then
  echo "cuda_faults.sh: no CUDA device visible to $faulty: skipped"
  exit 77
fi

failed=0
# case NAME FAULT STATUS PATTERN... -- ARG...: one run of the faulty tool, held by expect.sh.
case_() {
  name=$1 fault=$2
  shift 2
  if out=$(MLAKV_FAULT=$fault sh "$here/expect.sh" "$@" </dev/null 2>&1); then
    echo "ok      $name"
  else
    echo "FAILED  $name (MLAKV_FAULT=$fault)"
    printf '%s\n' "$out" | sed 's/^/        /'
    failed=1
  fi
}

# The rows of tests/cli/fault_cases.txt (ctest runs them on the CPU backend): check and bench on
# CUDA must find the same faults. The option words of each command (split into words on purpose;
# the tool's path is passed as one word of its own, so that it may hold spaces).
check="check --backend cuda --seeds 2 --ops"
bench="bench --backend cuda --iters 1 --workload"
rows=$(grep -E '^(check|bench)[|]' "$here/fault_cases.txt")
[ -n "$rows" ] || { echo "cuda_faults.sh: no rows in fault_cases.txt"; exit 2; }
while IFS='|' read -r kind name fault f4 f5 f6; do
  if [ "$kind" = check ]; then
    # f4: the ops (--ops); f5: all or some cases fail; f6: the mismatch message.
    if [ "$f5" = all ]; then
      case_ "check_$name" "$fault" 1 "summary: 10 comparisons, 10 mismatches: FAIL" \
        "cuda 0/2 ok .*FAIL$" "MISMATCH cuda vs reference: seed .*: $f6" -- "$faulty" $check "$f4"
    else
      case_ "check_$name" "$fault" 1 "summary: 10 comparisons, [1-9] mismatches: FAIL" \
        "MISMATCH cuda vs reference: seed .*: $f6" -- "$faulty" $check "$f4"
    fi
  else
    # f4: the exit status; f5: the workload and its arguments (split into words on purpose);
    # f6: the pattern.
    case_ "bench_$name" "$fault" "$f4" "$f6" -- "$faulty" $bench $f5
  fi
done <<EOF
$rows
EOF

# check --backend all: a fault in the CUDA run alone (@cuda) must also fail cuda == cpu, while
# the CPU run passes.
both="check --backend all --seeds 2"
case_ check_cuda_vs_cpu mla_rope_cache@cuda:kv_cache 1 \
  "summary: 30 comparisons, 20 mismatches: FAIL" "cpu 2/2 ok  cuda 0/2 ok  cuda==cpu 0/2" \
  "MISMATCH cuda vs cpu: seed .*: kv_cache: byte 0 of" -- "$faulty" $both --ops mla_rope_cache
case_ check_cuda_vs_cpu_counter mla_rope_cache@cuda:counter 1 \
  "summary: 30 comparisons, 20 mismatches: FAIL" \
  "MISMATCH cuda vs cpu: seed .*: error counter .*: 1 vs cpu 0" -- "$faulty" $both --ops mla_rope_cache
# rmsnorm_quant runs in 3 of the 5 configs of its family. Of their 6 cases one is an empty batch
# (rmsnorm_quant 1536, seed 2: no scales to change), so 5 fail against the reference and 5 against
# the CPU.
case_ check_cuda_vs_cpu_norm rmsnorm_quant@cuda:scales:last 1 \
  "summary: 30 comparisons, 10 mismatches: FAIL" \
  "rmsnorm_quant 7168  *cpu 2/2 ok  cuda 0/2 ok  cuda==cpu 0/2" \
  "MISMATCH cuda vs cpu: seed .*: scales: byte [1-9]" -- "$faulty" $both --ops rmsnorm_quant
# gather_cache_slots runs in 2 of the 5 configs of its family and in some cases of the fifth.
case_ check_cuda_vs_cpu_gather gather_cache_slots@cuda:out:last 1 \
  "summary: 30 comparisons, [1-9][0-9]* mismatches: FAIL" \
  "gather_cache_slots L512 R64  *cpu 2/2 ok  cuda 0/2 ok  cuda==cpu 0/2" \
  "MISMATCH cuda vs cpu: seed .*: out: byte [1-9]" -- "$faulty" $both --ops gather
# rotary_embedding runs in the first 2 configs of the unfused family.
case_ check_cuda_vs_cpu_unfused rotary_embedding@cuda:query:last 1 \
  "summary: 30 comparisons, 8 mismatches: FAIL" \
  "rotary_embedding any shape  *cpu 2/2 ok  cuda 0/2 ok  cuda==cpu 0/2" \
  "MISMATCH cuda vs cpu: seed .*: query: byte [1-9]" -- "$faulty" $both --ops unfused
case_ check_all_pass none:none 0 "summary: 120 comparisons, 0 mismatches: PASS" -- "$faulty" $both

# --device: past the last GPU the commands refuse; with two GPUs, check and bench on cuda:1 (the
# current device stays cuda:0 in check) must still see a fault in the CUDA run alone.
case_ check_device_past_the_last none:none 2 "--device: expected a GPU index below" \
  -- "$faulty" check --backend cuda --seeds 1 --device 1023
case_ bench_device_past_the_last none:none 2 "--device: expected a GPU index below" \
  -- "$faulty" $bench decode_bf16 --tokens 1 --device 1023
gpus=$("$faulty" info 2>&1 | sed -nE 's/^  cuda: built, ([0-9]+) visible device.*/\1/p')
if [ "${gpus:-0}" -ge 2 ]; then
  case_ check_device1_cuda_vs_cpu mla_rope_cache@cuda:kv_cache 1 \
    "summary: 30 comparisons, 20 mismatches: FAIL" "cuda = cuda:1" \
    "MISMATCH cuda vs cpu: seed .*: kv_cache: byte 0 of" -- "$faulty" $both --ops mla_rope_cache --device 1
  case_ check_device1_pass none:none 0 "summary: 120 comparisons, 0 mismatches: PASS" -- "$faulty" $both --device 1
  case_ bench_device1_unfused concat_and_cache_mla:kv_cache 2 \
    "CHECK FAILED: cache differs from unfused at byte 0 of" -- "$faulty" $bench decode_bf16 --tokens 1 --device 1
  case_ bench_device1 none:none 0 "^mlakv bench: cuda:1 " "^decode_bf16  *1 " \
    -- "$faulty" $bench decode_bf16 --tokens 1 --device 1
else
  echo "skip    the cuda:1 cases ($gpus visible GPU)"
fi

[ $failed -eq 0 ] && echo "cuda_faults.sh: all cases passed"
exit $failed
