#!/usr/bin/env python3
"""Benchmark of RMSNorm + FP8 per-token-group quantization on CUDA (torch.ops.mlakv).

For every workload and token count T, one table row per implementation: median time per call,
spread (p10..p90), bytes moved, GB/s, % of copy (the time of a device-to-device copy of the same
number of bytes, read + written, over the row's time: the roofline at that size, DESIGN.md), and
the time of that row over the first (fused) row. Calls are captured in a CUDA graph (as engines run them),
whole rotations over buffer sets of more than 256 MiB where 1024 sets suffice, so the times are the
kernels' own, from DRAM; the smallest rows (q_c, dual and mla_k at T = 1 and 8, whose 1024 sets
hold less than about 64 MB) partly run from L2. The copy of a row rotates the same way.

Workloads (DeepSeek-V3 shapes):
  q_c        x [T, 1536] bf16 -> e4m3 + scales (G = 128): q_a_layernorm before q_b_proj
  hidden     x [T, 7168] bf16 + residual -> e4m3 + scales: a decoder layer's input norm
  dual       q_c [T, 1536] -> e4m3 + scales and kv_c [T, 512] -> bf16: the MLA layer's two norms
  mla_k      the K side of a layer, two ways (docs/rmsnorm_quant.md says which to use):
               dual+rope: mla_rmsnorm_quant, then mla_rope_cache on the normalized kv_c;
               q+fused:   rmsnorm_quant on q_c, then mla_rope_cache with kv_a_layernorm fused in.
Implementations: "fused" (mlakv's one-pass op), "mlakv 2-step" (mlakv rms_norm, then
per_token_group_quant_fp8), "torch" (F.rms_norm + a per-token-group quant in eager PyTorch) and
"torch.compile" of the same (with --torch-compile: one compilation per T, minutes in all).

Usage: python scripts/bench_rmsnorm_quant.py [--tokens 1 16 ...] [--workloads q_c dual ...]
       [--json out.json]   (MLAKV_TORCH_LIBRARY=<build>/torch/_C.so for a CMake build tree)
"""

import argparse
import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F

import mlakv
from mlakv import bench
from mlakv.bench import copy_bandwidth, graph_call_times, time_copy

_ops = torch.ops.mlakv
G = 128
E4M3_MAX = 448.0
ROTATION_BYTES = 256 << 20  # buffer sets cycled through per graph: more than the 60 MB of L2


def num_sets(bytes_per_set):
    return bench.num_sets(bytes_per_set, "cuda", ROTATION_BYTES)


# ---- timing ------------------------------------------------------------------------------------
def time_calls(make_call, num_sets, min_calls=20, replays=15):
    """Seconds per call (median, p10, p90): whole rotations over the `num_sets` buffer sets, at
    least `min_calls` calls, captured in one CUDA graph and timed inside it
    (mlakv.bench.graph_call_times), one value per replay."""
    calls = [make_call(i) for i in range(num_sets)]
    per_call = sorted(graph_call_times(calls * math.ceil(min_calls / num_sets), replays))
    q = lambda f: per_call[min(len(per_call) - 1, int(f * len(per_call)))]
    return statistics.median(per_call), q(0.1), q(0.9)


