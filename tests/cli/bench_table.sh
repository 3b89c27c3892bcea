#!/bin/sh
# mlakv tests: the arithmetic of `mlakv bench`'s table.
#   bench_table.sh COMMAND [ARG...]
# Runs the bench, prints its output and fails when it fails, or when a row's derived columns do
# not follow from the columns they come from, to the printed precision: GB/s = bytes / fused_us,
# %copy = copy_us / fused_us, speedup = unfused_us / fused_us.
# Row: workload T fused_us spread_us bytes unit GB/s %copy copy_us unfused_us speedup sets
out=$("$@" 2>&1)
rc=$?
echo "$out"
[ "$rc" -eq 0 ] || { echo "bench_table.sh: exit status $rc"; exit 1; }
printf '%s\n' "$out" | awk '
function unit(u) { return u == "B" ? 1 : u == "KB" ? 1e3 : u == "MB" ? 1e6 : u == "GB" ? 1e9 : 1e12 }
function near(got, want, abs_tol) {
  d = got - want; if (d < 0) d = -d
  return d <= 0.03 * (want < 0 ? -want : want) + abs_tol
}
NF == 12 && $2 ~ /^[0-9]+$/ && $11 ~ /x$/ {
  rows++
  fused = $3; bytes = $5 * unit($6); gbps = $7; pct = $8; copy = $9; unfused = $10
  speedup = $11; sub(/x$/, "", speedup); sub(/%$/, "", pct)
  if (!near(gbps, bytes / (fused * 1e3), 0.06)) { print "GB/s of: " $0; bad++ }
  if (!near(pct, 100 * copy / fused, 0.6)) { print "%copy of: " $0; bad++ }
  if (!near(speedup, unfused / fused, 0.006)) { print "speedup of: " $0; bad++ }
}
END {
  if (rows == 0) { print "bench_table.sh: no rows"; exit 1 }
  print "bench_table.sh: " rows " rows, " bad + 0 " wrong"
  exit bad > 0
}'
