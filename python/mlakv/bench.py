"""Benchmark of the decode step: fused op vs unfused primitives vs torch.compile vs a plain copy.

    python -m mlakv.bench [--device cuda] [--config deepseek_v3_tp8] [--cache-format bf16]
                          [--tokens 1,4,16,64,256,1024,4096] [--plot bench.png] [--json out.json]

Every case does the decode-step work of one MLA layer for T tokens: RMSNorm of kv_c (unless
--no-norm), RoPE of k_pe and of q_pe, the cache write at T random slots, and q_out's rope part:

* fused:    one ``mla_rope_cache`` call; the absorb GEMM's output already lies in q_out.
* unfused:  rms_norm + rotary_embedding + concat_and_cache_mla + decode_q_concat, as engines run
            today (the concat copies the nope part again).
* compile:  ``torch.compile`` of the same step written in plain PyTorch (raw and per-tensor fp8
            caches; fp32 math without fma, so its bytes may differ in the last bit).
* copy:     a device-to-device copy of the fused op's bytes (read + write), the roofline: the
            faster of torch's ``copy_`` and an elementwise kernel copying 32-bit words.

"bytes" is what the fused op must move (inputs read, cache entries and q_out's rope part written);
GB/s = bytes / time for every case, so the ratios compare times. On CUDA each timing replays a
CUDA graph of whole rotations over N sets of the step's tensors, at least ``--inner`` calls
(launch overhead excluded, as in a captured decode step); N x bytes > 200 MiB where 1024 sets
suffice, so that the inputs come from DRAM, not from L2 (as in ``mlakv bench``; the "sets"
column). The copy rotates over as many buffer pairs. On the CPU it loops over one set. Median
and spread (interquartile range, %) over ``--repeats`` timings. Every case must be capturable,
except the compile baseline, which is timed in eager launches where it is not (marked "e").
"""

import argparse
import json
import math
import statistics
import time

import torch

import mlakv
from mlakv import reference as ref
from mlakv.cache import (CACHE_FORMATS, DS_MLA_LATENT_DIM, DS_MLA_ROPE_DIM, canonical_format,
                         is_per_tensor_fp8)

ROTATION_BYTES = 200 << 20  # the sets a CUDA timing cycles through: more than an H200's 60 MB L2
MAX_SETS = 1024

CONFIGS = {
    "deepseek_v3": dict(H=128, L=512, R=64),
    "deepseek_v3_tp8": dict(H=16, L=512, R=64),
    "kimi_k2": dict(H=64, L=512, R=64),
    "deepseek_v2_lite": dict(H=16, L=512, R=64),
    "minicpm3": dict(H=40, L=256, R=32),
}


class Step:
    """Tensors of one decode step of T tokens."""

    def __init__(self, T, H, L, R, fmt, dtype, device, norm, seed=0, table=None):
        g = torch.Generator().manual_seed(seed)
        self.T, self.H, self.L, self.R, self.fmt, self.norm = T, H, L, R, fmt, norm
        block_size = 64
        num_blocks = max(4, (2 * T + block_size - 1) // block_size)
        rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)
        self.positions = torch.randint(0, 4096, (T,), generator=g).to(device)
        self.slots = torch.randperm(num_blocks * block_size, generator=g)[:T].to(device)
        self.table = (mlakv.yarn_cos_sin_cache(R, max_position=4096, device=device)
                      if table is None else table)
        self.kv_c, self.k_pe = rnd(T, L), rnd(T, R)
        self.weight = (1 + 0.1 * torch.randn(L, generator=g)).to(dtype).to(device)
        self.q_pe = rnd(T, H, R)
        self.q_out = rnd(T, H, L + R)
        self.cache = mlakv.allocate_cache(num_blocks, block_size, L, R, fmt, device=device)
        self.scale = (torch.tensor([0.05], device=device) if is_per_tensor_fp8(fmt) else None)
        # Unfused scratch.
        self.ql_nope = rnd(T, H, L)
        self.kv_normed = torch.empty_like(self.kv_c)
        self.k_rot, self.q_rot = self.k_pe.clone(), self.q_pe.clone()
        elem = self.kv_c.element_size()
        entry = mlakv.cache_entry_bytes(fmt, L, R)
        index = self.positions.element_size() + self.slots.element_size()
        self.bytes = T * ((L + R + H * R) * elem + H * R * elem + entry + index
                          + R * self.table.element_size())
        if norm:
            self.bytes += L * elem

    def fused(self):
        mlakv.mla_rope_cache(self.positions, self.slots, self.table, self.kv_c, self.k_pe,
                             self.cache, cache_format=self.fmt, kv_cache_scale=self.scale,
                             kv_norm_weight=self.weight if self.norm else None, q_pe=self.q_pe,
                             q_out=self.q_out, num_decode_tokens=self.T)

    def unfused(self):
        # RoPE in place on k_rot / q_rot, as an engine rotates its projections' outputs; repeated
        # calls keep rotating the same tensors (a rotation keeps their magnitudes), so no copy
        # restores them: the four launches are the engine's.
        kv_c = self.kv_c
        if self.norm:
            kv_c = mlakv.rms_norm(self.kv_c, self.weight, out=self.kv_normed)
        mlakv.rotary_embedding(self.positions, self.q_rot, self.k_rot.view(self.T, 1, self.R),
                               self.table)
        mlakv.concat_and_cache_mla(kv_c, self.k_rot, self.cache, self.slots,
                                   cache_format=self.fmt, kv_cache_scale=self.scale)
        mlakv.decode_q_concat(self.ql_nope, self.q_rot, self.q_out)

    def torch_args(self):
        """The tensors of torch_step, which torch.compile is timed on."""
        return (self.positions, self.slots, self.table, self.kv_c, self.k_pe,
                self.cache.view(mlakv.cache_latent_dtype(self.fmt)), self.q_pe, self.q_out,
                self.weight if self.norm else None, self.scale)


