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
expect="sh $(dirname "$0")/expect.sh"
if ! "$faulty" info 2>&1 | grep -q "^  cuda: built, [1-9][0-9]* visible device"; then
  echo "cuda_faults.sh: no CUDA device visible to $faulty: skipped"
  exit 77
fi

failed=0
# case NAME FAULT STATUS PATTERN... -- ARG...: one run of the faulty tool, held by expect.sh.
case_() {
  name=$1 fault=$2
  shift 2
  if out=$(MLAKV_FAULT=$fault $expect "$@" </dev/null 2>&1); then
    echo "ok      $name"
  else
    echo "FAILED  $name (MLAKV_FAULT=$fault)"
    printf '%s\n' "$out" | sed 's/^/        /'
    failed=1
  fi
}

# check --backend cuda: 10 cases (2 seeds x 5 configs) against the host reference.
all_fail="summary: 10 comparisons, 10 mismatches: FAIL"
check="-- $faulty check --backend cuda --seeds 2"
case_ check_cache_first mla_rope_cache:kv_cache 1 "$all_fail" "cuda 0/2 ok .*FAIL$" \
  "MISMATCH cuda vs reference: seed .*: kv_cache: byte 0 of" $check
case_ check_cache_last mla_rope_cache:kv_cache:last 1 "$all_fail" \
  "MISMATCH cuda vs reference: seed .*: kv_cache: byte [1-9]" $check
case_ check_counter mla_rope_cache:counter 1 "$all_fail" \
  "MISMATCH cuda vs reference: seed .*: error counter .*: 1 vs reference 0" $check
case_ check_device_td mla_rope_cache:num_decode_tokens_device 1 \
  "summary: 10 comparisons, [1-9] mismatches: FAIL" "Td (device): byte 0 of" $check
case_ check_throws mla_rope_cache:throw 1 "$all_fail" "threw: .*throws as asked" $check

# check --backend all: a fault in the CUDA run alone (@cuda) must also fail cuda == cpu, while
# the CPU run passes.
both="-- $faulty check --backend all --seeds 2"
case_ check_cuda_vs_cpu mla_rope_cache@cuda:kv_cache 1 \
  "summary: 30 comparisons, 20 mismatches: FAIL" "cpu 2/2 ok  cuda 0/2 ok  cuda==cpu 0/2" \
  "MISMATCH cuda vs cpu: seed .*: kv_cache: byte 0 of" $both
case_ check_cuda_vs_cpu_counter mla_rope_cache@cuda:counter 1 \
  "summary: 30 comparisons, 20 mismatches: FAIL" \
  "MISMATCH cuda vs cpu: seed .*: error counter .*: 1 vs cpu 0" $both
case_ check_all_pass none:none 0 "summary: 30 comparisons, 0 mismatches: PASS" $both

# bench --backend cuda: the check before timing names the first difference and the run exits 2.
# One case a line: name|fault|workload and tokens|message.
bench="$faulty bench --backend cuda --iters 1 --workload"
while IFS='|' read -r name fault args msg; do
  # $bench and $args split into words on purpose.
  case_ "bench_$name" "$fault" 2 "CHECK FAILED: $msg" -- $bench $args
done <<'CASES'
unfused_cache_first|concat_and_cache_mla:kv_cache|decode_bf16 --tokens 1|cache differs from unfused at byte 0 of
unfused_not_run|concat_and_cache_mla:skip|decode_bf16 --tokens 1|cache differs from unfused
unfused_q_out_last|decode_q_concat:q_out:last|decode_fp8 --tokens 2|q_out differs from unfused
unfused_q_last_row|rotary_embedding:query:last|mixed_bf16 --tokens 3|q (prefill rows) differs from unfused
fused_input|mla_rope_cache:q_pe:last|decode_bf16 --tokens 1|q_pe differs from its upload
reference_cache|ref.mla_rope_cache:kv_cache|decode_bf16 --tokens 1|cache differs from reference
norm_unfused_scales|per_token_group_quant_fp8:scales:last|rmsnorm_quant_qc --tokens 513|q_c scales differs from unfused
norm_unfused_kv_c_out|rms_norm:output:last|mla_rmsnorm_quant --tokens 1|kv_c_out differs from unfused
norm_fused_input|mla_rmsnorm_quant:kv_c:last|mla_rmsnorm_quant --tokens 1|kv_c differs from its upload
norm_reference_values|ref.rmsnorm_quant:values:last|rmsnorm_quant_qc --tokens 512|q_c values differs from reference
CASES
# The fused op's error counter, reported after the check's byte comparisons.
case_ bench_fused_counter mla_rope_cache:counter 2 "non-zero counters: bad_slot = 1" \
  -- $bench decode_bf16 --tokens 1
# --skip-check: the same fault, timed without complaint (and left alone inside the graph capture).
case_ bench_skip_check concat_and_cache_mla:kv_cache 0 "^decode_bf16  *1 " \
  -- $bench decode_bf16 --tokens 1 --skip-check

# --device: past the last GPU the commands refuse; with two GPUs, check and bench on cuda:1 (the
# current device stays cuda:0 in check) must still see a fault in the CUDA run alone.
case_ check_device_past_the_last none:none 2 "--device: expected a GPU index below" \
  -- $faulty check --backend cuda --seeds 1 --device 1023
case_ bench_device_past_the_last none:none 2 "--device: expected a GPU index below" \
  -- $bench decode_bf16 --tokens 1 --device 1023
gpus=$("$faulty" info 2>&1 | sed -nE 's/^  cuda: built, ([0-9]+) visible device.*/\1/p')
if [ "${gpus:-0}" -ge 2 ]; then
  case_ check_device1_cuda_vs_cpu mla_rope_cache@cuda:kv_cache 1 \
    "summary: 30 comparisons, 20 mismatches: FAIL" "cuda = cuda:1" \
    "MISMATCH cuda vs cpu: seed .*: kv_cache: byte 0 of" $both --device 1
  case_ check_device1_pass none:none 0 "summary: 30 comparisons, 0 mismatches: PASS" $both --device 1
  case_ bench_device1_unfused concat_and_cache_mla:kv_cache 2 \
    "CHECK FAILED: cache differs from unfused at byte 0 of" -- $bench decode_bf16 --tokens 1 --device 1
  case_ bench_device1 none:none 0 "^mlakv bench: cuda:1 " "^decode_bf16  *1 " \
    -- $bench decode_bf16 --tokens 1 --device 1
else
  echo "skip    the cuda:1 cases ($gpus visible GPU)"
fi

[ $failed -eq 0 ] && echo "cuda_faults.sh: all cases passed"
exit $failed
