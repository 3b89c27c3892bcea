#!/usr/bin/env python3
"""Compiles every C++ source of a configured build once more with clang++, syntax only, with the
project's warnings as errors: GCC accepts some code that C++17 does not (a lambda capturing a
structured binding, for one), and clang holds to the standard there.

    python3 scripts/clang_check.py BUILD_DIR [--jobs N]

BUILD_DIR needs its compile_commands.json (CMakeLists.txt exports it). Each .cpp entry's command
runs with clang++ in place of the compiler, its output file dropped, and -fsyntax-only -Werror
added. .cu files are nvcc's and are skipped. Exits 1 when any file fails, printing its messages.
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor


def clang_command(entry, clang):
    args = shlex.split(entry["command"]) if "command" in entry else list(entry["arguments"])
    out = [clang]
    rest = iter(args[1:])
    for a in rest:
        if a == "-o":
            next(rest, None)  # the object file
        elif a != "-c":
            out.append(a)
    # GCC-only warning names in the flags are not errors.
    return out + ["-fsyntax-only", "-Werror", "-Wno-unknown-warning-option"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build_dir")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    opts = parser.parse_args()
    clang = shutil.which("clang++")
    if clang is None:
        sys.exit("clang_check: clang++ not found")
    with open(os.path.join(opts.build_dir, "compile_commands.json")) as f:
        entries = [e for e in json.load(f) if e["file"].endswith(".cpp")]
    # A source compiled for two targets is checked once.
    entries = list({e["file"]: e for e in entries}.values())
    if not entries:
        sys.exit("clang_check: no .cpp entries in the compile database")

    def check(entry):
        r = subprocess.run(clang_command(entry, clang), cwd=entry["directory"],
                           capture_output=True, text=True)
        return entry["file"], r.returncode, r.stdout + r.stderr

    failed = 0
    with ThreadPoolExecutor(max(1, opts.jobs)) as pool:
        for path, rc, messages in pool.map(check, sorted(entries, key=lambda e: e["file"])):
            if rc != 0:
                failed += 1
                print(f"clang_check: {path} failed (exit {rc}):\n{messages}")
    print(f"clang_check: {len(entries)} files, {failed} failed ({clang})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
