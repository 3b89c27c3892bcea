#!/usr/bin/env bash
# Run 151 (docs/perf-notes.md, thirty-seventh session): K items of two tokens, k_two_tokens.patch,
# on one GPU in one call: the whole suite and `mlakv check`, an A/B round against main's library,
# both CUDA sanitizers over the new tests, a second A/B round, the small-T rows. Every result is
# written under $OUT as it comes, so a call cut short still returns what ran.
#
# Before the call, on a machine with nvcc (the GPU machine has no googletest; building here saves
# its minutes), from the repository root:
#   cmake -S . -B build-base -DCMAKE_BUILD_TYPE=Release -DMLAKV_CUDA=ON -DMLAKV_TESTS=OFF \
#     '-DMLAKV_CUDA_GENCODE=-gencode=arch=compute_90a,code=sm_90a'
#   cmake --build build-base --target mlakv_cli              # main's library: binbase
#   git apply scripts/experiments/k_two_tokens.patch
#   cmake -S . -B build-exp -DCMAKE_BUILD_TYPE=Release -DMLAKV_CUDA=ON \
#     '-DMLAKV_CUDA_GENCODE=-gencode=arch=compute_90a,code=sm_90a'
#   cmake --build build-exp --target mlakv_tests mlakv_cli   # the patched tree: bin151
#   then pack each (the binaries, stripped, with /usr/lib/x86_64-linux-gnu/libgomp.so.1) into
#   .deps/binbase.txz and .deps/bin151.txz (tar cJf), and run
#   `bash scripts/experiments/k_two_tokens_run.sh` with .deps carried.
set -uo pipefail
cd "$(dirname "$0")/../.."
B=/tmp/b151; A=/tmp/bbase
mkdir -p $B $A
tar xJf .deps/bin151.txz -C $B && tar xJf .deps/binbase.txz -C $A
export LD_LIBRARY_PATH=$B
S=$OUT/summary.txt
{ nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv; } >"$S" 2>&1
START=$SECONDS
PREBUILT=$B BUILD_DIR=/tmp/g151 OUT=/tmp/g151out LOGS=/tmp/g151logs STAGE_TIMEOUT=200 \
  bash scripts/gpu_run.sh build test check >/tmp/gpu_run.log 2>&1
echo "gpu_run rc=$? in $((SECONDS-START)) s" >>"$S"
cat /tmp/g151logs/summary.txt >>"$S"
grep -E '^\[  FAILED|Failure' /tmp/g151logs/ctest.log | head -30 >>"$S"
ab() {  # label binary heads tokens workloads
  "$2/mlakv" bench --backend cuda --skip-check --heads "$3" --tokens "$4" \
    --workload "$5" >"$OUT/ab_$1.txt" 2>&1
}
round() {
  for b in base new; do
    bin=$A; [[ $b == new ]] && bin=$B
    ab "h16_${b}_r$1" $bin 16 2048,4096,8192,16384 \
      prefill_bf16,decode_nope_in_q_out,decode_bf16_norm
    ab "h128_${b}_r$1" $bin 128 4096,8192 prefill_bf16,decode_nope_in_q_out
  done
  echo "A/B round $1 done at $SECONDS s" >>"$S"
}
round 1
for tool in memcheck racecheck; do
  START=$SECONDS
  timeout 120 compute-sanitizer --tool $tool --error-exitcode 1 --print-limit 10 $B/mlakv_tests \
    --gtest_filter='*TwoTokenK*cuda*:CudaFusedKernelChoice.*' --gtest_brief=1 >/tmp/$tool.log 2>&1
  echo "$tool rc=$? in $((SECONDS-START)) s" >>"$S"
  grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|tests? ran|PASSED|FAILED' /tmp/$tool.log | tail -6 >>"$S"
done
round 2
for b in base new; do
  bin=$A; [[ $b == new ]] && bin=$B
  "$bin/mlakv" bench --backend cuda --skip-check --tokens 1,32 \
    --workload decode_bf16,prefill_bf16 >"$OUT/small_$b.txt" 2>&1
done
echo "done in $SECONDS s" >>"$S"