def torch_step(positions, slots, table, kv_c, k_pe, cache, q_pe, q_out, weight, scale):
    """The plain-PyTorch decode step (Step.torch_args), compiled once for all of a row's sets."""
    if weight is not None:
        x = kv_c.float()
        kv_c = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
                * weight.float()).to(kv_c.dtype)
    ref.torch_mla_rope_cache_decode(positions, slots, table, kv_c, k_pe, cache, q_pe, q_out,
                                    kv_cache_scale=scale)


def num_sets(nbytes, device, rotation_bytes=ROTATION_BYTES):
    """Sets of nbytes a timing rotates over: enough to pass rotation_bytes, at most MAX_SETS (1 on
    the CPU)."""
    if device != "cuda":
        return 1
    return max(1, min(MAX_SETS, math.ceil(rotation_bytes / max(nbytes, 1))))


def graph_call_times(calls, replays, lead=1):
    """Seconds per call, one value per replay: `calls` (zero-argument callables) captured in order
    in one CUDA graph, after `lead` untimed calls (the list's last ones), with the two timing
    events recorded inside the graph (external events). Each replay starts after the host's wait
    for the previous one; the lead calls take up that start, so the times are the calls' own, as
    in an engine's graph (``mlakv bench`` reaches the same by back-to-back replays). Raises where
    the calls cannot be captured."""
    current = torch.cuda.current_stream()
    stream = torch.cuda.Stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        for call in calls:  # warm-up (and torch.compile) outside the capture
            call()
    current.wait_stream(stream)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True, external=True)
    end = torch.cuda.Event(enable_timing=True, external=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls[len(calls) - lead:]:
            call()
        start.record()
        for call in calls:
            call()
        end.record()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        graph.replay()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / len(calls))
    return times