# ---- baselines ---------------------------------------------------------------------------------
def torch_group_quant(y, out, scales):
    """Per-token-group quant in PyTorch (vLLM's formula: max(amax, 1e-10) / 448)."""
    T, N = y.shape
    v = y.view(T, N // G, G).float()
    s = v.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / E4M3_MAX
    out.copy_((v / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(T, N))
    scales.copy_(s.squeeze(-1))


def torch_rmsnorm_quant(x, w, eps, out, scales, residual=None):
    if residual is not None:
        residual.add_(x)
        x = residual
    torch_group_quant(F.rms_norm(x, (x.shape[1],), w, eps), out, scales)


# ---- workloads ---------------------------------------------------------------------------------
def rnd(shape, device, scale=1.0):
    return (torch.randn(shape, device=device) * scale).to(torch.bfloat16)


def q_sets(T, N, device, residual):
    bytes_per_set = T * N * (2 + 1 + 2 + (4 if residual else 0)) + T * (N // G) * 4
    sets = []
    for _ in range(num_sets(bytes_per_set)):
        sets.append(dict(
            x=rnd((T, N), device, 2.0), res=rnd((T, N), device) if residual else None,
            out=torch.empty(T, N, dtype=torch.float8_e4m3fn, device=device),
            scales=torch.empty(T, N // G, dtype=torch.float32, device=device),
            normed=torch.empty(T, N, dtype=torch.bfloat16, device=device)))
    return sets


def workload_norm_quant(T, N, residual, device, compile_torch):
    w = (1.0 + 0.1 * torch.randn(N, device=device)).to(torch.bfloat16)
    sets = q_sets(T, N, device, residual)
    # read x (+ residual), write e4m3 + scales (+ residual)
    moved = T * N * 2 + T * N + T * (N // G) * 4 + N * 2 + (2 * T * N * 2 if residual else 0)
    impls = {
        "fused": lambda s: lambda: _ops.rmsnorm_quant(s["x"], w, 1e-6, s["out"], s["scales"],
                                                      residual=s["res"]),
    }
    if not residual:
        impls["mlakv 2-step"] = lambda s: lambda: (
            _ops.rms_norm(s["normed"], s["x"], w, 1e-6),
            _ops.per_token_group_quant_fp8(s["normed"], s["out"], s["scales"]))
    impls["torch"] = lambda s: lambda: torch_rmsnorm_quant(s["x"], w, 1e-6, s["out"], s["scales"],
                                                           s["res"])
    if compile_torch:
        compiled = torch.compile(torch_rmsnorm_quant, dynamic=False)
        impls["torch.compile"] = lambda s: lambda: compiled(s["x"], w, 1e-6, s["out"],
                                                            s["scales"], s["res"])
    return sets, moved, impls


def workload_dual(T, device, compile_torch):
    qw = (1.0 + 0.1 * torch.randn(1536, device=device)).to(torch.bfloat16)
    kvw = (1.0 + 0.1 * torch.randn(512, device=device)).to(torch.bfloat16)
    sets = q_sets(T, 1536, device, False)
    for s in sets:
        s["kv"] = rnd((T, 512), device, 2.0)
        s["kv_out"] = torch.empty(T, 512, dtype=torch.bfloat16, device=device)
    moved = T * 1536 * (2 + 1) + T * 12 * 4 + T * 512 * 4 + (1536 + 512) * 2
    impls = {
        "fused": lambda s: lambda: _ops.mla_rmsnorm_quant(
            s["x"], qw, 1e-6, s["out"], s["scales"], s["kv"], kvw, 1e-6, s["kv_out"]),
        "mlakv 2-op": lambda s: lambda: (
            _ops.rmsnorm_quant(s["x"], qw, 1e-6, s["out"], s["scales"]),
            _ops.rms_norm(s["kv_out"], s["kv"], kvw, 1e-6)),
        "mlakv 3-step": lambda s: lambda: (
            _ops.rms_norm(s["normed"], s["x"], qw, 1e-6),
            _ops.per_token_group_quant_fp8(s["normed"], s["out"], s["scales"]),
            _ops.rms_norm(s["kv_out"], s["kv"], kvw, 1e-6)),
    }

    def torch_dual(x, kv, out, scales, kv_out):
        torch_rmsnorm_quant(x, qw, 1e-6, out, scales)
        kv_out.copy_(F.rms_norm(kv, (512,), kvw, 1e-6))

    impls["torch"] = lambda s: lambda: torch_dual(s["x"], s["kv"], s["out"], s["scales"],
                                                  s["kv_out"])
    if compile_torch:
        compiled = torch.compile(torch_dual, dynamic=False)
        impls["torch.compile"] = lambda s: lambda: compiled(s["x"], s["kv"], s["out"], s["scales"],
                                                            s["kv_out"])
    return sets, moved, impls


def workload_mla_k(T, device, compile_torch):
    """The two ways to run kv_a_layernorm: in the dual norm op, or inside mla_rope_cache."""
    L, R, block_size = 512, 64, 64
    qw = (1.0 + 0.1 * torch.randn(1536, device=device)).to(torch.bfloat16)
    kvw = (1.0 + 0.1 * torch.randn(L, device=device)).to(torch.bfloat16)
    cos_sin = mlakv.rope_cos_sin_cache(R, max(T, 1) + 1, device=device)
    num_blocks = T // block_size + 2
    sets = q_sets(T, 1536, device, False)
    for s in sets:
        s["kv"] = rnd((T, L), device, 2.0)
        s["kv_out"] = torch.empty(T, L, dtype=torch.bfloat16, device=device)
        s["k_pe"] = rnd((T, R), device)
        s["pos"] = torch.arange(T, device=device)
        s["slots"] = torch.arange(T, device=device)
        s["cache"] = mlakv.allocate_cache(num_blocks, block_size, L, R, "bf16", device=device)
    # q_c read + e4m3 + scales; kv_c, k_pe, positions and slots (int64) read; cache entry and
    # normalized kv_c written; the weights. The cos/sin row is left out, as in `mlakv bench`.
    moved = (T * 1536 * 3 + T * 48 + T * (L + R) * 2 + T * 16 + T * (L + R) * 2 + T * L * 2
             + (1536 + L) * 2)

    def rope(s, kv, norm):
        mlakv.mla_rope_cache(s["pos"], s["slots"], cos_sin, kv, s["k_pe"], s["cache"],
                             cache_format="bf16", kv_norm_weight=kvw if norm else None,
                             kv_c_out=s["kv_out"] if norm else None)

    impls = {
        "q+fused": lambda s: lambda: (
            _ops.rmsnorm_quant(s["x"], qw, 1e-6, s["out"], s["scales"]), rope(s, s["kv"], True)),
        "dual+rope": lambda s: lambda: (
            _ops.mla_rmsnorm_quant(s["x"], qw, 1e-6, s["out"], s["scales"], s["kv"], kvw, 1e-6,
                                   s["kv_out"]),
            rope(s, s["kv_out"], False)),
    }
    return sets, moved, impls


def check_equal(sets, impls, keys):
    """The implementations agree: bytes of `keys` after each, from the same inputs."""
    ref = None
    for name, make in impls.items():
        if name.startswith("torch"):
            continue  # different numerics (F.rms_norm's sum order)
        s = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sets[0].items()}
        make(s)()
        got = [s[k].view(torch.uint8).clone() for k in keys]
        if ref is None:
            ref = (name, got)
        else:
            for k, a, b in zip(keys, ref[1], got):
                if not torch.equal(a, b):
                    sys.exit(f"check failed: {name} differs from {ref[0]} in {k}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="*",
                        default=[1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--workloads", nargs="*", default=["q_c", "hidden", "dual", "mla_k"])
    parser.add_argument("--torch-compile", action="store_true",
                        help="add torch.compile baselines (compiles once per workload and T)")
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    bw = copy_bandwidth("cuda", 1 << 30) * 1e9
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s (read + write, "
          f"1 GiB); %copy below is against a copy of the same bytes")
    header = (f"{'workload':<8} {'T':>6} {'impl':<14} {'median_us':>10} {'p10..p90_us':>15} "
              f"{'MB':>8} {'GB/s':>7} {'%copy':>6} {'x_fused':>8}")
    print(header)
    rows = []
    for wl in args.workloads:
        for T in args.tokens:
            if wl == "q_c":
                sets, moved, impls = workload_norm_quant(T, 1536, False, device,
                                                         args.torch_compile)
                keys = ["out", "scales"]
            elif wl == "hidden":
                sets, moved, impls = workload_norm_quant(T, 7168, True, device,
                                                         args.torch_compile)
                keys = ["out", "scales", "res"]
            elif wl == "dual":
                sets, moved, impls = workload_dual(T, device, args.torch_compile)
                keys = ["out", "scales", "kv_out"]
            elif wl == "mla_k":
                sets, moved, impls = workload_mla_k(T, device, args.torch_compile)
                keys = ["out", "scales", "kv_out", "cache"]
            else:
                sys.exit(f"unknown workload {wl}")
            check_equal(sets, impls, keys)
            times = {}
            for name, make in impls.items():
                try:
                    times[name] = time_calls(lambda i: make(sets[i % len(sets)]), len(sets))
                except Exception as e:  # a torch baseline that cannot run here (torch.compile)
                    if not name.startswith("torch"):
                        raise  # mlakv's own ops must run (and be capturable)
                    print(f"{wl:<8} {T:>6} {name:<14} failed: {type(e).__name__}: {e}")
            first = next(iter(times.values()))[0] if times else float("nan")
            # A copy of `moved` bytes (moved / 2 read, moved / 2 written), rotated as the rows.
            copy_s = time_copy(moved, "cuda", 20, 15, sets=num_sets(moved))[0] * 1e-6
            for name, (med, p10, p90) in times.items():
                gbs = moved / med / 1e9
                row = dict(workload=wl, T=T, impl=name, median_us=med * 1e6, p10_us=p10 * 1e6,
                           p90_us=p90 * 1e6, bytes=moved, gb_s=gbs, copy_us=copy_s * 1e6,
                           pct_copy=100 * copy_s / med, vs_fused=med / first)
                rows.append(row)
                print(f"{wl:<8} {T:>6} {name:<14} {med * 1e6:>10.2f} "
                      f"{p10 * 1e6:>7.2f}..{p90 * 1e6:<7.2f} {moved / 1e6:>8.2f} {gbs:>7.0f} "
                      f"{row['pct_copy']:>6.1f} {med / first:>8.2f}")
            del sets
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_bw=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
