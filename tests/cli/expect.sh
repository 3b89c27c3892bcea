#!/bin/sh
# mlakv tests: run a command of the `mlakv` tool and hold it to its exit status and its output.
#   expect.sh STATUS PATTERN... -- COMMAND [ARG...]
# Passes when COMMAND exits with STATUS and its output (stdout and stderr together) matches every
# PATTERN (grep basic regular expression). Prints the output, then what was missing.
want=$1
shift
patterns=""
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  patterns="$patterns$1
"
  shift
done
[ "$1" = "--" ] || { echo "expect.sh: no -- before the command"; exit 2; }
shift
out=$("$@" 2>&1)
rc=$?
echo "$out"
ok=0
if [ "$rc" -ne "$want" ]; then
  echo "expect.sh: exit status $rc, expected $want"
  ok=1
fi
printf '%s' "$patterns" | {
  missing=0
  while IFS= read -r p; do
    if ! printf '%s\n' "$out" | grep -q -- "$p"; then
      echo "expect.sh: no line matches: $p"
      missing=1
    fi
  done
  exit $missing
} || ok=1
exit $ok