def _timeit(fns, device, inner, repeats, eager_fallback=False):
    """Median and IQR spread (%) of the time of one call, in microseconds, and whether it was timed
    in eager launches: whole rotations over `fns` (one call per set), at least `inner` calls a
    timing. On CUDA a call that cannot be captured raises, unless `eager_fallback`."""
    calls = fns * math.ceil(inner / len(fns))
    eager = device != "cuda"
    if device == "cuda":
        try:
            times = [t * 1e6 for t in graph_call_times(calls, repeats)]
        except Exception:
            if not eager_fallback:
                raise
            eager = True
    if eager:
        for fn in fns:
            fn()
        times = []
        for _ in range(repeats):
            if device == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for fn in calls:
                    fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / len(calls))
            else:
                t0 = time.perf_counter()
                for fn in calls:
                    fn()
                times.append((time.perf_counter() - t0) * 1e6 / len(calls))
    times.sort()
    med = statistics.median(times)
    q1, q3 = times[len(times) // 4], times[(3 * len(times)) // 4]
    return med, 100.0 * (q3 - q1) / med if med > 0 else 0.0, eager and device == "cuda"


def copy_fns(src, dst):
    """Two copies of src's bytes into dst (uint8 tensors, a multiple of 4 bytes): torch's copy_ (a
    cudaMemcpyAsync on CUDA) and an elementwise kernel over 32-bit words (bitwise_or with 0). The
    benches take the faster: on the H200 cudaMemcpyAsync runs at 2.7 or 4.2 TB/s depending on the
    size, a streaming kernel does not (``mlakv bench`` does the same with its copy kernel)."""
    s32, d32 = src.view(torch.int32), dst.view(torch.int32)
    return (lambda: dst.copy_(src)), (lambda: torch.bitwise_or(s32, 0, out=d32))


def _copy_buffers(nbytes, device):
    """Source and destination of a copy moving nbytes (read + written), 16-byte multiples."""
    half = max(16, (nbytes // 2 + 15) // 16 * 16)
    src = torch.zeros(half, dtype=torch.uint8, device=device)
    return src, torch.empty_like(src)


def time_copy(nbytes, device, inner, repeats, sets=1):
    """(median us, spread %) of the faster of copy_fns for a copy moving nbytes, rotating over
    `sets` buffer pairs."""
    pairs = [_copy_buffers(nbytes, device) for _ in range(sets)]
    return min((_timeit([copy_fns(*pair)[k] for pair in pairs], device, inner, repeats)[:2]
                for k in range(2)), key=lambda t: t[0])


def copy_bandwidth(device, nbytes):
    us, _ = time_copy(nbytes, device, inner=5, repeats=5)
    return nbytes / (us * 1e-6) / 1e9


def run(args):
    device = args.device
    cfg = CONFIGS[args.config]
    fmt = canonical_format(args.cache_format)
    dtype = getattr(torch, args.dtype)
    peak = copy_bandwidth(device, args.peak_bytes)
    rows = []
    compiled_ok = fmt != "fp8_ds_mla" and not args.no_compile
    table = mlakv.yarn_cos_sin_cache(cfg["R"], max_position=4096, device=device)
    for T in args.tokens:
        first = Step(T, cfg["H"], cfg["L"], cfg["R"], fmt, dtype, device, not args.no_norm,
                     table=table)
        n = num_sets(first.bytes, device)
        steps = [first] + [Step(T, cfg["H"], cfg["L"], cfg["R"], fmt, dtype, device,
                                not args.no_norm, seed=i, table=table) for i in range(1, n)]
        row = {"T": T, "bytes": first.bytes, "sets": n}
        row["fused_us"], row["fused_spread"], _ = _timeit([s.fused for s in steps], device,
                                                          args.inner, args.repeats)
        row["unfused_us"], row["unfused_spread"], _ = _timeit([s.unfused for s in steps], device,
                                                              args.inner, args.repeats)
        if compiled_ok:
            torch._dynamo.reset()
            compiled = torch.compile(torch_step, dynamic=False)
            calls = [lambda a=s.torch_args(): compiled(*a) for s in steps]
            row["compile_us"], row["compile_spread"], row["compile_eager"] = _timeit(
                calls, device, args.inner, args.repeats, eager_fallback=True)
        row["copy_us"], row["copy_spread"] = time_copy(first.bytes, device, args.inner,
                                                       args.repeats, sets=n)
        del steps, first
        for k in ("fused", "unfused", "compile", "copy"):
            if f"{k}_us" in row:
                row[f"{k}_gbps"] = row["bytes"] / (row[f"{k}_us"] * 1e-6) / 1e9
        rows.append(row)
        print_row(row, peak, header=len(rows) == 1, args=args, fmt=fmt)
    return {"device": _device_name(device), "config": args.config, "cache_format": fmt,
            "dtype": args.dtype, "norm": not args.no_norm, "copy_peak_gbps": peak, "rows": rows}


def _device_name(device):
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({torch.get_num_threads()} threads)"


def print_row(row, peak, header, args, fmt):
    cols = ("T", "fused us", "+-%", "unfused us", "compile us", "copy us", "bytes", "fused GB/s",
            "% copy peak", "unfused/fused", "compile/fused", "sets")
    widths = (6, 10, 5, 11, 11, 9, 11, 11, 12, 14, 14, 5)
    if header:
        print(f"# mlakv decode step: {args.config}, cache {fmt}, {args.dtype}, "
              f"norm {'off' if args.no_norm else 'on'}, {_device_name(args.device)}; "
              f"copy peak {peak:.0f} GB/s")
        print(" ".join(c.rjust(w) for c, w in zip(cols, widths)))
    comp = row.get("compile_us")
    comp_text = f"{comp:.2f}{'e' if row.get('compile_eager') else ''}" if comp else "n/a"
    vals = (str(row["T"]), f"{row['fused_us']:.2f}", f"{row['fused_spread']:.0f}",
            f"{row['unfused_us']:.2f}", comp_text,
            f"{row['copy_us']:.2f}", str(row["bytes"]), f"{row['fused_gbps']:.1f}",
            f"{100 * row['fused_gbps'] / peak:.1f}",
            f"{row['unfused_us'] / row['fused_us']:.2f}",
            f"{comp / row['fused_us']:.2f}" if comp else "n/a", str(row["sets"]))
    print(" ".join(v.rjust(w) for v, w in zip(vals, widths)), flush=True)


def plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    rows = result["rows"]
    T = [r["T"] for r in rows]
    fig, (ax_us, ax_bw) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label in (("fused", "mlakv fused"), ("unfused", "unfused primitives"),
                       ("compile", "torch.compile"), ("copy", "copy of the same bytes")):
        if f"{key}_us" not in rows[0]:
            continue
        ax_us.plot(T, [r[f"{key}_us"] for r in rows], marker="o", label=label)
        ax_bw.plot(T, [r[f"{key}_gbps"] for r in rows], marker="o", label=label)
    ax_bw.axhline(result["copy_peak_gbps"], color="gray", linestyle="--", label="copy peak")
    for ax, ylabel in ((ax_us, "time per step (us)"), (ax_bw, "GB/s (fused op's bytes)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens T")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_us.set_yscale("log")
    fig.suptitle(f"mlakv decode step, {result['config']}, cache {result['cache_format']}, "
                 f"{result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def _positive_int(text):
    """argparse type of the counts: an int >= 1 (argparse names the option when this raises)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _token_counts(text):
    """argparse type of --tokens: comma-separated counts >= 1, as a list."""
    return [_positive_int(t) for t in text.split(",")]


def _check_cache_format(parser, args):
    """fp8_ds_mla's own rules (L = 512, R = 64, a bfloat16 model), refused by option name before
    anything runs, not half way through with a traceback."""
    if args.cache_format != "fp8_ds_mla":
        return
    shape = CONFIGS[args.config]
    if (shape["L"], shape["R"]) != (DS_MLA_LATENT_DIM, DS_MLA_ROPE_DIM):
        parser.error(f"--cache-format fp8_ds_mla: expected a config with L = "
                     f"{DS_MLA_LATENT_DIM}, R = {DS_MLA_ROPE_DIM}, got --config {args.config} "
                     f"(L = {shape['L']}, R = {shape['R']})")
    if args.dtype != "bfloat16":
        parser.error(f"--cache-format fp8_ds_mla: expected --dtype bfloat16, got {args.dtype}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda (the current GPU) or cuda:N")
    p.add_argument("--config", default="deepseek_v3_tp8", choices=sorted(CONFIGS))
    p.add_argument("--cache-format", default="bf16", choices=[*CACHE_FORMATS, "fp8"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tokens", type=_token_counts, default=None, help="comma-separated T values")
    p.add_argument("--no-norm", action="store_true", help="leave kv_a_layernorm out")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--inner", type=_positive_int, default=None, help="calls per timing")
    p.add_argument("--repeats", type=_positive_int, default=None, help="timings per case")
    p.add_argument("--peak-bytes", type=_positive_int, default=None,
                   help="bytes of the peak-copy probe")
    p.add_argument("--plot", default="mlakv_bench.png", help="PNG path ('' for none)")
    p.add_argument("--json", default="", help="write the results as JSON here")
    args = p.parse_args(argv)
    _check_cache_format(p, args)
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        p.error(f"--device: {e}")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device: expected cpu, cuda or cuda:N, got {args.device}")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # the graphs, events and copy probe run on the current GPU
    args.device = device.type
    gpu = args.device == "cuda"
    if args.tokens is None:
        args.tokens = [1, 4, 16, 64, 256, 1024, 4096, 16384] if gpu else [1, 4, 16, 64, 256]
    args.inner = args.inner or (20 if gpu else 5)
    args.repeats = args.repeats or (15 if gpu else 5)
    args.peak_bytes = args.peak_bytes or ((1 << 30) if gpu else (64 << 20))
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
