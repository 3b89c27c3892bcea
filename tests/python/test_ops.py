"""Every op of torch.ops.mlakv against mlakv.reference, over the named configs and cache formats."""

import contextlib
import ctypes
import math
import platform

import pytest
import torch

import mlakv
from mlakv import reference as ref

from conftest import (CONFIGS, FP8_FORMATS, SENTINEL, OpConfig, assert_bytes_equal,
                      call_mla, config_format_params, make_mla_inputs)

TP8 = CONFIGS[1]
MINICPM3 = CONFIGS[4]


# ---- the fused op ------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg,fmt", config_format_params())
def test_mla_rope_cache_matches_reference(cfg, fmt, device):
    """Mixed batch (decode rows, a padding slot, prefill rows), no RMSNorm: every byte exact."""
    x = make_mla_inputs(cfg, fmt, device=device)
    y = x.clone()
    call_mla(mlakv.mla_rope_cache, x, fmt, norm=False)
    call_mla(ref.mla_rope_cache, y, fmt, norm=False)
    assert_bytes_equal(x.kv_cache, y.kv_cache)
    assert_bytes_equal(x.q_out, y.q_out)
    assert_bytes_equal(x.q, y.q)
    assert_bytes_equal(x.k_pe_out, y.k_pe_out)
    assert_bytes_equal(x.kv_c_out, y.kv_c_out)


@pytest.mark.parametrize("fmt,top", [("fp8_e4m3", 0x7E), ("fp8_e5m2", 0x7B)])
def test_fp8_cache_saturates(fmt, top, device):
    """kv_c and k_pe far beyond the fp8 range (x 1e6): every written byte is the reference's, the
    largest finite codes appear, and no inf or NaN code does (saturating rounding)."""
    x = make_mla_inputs(TP8, fmt, device=device, seed=51)
    x.kv_c.mul_(1e6)
    x.k_pe.mul_(1e6)
    y = x.clone()
    call_mla(mlakv.mla_rope_cache, x, fmt, norm=False)
    call_mla(ref.mla_rope_cache, y, fmt, norm=False)
    assert_bytes_equal(x.kv_cache, y.kv_cache)
    entries = x.kv_cache.cpu().view(torch.uint8).reshape(-1, x.kv_cache.shape[-1])
    slots = x.slot_mapping.cpu()
    written = entries[slots[slots >= 0]] & 0x7F  # magnitudes
    assert bool((written == top).any()) and not bool((written > top).any())


def test_mla_rope_cache_ds_mla_pow2_scale(device):
    """The fused op's ds_mla_pow2_scale reaches the op: the reference's bytes with it, others
    without it."""
    caches = {}
    for pow2 in (False, True):
        x = make_mla_inputs(TP8, "fp8_ds_mla", device=device, seed=52)
        y = x.clone()
        call_mla(mlakv.mla_rope_cache, x, "fp8_ds_mla", norm=False, ds_mla_pow2_scale=pow2)
        call_mla(ref.mla_rope_cache, y, "fp8_ds_mla", norm=False, ds_mla_pow2_scale=pow2)
        assert_bytes_equal(x.kv_cache, y.kv_cache)
        caches[pow2] = x.kv_cache.cpu()
    assert not torch.equal(caches[False], caches[True])


@pytest.mark.parametrize("cfg,fmt", config_format_params())
def test_mla_rope_cache_with_norm_matches_reference(cfg, fmt, device):
    """With kv_a_layernorm fused in: the reference sums the squares in the library's order, so every
    byte matches, the normalized latent and its cache entries too."""
    x = make_mla_inputs(cfg, fmt, device=device, seed=1)
    y = x.clone()
    call_mla(mlakv.mla_rope_cache, x, fmt)
    call_mla(ref.mla_rope_cache, y, fmt)
    assert_bytes_equal(x.kv_c_out, y.kv_c_out)
    assert_bytes_equal(x.kv_cache, y.kv_cache)
    assert_bytes_equal(x.q_out, y.q_out)
    assert_bytes_equal(x.q, y.q)
    assert_bytes_equal(x.k_pe_out, y.k_pe_out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [False, True])
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
def test_mla_rope_cache_dtypes_and_styles(dtype, is_neox, table_dtype, device):
    cfg = MINICPM3
    for fmt in ["bf16", "fp32", "fp8_e4m3"]:
        x = make_mla_inputs(cfg, fmt, dtype=dtype, device=device, seed=2)
        x.cos_sin_cache = x.cos_sin_cache.to(table_dtype)
        y = x.clone()
        call_mla(mlakv.mla_rope_cache, x, fmt, norm=False, is_neox=is_neox)
        call_mla(ref.mla_rope_cache, y, fmt, norm=False, is_neox=is_neox)
        assert_bytes_equal(x.kv_cache, y.kv_cache)
        assert_bytes_equal(x.q_out, y.q_out)
        assert_bytes_equal(x.q, y.q)


@pytest.mark.parametrize("mode", ["decode", "prefill", "mixed"])
def test_mla_rope_cache_modes(mode, device):
    cfg = TP8
    T = 5
    Td = {"decode": T, "prefill": 0, "mixed": 3}[mode]
    fn = {"decode": mlakv.mla_rope_cache_decode, "prefill": mlakv.mla_rope_cache_prefill,
          "mixed": mlakv.mla_rope_cache_mixed}[mode]
    x = make_mla_inputs(cfg, "bf16", T=T, Td=Td, device=device)
    y = x.clone()
    call_mla(fn, x, "bf16", norm=False, decode=Td > 0, prefill=Td < T)
    call_mla(ref.mla_rope_cache, y, "bf16", norm=False, decode=Td > 0, prefill=Td < T)
    assert_bytes_equal(x.kv_cache, y.kv_cache)
    assert_bytes_equal(x.q_out, y.q_out)
    assert_bytes_equal(x.q, y.q)


def test_mla_rope_cache_fp8_q_out_and_prefill_out(device):
    cfg = TP8
    x = make_mla_inputs(cfg, "fp8_e4m3", device=device, seed=3)
    q_scale = torch.tensor([0.05], dtype=torch.float32, device=device)
    outs = []
    for fn, inp in ((mlakv.mla_rope_cache, x), (ref.mla_rope_cache, x.clone())):
        q_out = torch.zeros(inp.q_out.shape, dtype=torch.float8_e4m3fn, device=device)
        q_prefill_out = torch.zeros_like(inp.q)
        q_before = inp.q.clone()
        call_mla(fn, inp, "fp8_e4m3", q_out=q_out, q_scale=q_scale, q_prefill_out=q_prefill_out)
        assert torch.equal(inp.q, q_before), "q must stay untouched when q_prefill_out is given"
        outs.append((q_out, q_prefill_out, inp.kv_cache))
    for a, e in zip(*outs):
        assert_bytes_equal(a, e)


def test_mla_rope_cache_int32_indices_split_cache_and_views(device):
    """int32 positions / slots, a split (latent + rope) cache, and q_pe as a strided view of q."""
    cfg = MINICPM3
    x = make_mla_inputs(cfg, "bf16", device=device, seed=4)
    nb, bs = x.kv_cache.shape[:2]
    results = []
    for fn in (mlakv.mla_rope_cache, ref.mla_rope_cache):
        latent = torch.full((nb, bs, cfg.L), 1.5, dtype=torch.bfloat16, device=device)
        rope = torch.full((nb, bs, cfg.R), 2.5, dtype=torch.bfloat16, device=device)
        q_full = x.q.clone()
        q_out = x.q_out.clone()
        fn(x.positions.to(torch.int32), x.slot_mapping.to(torch.int32), x.cos_sin_cache,
           x.kv_c, x.k_pe, latent, cache_format="bf16", kv_cache_rope=rope,
           q_pe=q_full[:, :, cfg.P:], ql_nope=x.ql_nope, q_out=q_out, q=q_full,
           num_decode_tokens=x.Td)
        results.append((latent, rope, q_out, q_full))
    for a, e in zip(*results):
        assert_bytes_equal(a, e)


def test_mla_rope_cache_absorbed_nope_is_left_in_place(device):
    """ql_nope=None: the nope part already in q_out (written by the absorb GEMM) is kept."""
    cfg = TP8
    x = make_mla_inputs(cfg, "bf16", device=device, seed=5)
    x.q_out[:, :, :cfg.L] = x.ql_nope
    y = x.clone()
    call_mla(mlakv.mla_rope_cache, x, "bf16", ql_nope=None)
    call_mla(ref.mla_rope_cache, y, "bf16")  # reference copies ql_nope: same bytes
    assert_bytes_equal(x.q_out, y.q_out)


def test_mla_rope_cache_padding_and_error_counters(device):
    """Rows past T (graph padding) stay untouched; slot -1 writes nothing; a slot past the cache
    and a position past the table are skipped / clamped and counted."""
    cfg = TP8
    T, pad = 6, 3
    x = make_mla_inputs(cfg, "bf16", T=T, device=device, pad_rows=pad, seed=6, max_pos=100)
    num_slots = x.kv_cache.shape[0] * x.kv_cache.shape[1]
    x.slot_mapping[1] = num_slots + 5
    x.positions[0] = 1000
    y = x.clone()
    counts = mlakv.new_error_counts(device)
    call_mla(mlakv.mla_rope_cache, x, "bf16", error_counts=counts)
    call_mla(ref.mla_rope_cache, y, "bf16")
    assert_bytes_equal(x.kv_cache, y.kv_cache)
    assert_bytes_equal(x.q_out, y.q_out)
    assert_bytes_equal(x.q, y.q)
    # Padding rows: never written.
    assert torch.all(x.k_pe_out[T:] == -3.0) and torch.all(x.kv_c_out[T:] == -3.0)
    assert torch.all(x.q_out[x.Td:] == 7.0)
    n = mlakv.read_error_counts(counts)
    assert n["bad_slot"] == 1 and n["bad_position"] == 1, n
    # Slot -1 (padding) and the bad slot: the sentinel is intact everywhere the reference left it.
    written = x.kv_cache.view(torch.uint8) != SENTINEL
    assert int(written.reshape(num_slots, -1).any(-1).sum()) == T - 2


def test_mla_rope_cache_device_decode_count(device):
    cfg = TP8
    T = 6
    x = make_mla_inputs(cfg, "bf16", T=T, Td=4, device=device, seed=7)
    y = x.clone()
    td = torch.tensor([4], dtype=torch.int32, device=device)
    call_mla(mlakv.mla_rope_cache, x, "bf16", num_decode_tokens=0, num_decode_tokens_device=td)
    call_mla(ref.mla_rope_cache, y, "bf16")
    assert_bytes_equal(x.kv_c_out, y.kv_c_out)
    assert_bytes_equal(x.q_out, y.q_out)
    assert_bytes_equal(x.q, y.q)
    # Out of range: clamped to T and counted.
    counts = mlakv.new_error_counts(device)
    td.fill_(T + 3)
    z = make_mla_inputs(cfg, "bf16", T=T, Td=T, device=device, seed=7)
    call_mla(mlakv.mla_rope_cache, z, "bf16", num_decode_tokens=0, num_decode_tokens_device=td,
             error_counts=counts)
    assert mlakv.read_error_counts(counts)["bad_decode_count"] == 1


def test_host_decode_count_beside_a_device_one_is_refused(device):
    """With num_decode_tokens_device the host num_decode_tokens would be ignored: any value but 0
    is refused by name, in range or not, and nothing is written."""
    x = make_mla_inputs(TP8, "bf16", T=6, Td=4, device=device, seed=71)
    before = x.clone()
    td = torch.tensor([4], dtype=torch.int32, device=device)
    for host_td in (4, -7, 10**6):
        with pytest.raises(RuntimeError, match="num_decode_tokens: expected 0 with "
                                               "num_decode_tokens_device"):
            call_mla(mlakv.mla_rope_cache, x, "bf16", num_decode_tokens=host_td,
                     num_decode_tokens_device=td)
    for name in ("kv_cache", "q_out", "q", "k_pe_out", "kv_c_out"):
        assert_bytes_equal(getattr(x, name), getattr(before, name))


def test_a_dtype_no_op_takes_is_named_as_such(device):
    """A float64 or int16 argument: the message says no op takes that dtype (not that this
    argument would take any of the listed ones), and nothing is written."""
    x = make_mla_inputs(TP8, "bf16", T=4, device=device, seed=73)
    before = x.kv_cache.clone()
    for name, bad in (("kv_c", x.kv_c.double()), ("positions", x.positions.to(torch.int16))):
        args = dict(positions=x.positions, slot_mapping=x.slot_mapping,
                    cos_sin_cache=x.cos_sin_cache, kv_c=x.kv_c, k_pe=x.k_pe, kv_cache=x.kv_cache)
        args[name] = bad
        with pytest.raises(RuntimeError, match=rf"{name}: expected a dtype of mlakv's ops \(.*; "
                                               r"each argument takes some of them\), got"):
            mlakv.mla_rope_cache(**args, cache_format="bf16")
    assert_bytes_equal(x.kv_cache, before)


def test_read_error_counts_can_raise(device):
    """read_error_counts(..., throw_if_nonzero=True), for debugging an engine: zero counters read
    back as a dict; after a skipped slot it raises, naming the counter and its value."""
    cfg = TP8
    cache = mlakv.allocate_cache(1, 4, cfg.L, cfg.R, "bf16", device=device)
    kv_c = torch.randn(2, cfg.L, device=device).bfloat16()
    k_pe = torch.randn(2, cfg.R, device=device).bfloat16()
    counts = mlakv.new_error_counts(device)
    mlakv.concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([0, 1], device=device),
                               cache_format="bf16", error_counts=counts)
    assert mlakv.read_error_counts(counts, throw_if_nonzero=True)["bad_slot"] == 0
    mlakv.concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([2, 999], device=device),
                               cache_format="bf16", error_counts=counts)
    assert mlakv.read_error_counts(counts)["bad_slot"] == 1
    with pytest.raises(RuntimeError, match=r"non-zero counters: bad_slot = 1$"):
        mlakv.read_error_counts(counts, throw_if_nonzero=True)


def test_gather_cache_sequences_out_rows(device):
    """With out given, num_out_rows is out.shape[0]: with None or that value, out gets the covered
    rows and a workspace larger than cu_seq_lens[-1] keeps its rows past it; another value is
    refused (the op would ignore it), and nothing is written then. Without out, num_out_rows is
    required."""
    cfg = TP8
    x = make_mla_inputs(cfg, "bf16", T=6, device=device, seed=72)
    fill = torch.full((10, cfg.L + cfg.R), 5.0, device=device)
    table = torch.tensor([[1, 0], [3, 2]], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32, device=device)
    kw = dict(kv_lora_rank=cfg.L, cache_format="bf16")
    want = mlakv.gather_cache_sequences(x.kv_cache, table, cu, 8, **kw)
    for rows in (None, 10):
        out = fill.clone()
        assert mlakv.gather_cache_sequences(x.kv_cache, table, cu, rows, out=out, **kw) is out
        assert_bytes_equal(out[:8], want)
        assert_bytes_equal(out[8:], fill[8:])
    out = fill.clone()
    with pytest.raises(RuntimeError, match=r"num_out_rows: expected out.shape\[0\] = 10 \(out "
                                           r"is given; or None\), got 8"):
        mlakv.gather_cache_sequences(x.kv_cache, table, cu, 8, out=out, **kw)
    assert_bytes_equal(out, fill)
    with pytest.raises(RuntimeError, match="num_out_rows"):
        mlakv.gather_cache_sequences(x.kv_cache, table, cu, **kw)


@pytest.mark.parametrize("cfg,fmt", config_format_params())
def test_fused_equals_unfused(cfg, fmt, device):
    """DESIGN: the fused op and the unfused primitives write identical bytes."""
    x = make_mla_inputs(cfg, fmt, device=device, seed=8)
    scale = x.kv_cache_scale if fmt in FP8_FORMATS else None
    fused = x.clone()
    call_mla(mlakv.mla_rope_cache, fused, fmt)

    u = x.clone()
    T, Td = u.slot_mapping.shape[0], u.Td
    kv_c = mlakv.rms_norm(u.kv_c[:T], u.kv_norm_weight, 1e-6)
    k_pe = u.k_pe[:T].clone()
    q_pe = u.q_pe[:T].clone()
    mlakv.rotary_embedding(u.positions, q_pe, k_pe.view(T, 1, cfg.R), u.cos_sin_cache)
    mlakv.rotary_embedding(u.positions, u.q[:, :, cfg.P:], None, u.cos_sin_cache)
    mlakv.concat_and_cache_mla(kv_c, k_pe, u.kv_cache, u.slot_mapping, cache_format=fmt,
                               kv_cache_scale=scale)
    mlakv.decode_q_concat(u.ql_nope[:Td], q_pe[:Td], u.q_out[:Td])
    assert_bytes_equal(fused.kv_cache, u.kv_cache)
    assert_bytes_equal(fused.q_out, u.q_out)
    assert_bytes_equal(fused.q[Td:], u.q[Td:])
    assert_bytes_equal(fused.k_pe_out[:T], k_pe)
    assert_bytes_equal(fused.kv_c_out[:T], kv_c)


# ---- the unfused primitives --------------------------------------------------------------------
@pytest.mark.parametrize("is_neox", [False, True])
@pytest.mark.parametrize("layout", ["3d", "2d", "partial", "3d_query_2d_key"])
def test_rotary_embedding(is_neox, layout, device):
    g = torch.Generator().manual_seed(10)
    T, Hq, Hk, hs = 7, 5, 2, 96
    rot = 32 if layout == "partial" else hs
    table = mlakv.rope_cos_sin_cache(rot, 64, device=device)
    positions = torch.randint(0, 64, (T,), generator=g).to(device)
    q = torch.randn(T, Hq, hs, generator=g).to(torch.bfloat16).to(device)
    k = torch.randn(T, Hk, hs, generator=g).to(torch.bfloat16).to(device)
    if layout == "2d":
        q, k = q.view(T, Hq * hs), k.view(T, Hk * hs)
    elif layout == "3d_query_2d_key":
        k = k.view(T, Hk * hs)
    q2, k2 = q.clone(), k.clone()
    mlakv.rotary_embedding(positions, q, k, table, is_neox=is_neox, head_size=hs)
    ref.rotary_embedding(positions, q2, k2, table, is_neox=is_neox, head_size=hs)
    assert_bytes_equal(q, q2)
    assert_bytes_equal(k, k2)
    if layout != "2d":  # a 3-D query gives head_size: the default reads it from the query
        q3, k3 = q2.clone(), k2.clone()
        mlakv.rotary_embedding(positions, q2, k2, table, is_neox=is_neox)
        ref.rotary_embedding(positions, q3, k3, table, is_neox=is_neox)
        assert_bytes_equal(q2, q3)
        assert_bytes_equal(k2, k3)


@pytest.mark.parametrize("cfg,fmt", config_format_params())
def test_concat_and_cache_mla(cfg, fmt, device):
    x = make_mla_inputs(cfg, fmt, device=device, seed=11)
    y = x.clone()
    scale = x.kv_cache_scale if fmt in FP8_FORMATS else None
    k_pe = x.k_pe.view(-1, 1, cfg.R)  # vLLM's [T, 1, R]
    mlakv.concat_and_cache_mla(x.kv_c, k_pe, x.kv_cache, x.slot_mapping, cache_format=fmt,
                               kv_cache_scale=scale)
    ref.concat_and_cache_mla(y.kv_c, y.k_pe, y.kv_cache, y.slot_mapping, cache_format=fmt,
                             kv_cache_scale=scale)
    assert_bytes_equal(x.kv_cache, y.kv_cache)


@pytest.mark.parametrize("pow2", [False, True])
def test_concat_and_cache_ds_mla_scales(pow2, device):
    cfg = TP8
    x = make_mla_inputs(cfg, "fp8_ds_mla", device=device, seed=12)
    x.kv_c[:, :128] *= 300.0    # a tile beyond e4m3's range before scaling
    x.kv_c[:, 128:256] = 0.0    # an all-zero tile: scale FLT_MIN
    y = x.clone()
    for fn, inp in ((mlakv.concat_and_cache_mla, x), (ref.concat_and_cache_mla, y)):
        fn(inp.kv_c, inp.k_pe, inp.kv_cache, inp.slot_mapping, cache_format="fp8_ds_mla",
           ds_mla_pow2_scale=pow2)
    assert_bytes_equal(x.kv_cache, y.kv_cache)


def test_typed_caches(device):
    """A typed bf16 / fp8 cache tensor holds the same bytes as the uint8 one."""
    cfg = MINICPM3
    for fmt in ["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2"]:
        x = make_mla_inputs(cfg, fmt, device=device, seed=13)
        typed = x.kv_cache.clone().view(mlakv.cache_latent_dtype(fmt))
        scale = x.kv_cache_scale if fmt in FP8_FORMATS else None
        mlakv.concat_and_cache_mla(x.kv_c, x.k_pe, x.kv_cache, x.slot_mapping, cache_format=fmt,
                                   kv_cache_scale=scale)
        mlakv.concat_and_cache_mla(x.kv_c, x.k_pe, typed, x.slot_mapping, cache_format="auto",
                                   kv_cache_scale=scale)
        assert_bytes_equal(typed, x.kv_cache)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_decode_q_concat(out_dtype, device):
    cfg = CONFIGS[0]
    g = torch.Generator().manual_seed(14)
    T = 3
    ql_nope = torch.randn(T, cfg.H, cfg.L, generator=g).to(torch.bfloat16).to(device)
    q_pe = torch.randn(T, cfg.H, cfg.R, generator=g).to(torch.bfloat16).to(device)
    q_scale = None
    if out_dtype != torch.bfloat16:
        q_scale = torch.tensor([0.02], dtype=torch.float32, device=device)
    a = torch.zeros(T, cfg.H, cfg.L + cfg.R, dtype=out_dtype, device=device)
    b = a.clone()
    mlakv.decode_q_concat(ql_nope, q_pe, a, q_scale=q_scale)
    ref.decode_q_concat(ql_nope, q_pe, b, q_scale=q_scale)
    assert_bytes_equal(a, b)


def test_decode_q_concat_parts_already_in_q_out(device):
    # The absorbed bmm wrote ql_nope into q_out's nope part: only q_pe is copied in.
    cfg = CONFIGS[0]
    g = torch.Generator().manual_seed(16)
    T = 3
    q_out = torch.randn(T, cfg.H, cfg.L + cfg.R, generator=g).to(torch.bfloat16).to(device)
    q_pe = torch.randn(T, cfg.H, cfg.R, generator=g).to(torch.bfloat16).to(device)
    expected = q_out.clone()
    expected[:, :, cfg.L:] = q_pe
    mlakv.decode_q_concat(q_out[:, :, :cfg.L], q_pe, q_out)
    assert_bytes_equal(q_out, expected)
    # q_pe in q_out's rope part, ql_nope apart: only the nope part is copied in.
    ql_nope = torch.randn(T, cfg.H, cfg.L, generator=g).to(torch.bfloat16).to(device)
    expected[:, :, :cfg.L] = ql_nope
    mlakv.decode_q_concat(ql_nope, q_out[:, :, cfg.L:], q_out)
    assert_bytes_equal(q_out, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("N", [64, 512, 1536, 7168])
def test_rms_norm(dtype, N, device):
    g = torch.Generator().manual_seed(15)
    x = (torch.randn(9, N, generator=g) * 3).to(dtype).to(device)
    w = (1 + 0.3 * torch.randn(N, generator=g)).to(dtype).to(device)
    out = mlakv.rms_norm(x, w, 1e-6)
    assert_bytes_equal(out, ref.rms_norm(x, w, 1e-6))
    assert_bytes_equal(mlakv.rms_norm(x, w), out)  # the default eps is 1e-6
    inplace = x.clone()
    mlakv.rms_norm(inplace, w, 1e-6, out=inplace)
    assert_bytes_equal(inplace, out)


# ---- cache read-back ---------------------------------------------------------------------------
@pytest.mark.parametrize("cfg,fmt", config_format_params())
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gather_cache_slots(cfg, fmt, out_dtype, device):
    x = make_mla_inputs(cfg, fmt, device=device, seed=16)
    scale = x.kv_cache_scale if fmt in FP8_FORMATS else None
    mlakv.concat_and_cache_mla(x.kv_c, x.k_pe, x.kv_cache, x.slot_mapping, cache_format=fmt,
                               kv_cache_scale=scale)
    num_slots = x.kv_cache.shape[0] * x.kv_cache.shape[1]
    slots = torch.cat([x.slot_mapping, torch.tensor([-1, num_slots, 0], device=device)])
    counts = mlakv.new_error_counts(device)
    a = mlakv.gather_cache_slots(x.kv_cache, slots, kv_lora_rank=cfg.L, cache_format=fmt,
                                 kv_cache_scale=scale, out_dtype=out_dtype, error_counts=counts)
    e = ref.gather_cache_slots(x.kv_cache, slots, kv_lora_rank=cfg.L, cache_format=fmt,
                               kv_cache_scale=scale, out_dtype=out_dtype)
    assert a.shape == (slots.shape[0], cfg.L + cfg.R) and a.dtype == out_dtype
    assert_bytes_equal(a, e)
    assert mlakv.read_error_counts(counts)["bad_slot"] == 1


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "fp8_ds_mla"])
def test_gather_cache_sequences(fmt, device):
    cfg = TP8
    g = torch.Generator().manual_seed(17)
    nb, bs = 8, 4
    cache = mlakv.allocate_cache(nb, bs, cfg.L, cfg.R, fmt, device=device)
    scale = torch.tensor([0.5], device=device) if fmt in FP8_FORMATS else None
    kv_c = torch.randn(nb * bs, cfg.L, generator=g).to(torch.bfloat16).to(device)
    k_pe = torch.randn(nb * bs, cfg.R, generator=g).to(torch.bfloat16).to(device)
    mlakv.concat_and_cache_mla(kv_c, k_pe, cache, torch.arange(nb * bs, device=device),
                               cache_format=fmt, kv_cache_scale=scale)
    block_table = torch.tensor([[3, 1, 6], [0, 7, 2], [5, 99, 4]], dtype=torch.int32,
                               device=device)
    seq_lens = [5, 0, 9]
    cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32, device=device)
    counts = mlakv.new_error_counts(device)
    for rows in (sum(seq_lens), 16, 10):
        a = mlakv.gather_cache_sequences(cache, block_table, cu, rows, kv_lora_rank=cfg.L,
                                         cache_format=fmt, kv_cache_scale=scale,
                                         error_counts=counts)
        e = ref.gather_cache_sequences(cache, block_table, cu, rows, kv_lora_rank=cfg.L,
                                       cache_format=fmt, kv_cache_scale=scale)
        assert_bytes_equal(a, e)
    assert mlakv.read_error_counts(counts)["bad_block_index"] > 0  # block 99


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_cache_past_4_gib(fmt, device):
    """An engine's cache fills most of the GPU, so entry offsets pass 2^32 bytes. A cache of just
    over 4 GiB whose last blocks stand in for a small one (straddling byte 2^32): the fused op
    writes them, and both gathers read them, as the reference does in the small cache; the head,
    where a 32-bit offset would wrap to, keeps the sentinel. Untouched memory costs nothing on the
    CPU."""
    cfg = TP8
    nb, bs = 4, 64
    x = make_mla_inputs(cfg, fmt, T=60, Td=20, device=device, num_blocks=nb, block_size=bs,
                        seed=61)
    y = x.clone()
    block_bytes = bs * x.kv_cache.shape[-1]
    shift = (2**32 - nb * block_bytes // 2) // block_bytes
    far = torch.empty((shift + nb, bs, x.kv_cache.shape[-1]), dtype=torch.uint8, device=device)
    far[:nb].fill_(SENTINEL)
    far[shift:] = x.kv_cache
    slots = x.slot_mapping
    offsets = (shift + slots[slots >= 0].cpu() // bs) * block_bytes
    assert bool((offsets < 2**32).any()) and bool((offsets >= 2**32).any())
    x.kv_cache = far
    x.slot_mapping = torch.where(slots >= 0, slots + shift * bs, slots)
    scale = x.kv_cache_scale if fmt in FP8_FORMATS else None
    call_mla(mlakv.mla_rope_cache, x, fmt, norm=True)
    call_mla(ref.mla_rope_cache, y, fmt, norm=True)
    assert_bytes_equal(far[shift:], y.kv_cache)
    assert bool((far[:nb] == SENTINEL).all())
    assert_bytes_equal(x.q_out, y.q_out)
    assert_bytes_equal(x.q, y.q)

    kw = dict(kv_lora_rank=cfg.L, cache_format=fmt, kv_cache_scale=scale)
    every = torch.arange(nb * bs, device=device)
    assert_bytes_equal(mlakv.gather_cache_slots(far, every + shift * bs, **kw),
                       ref.gather_cache_slots(y.kv_cache, every, **kw))
    table = torch.tensor([[3, 0], [2, 1]], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 2 * bs - 3, 4 * bs - 3], dtype=torch.int32, device=device)
    assert_bytes_equal(mlakv.gather_cache_sequences(far, table + shift, cu, 4 * bs - 3, **kw),
                       ref.gather_cache_sequences(y.kv_cache, table, cu, 4 * bs - 3, **kw))


# ---- errors ------------------------------------------------------------------------------------
def test_errors_surface_as_python_exceptions(device):
    cfg = TP8
    x = make_mla_inputs(cfg, "bf16", device=device)
    before = x.kv_cache.clone()
    # Model dtype mismatch: the core names the argument.
    with pytest.raises(RuntimeError, match="k_pe"):
        mlakv.mla_rope_cache(x.positions, x.slot_mapping, x.cos_sin_cache, x.kv_c,
                             x.k_pe.float(), x.kv_cache, cache_format="bf16")
    # A cache whose entry does not hold L + R values.
    with pytest.raises(RuntimeError, match="kv_cache"):
        mlakv.concat_and_cache_mla(x.kv_c, x.k_pe, x.kv_cache[:, :, :-2], x.slot_mapping,
                                   cache_format="bf16")
    # Host Td past T.
    with pytest.raises(RuntimeError, match="num_decode_tokens"):
        call_mla(mlakv.mla_rope_cache, x, "bf16", num_decode_tokens=100)
    # A uint8 cache needs an explicit format.
    with pytest.raises(RuntimeError, match="cache_format"):
        mlakv.concat_and_cache_mla(x.kv_c, x.k_pe, x.kv_cache, x.slot_mapping)
    with pytest.raises(RuntimeError, match="cache_format|fp9"):
        mlakv.concat_and_cache_mla(x.kv_c, x.k_pe, x.kv_cache, x.slot_mapping, cache_format="fp9")
    # fp8_ds_mla only exists for L = 512, R = 64.
    with pytest.raises(RuntimeError, match="fp8_ds_mla"):
        mlakv.concat_and_cache_mla(x.kv_c[:, :256], x.k_pe, x.kv_cache, x.slot_mapping,
                                   cache_format="fp8_ds_mla")
    # A scale on a raw cache.
    with pytest.raises(RuntimeError, match="scale"):
        mlakv.concat_and_cache_mla(x.kv_c, x.k_pe, x.kv_cache, x.slot_mapping,
                                   cache_format="bf16", kv_cache_scale=x.kv_cache_scale)
    assert torch.equal(x.kv_cache, before), "a rejected op must write nothing"


def test_wrapper_and_zero_dim_errors_are_runtime_errors(device):
    """The wrappers' own checks and 0-dim tensors give RuntimeError, like the core's errors."""
    cfg = TP8
    cache = mlakv.allocate_cache(4, 4, cfg.L, cfg.R, "bf16", device=device)
    slots = torch.zeros(2, dtype=torch.int64, device=device)
    for call in (lambda: mlakv.gather_cache_slots(cache, slots, kv_lora_rank=cfg.L,
                                                  cache_format="bogus"),
                 lambda: mlakv.gather_cache_sequences(cache, torch.zeros(1, 1, dtype=torch.int32,
                                                                         device=device),
                                                      torch.tensor([0, 1], dtype=torch.int32,
                                                                   device=device),
                                                      1, kv_lora_rank=cfg.L,
                                                      cache_format="bogus")):
        with pytest.raises(RuntimeError, match="cache_format"):
            call()
    q2d = torch.zeros(2, 4 * cfg.R, dtype=torch.bfloat16, device=device)
    table = mlakv.tables.rope_cos_sin_cache(cfg.R, 16).to(device)
    with pytest.raises(RuntimeError, match="head_size"):
        mlakv.rotary_embedding(slots, q2d, None, table)
    scalar = torch.tensor(1.0, dtype=torch.bfloat16, device=device)
    w = torch.ones(cfg.L, dtype=torch.bfloat16, device=device)
    with pytest.raises(RuntimeError, match="input"):
        torch.ops.mlakv.rms_norm(scalar.clone(), scalar, w, 1e-6)
    with pytest.raises(RuntimeError, match="q_out"):
        torch.ops.mlakv.decode_q_concat(scalar, scalar, scalar.clone(), None)
    with pytest.raises(RuntimeError, match="slots"):
        torch.ops.mlakv.gather_cache_slots(cache, "bf16", None, None, slots[0], cfg.L,
                                           torch.float32)
    # The wrappers that read a size of a tensor before the op runs (to allocate an output or to
    # take T from it) give the same error for a 0-dim one, naming it.
    counts = mlakv.new_error_counts(device)
    for name, call in (
            ("slot_mapping", lambda: mlakv.mla_rope_cache_decode(slots, slots[0], table, w, w,
                                                                 cache)),
            ("slots", lambda: mlakv.gather_cache_slots(cache, slots[0], kv_lora_rank=cfg.L,
                                                       cache_format="bf16",
                                                       error_counts=counts)),
            ("input", lambda: mlakv.rmsnorm_quant(scalar, w)),
            ("input", lambda: mlakv.per_token_group_quant_fp8(scalar)),
            ("q_c", lambda: mlakv.mla_rmsnorm_quant(scalar, w, scalar, w)),
            ("kv_c", lambda: mlakv.mla_rmsnorm_quant(w.view(1, -1), w, scalar, w))):
        with pytest.raises(RuntimeError, match=f"mlakv: {name}: expected at least 1 dim"):
            call()


def test_argument_errors_name_the_argument(device):
    """Errors that used to name the wrong thing, or nothing."""
    cfg = TP8
    table = mlakv.tables.rope_cos_sin_cache(cfg.R, 16).to(device)
    positions = torch.zeros(2, dtype=torch.int64, device=device)
    # A query of another rank than 2 or 3: the op's message about its dims, not a head size.
    for q in (torch.zeros(2 * cfg.R, dtype=torch.bfloat16, device=device),
              torch.zeros(2, 1, 1, cfg.R, dtype=torch.bfloat16, device=device)):
        with pytest.raises(RuntimeError, match="query: expected 3 dims"):
            mlakv.rotary_embedding(positions, q, None, table)
    # Byte caches must hold whole values of the format's element type.
    x = make_mla_inputs(cfg, "bf16", T=4, device=device)
    latent = torch.zeros(4, 4, cfg.L * 2, dtype=torch.uint8, device=device)
    rope = torch.zeros(4, 4, cfg.R * 2 + 1, dtype=torch.uint8, device=device)
    with pytest.raises(RuntimeError, match="whole values"):
        mlakv.concat_and_cache_mla(x.kv_c, x.k_pe, latent, x.slot_mapping, cache_format="bf16",
                                   kv_cache_rope=rope)
    assert not latent.any() and not rope.any()
    # A kv_lora_rank wider than the entry is named, whether the op or the wrapper (which
    # allocates the output when error_counts is given) finds it; so is a bad out_dtype.
    cache = mlakv.allocate_cache(4, 4, cfg.L, cfg.R, "bf16", device=device)
    for counts in (None, mlakv.new_error_counts(device)):
        with pytest.raises(RuntimeError, match="kv_lora_rank: expected at most 576"):
            mlakv.gather_cache_slots(cache, x.slot_mapping, kv_lora_rank=608,
                                     cache_format="bf16", error_counts=counts)
        with pytest.raises(RuntimeError, match="mlakv: out_dtype: expected float32 or bfloat16"):
            mlakv.gather_cache_slots(cache, x.slot_mapping, kv_lora_rank=cfg.L,
                                     cache_format="bf16", out_dtype=torch.float16,
                                     error_counts=counts)
        assert counts is None or not counts.any()


def test_errors_name_the_torch_arguments(device):
    """The core names some arguments by their C++ parameter paths (RmsNormParams::output,
    Fp8GroupQuantOutput::values, MlaRmsNormQuantParams::kv.output, ...); through the binding the
    messages name them as the torch ops do, and nothing is written."""
    x = torch.randn(4, 512, device=device).bfloat16()
    w = torch.ones(512, dtype=torch.bfloat16, device=device)
    with pytest.raises(RuntimeError, match=r"^mlakv: rms_norm: out: expected") as e:
        mlakv.rms_norm(x, w, out=torch.zeros(4, 512, device=device))
    assert "output" not in str(e.value).splitlines()[0]
    # The memory rules' messages: the renaming touches the argument's name, not the prose.
    buf = torch.randn(5 * 512, device=device).bfloat16()
    before = buf.clone()
    shifted = buf[512:].view(4, 512)
    other = torch.randn(520, device=device).bfloat16()
    other_before = other.clone()
    overlapping_rows = other.as_strided((4, 512), (2, 1))
    for bad_out, pattern in [
            (shifted, r"^mlakv: rms_norm: out: expected memory disjoint from input \(a tensor "
                      r"the op writes may be an input only exactly"),
            (overlapping_rows, r"^mlakv: rms_norm: out: expected rows that do not overlap each "
                               r"other \(the op writes them\)")]:
        with pytest.raises(RuntimeError, match=pattern):
            torch.ops.mlakv.rms_norm(bad_out, buf[:2048].view(4, 512), w, 1e-6)
    assert torch.equal(buf, before) and torch.equal(other, other_before)
    out = torch.zeros(4, 512, dtype=torch.float8_e4m3fn, device=device)
    scales = torch.full((4, 4), -7.0, device=device)
    cases = [
        ("rmsnorm_quant: out: ", lambda: mlakv.rmsnorm_quant(x, w, out=out.view(torch.uint8),
                                                              scales=scales)),
        ("rmsnorm_quant: scales: ", lambda: mlakv.rmsnorm_quant(x, w, out=out,
                                                                 scales=scales[:, :2])),
        ("rmsnorm_quant: group_size: ", lambda: mlakv.rmsnorm_quant(x, w, out=out, scales=scales,
                                                                     group_size=96)),
        ("per_token_group_quant_fp8: scale_floor: ",
         lambda: mlakv.per_token_group_quant_fp8(x, out=out, scales=scales, scale_floor=0.0)),
        ("mla_rmsnorm_quant: q_out: ",
         lambda: mlakv.mla_rmsnorm_quant(x, w, x, w, q_out=out.view(torch.uint8),
                                         q_scales=scales)),
        ("mla_rmsnorm_quant: q_scales: ",
         lambda: mlakv.mla_rmsnorm_quant(x, w, x, w, q_out=out, q_scales=scales[:, :2])),
        ("mla_rmsnorm_quant: kv_weight: ",
         lambda: mlakv.mla_rmsnorm_quant(x, w, x, w.float(), q_out=out, q_scales=scales)),
        ("mla_rmsnorm_quant: kv_c_out: ",
         lambda: mlakv.mla_rmsnorm_quant(x, w, x, w, q_out=out, q_scales=scales,
                                         kv_c_out=torch.zeros(4, 512, device=device))),
        ("mla_rmsnorm_quant: q_residual: ",
         lambda: mlakv.mla_rmsnorm_quant(x, w, x, w, q_out=out, q_scales=scales,
                                         q_residual=x[:, :256])),
        ("mla_rmsnorm_quant: kv_c: expected dtype bfloat16 \\(the dtype of q_c\\)",
         lambda: mlakv.mla_rmsnorm_quant(x, w, x.half(), w.half(), q_out=out, q_scales=scales)),
    ]
    # The binding's own check of T, before the core: a 0-dim q_c or kv_c (the row count).
    scalar = torch.tensor(1.0, device=device).bfloat16()
    kv_c_out = torch.zeros(4, 512, dtype=torch.bfloat16, device=device)
    cases += [
        ("^mlakv: mla_rmsnorm_quant: kv_c: expected a \\[T, N\\] tensor, got shape \\[\\]",
         lambda: mlakv.mla_rmsnorm_quant(x, w, scalar, w, q_out=out, q_scales=scales,
                                         kv_c_out=kv_c_out)),
        ("^mlakv: mla_rmsnorm_quant: q_c: expected a \\[T, N\\] tensor, got shape \\[\\]",
         lambda: torch.ops.mlakv.mla_rmsnorm_quant(scalar, w, 1e-6, out, scales, x, w, 1e-6,
                                                   kv_c_out)),
    ]
    for pattern, call in cases:
        with pytest.raises(RuntimeError, match=pattern) as e:
            call()
        first = str(e.value).splitlines()[0]
        assert "quant." not in first and "q." not in first and "kv." not in first, first
    assert not out.view(torch.uint8).any() and bool((scales == -7.0).all())
    assert not kv_c_out.any()
    # An unknown cache format is the cache_format argument's error, listing every name taken.
    y = make_mla_inputs(TP8, "bf16", T=4, device=device)
    before = y.kv_cache.clone()
    for call in (lambda: torch.ops.mlakv.concat_and_cache_mla(
                     y.kv_c, y.k_pe, y.kv_cache, y.slot_mapping, "bfloat16", None, None, None),
                 lambda: call_mla(mlakv.mla_rope_cache, y, "bfloat16")):
        with pytest.raises(RuntimeError, match='^mlakv: cache_format: expected one of bf16, fp16, '
                                               'fp32, fp8_e4m3, fp8_e5m2, fp8_ds_mla, fp8 or '
                                               'auto, got "bfloat16"'):
            call()
    assert torch.equal(y.kv_cache, before)
    # The cache's scale, named by the core as part of kv_cache, is the kv_cache_scale argument.
    cfg = TP8
    x = make_mla_inputs(cfg, "fp8_e4m3", T=4, device=device)
    kv_c_out = torch.zeros(4, cfg.L, dtype=torch.bfloat16, device=device)
    before = x.kv_cache.clone()
    with pytest.raises(RuntimeError, match="kv_cache_scale") as e:
        mlakv.mla_rope_cache(x.positions, x.slot_mapping, x.cos_sin_cache, x.kv_c, x.k_pe,
                             x.kv_cache, cache_format="fp8_e4m3", kv_c_out=kv_c_out,
                             kv_cache_scale=kv_c_out.view(torch.float32)[0, :1])
    assert "kv_cache's scale" not in str(e.value)
    assert torch.equal(x.kv_cache, before) and not kv_c_out.any()


def test_binding_errors_say_where_they_come_from(device):
    """The core's messages come with the binding's "mlakv: " prefix and no source location; a
    cache that does not fit kv_c's and k_pe's widths says that the widths came from them; the
    prefill wrapper wants q, as the C++ entry point does; a negative row count is mlakv's error."""
    cfg = TP8
    x = make_mla_inputs(cfg, "bf16", T=4, device=device)
    with pytest.raises(RuntimeError, match=r"^mlakv: mla_rope_cache: k_pe") as e:
        mlakv.mla_rope_cache(x.positions, x.slot_mapping, x.cos_sin_cache, x.kv_c,
                             x.k_pe.float(), x.kv_cache, cache_format="bf16")
    assert ".cpp:" not in str(e.value).splitlines()[0]
    # kv_a's whole output passed as kv_c: L = 576 does not fit the cache's 576-value entries.
    kv_a = torch.zeros(4, cfg.L + cfg.R, dtype=torch.bfloat16, device=device)
    before = x.kv_cache.clone()
    with pytest.raises(RuntimeError, match="L = 576, R = 64 \\(from the widths of kv_c and k_pe\\)"):
        mlakv.concat_and_cache_mla(kv_a, x.k_pe, x.kv_cache, x.slot_mapping, cache_format="bf16")
    with pytest.raises(RuntimeError, match="from the widths of kv_c and k_pe"):
        mlakv.mla_rope_cache_decode(x.positions, x.slot_mapping, x.cos_sin_cache, kv_a, x.k_pe,
                                    x.kv_cache, cache_format="bf16")
    assert torch.equal(x.kv_cache, before), "a rejected op must write nothing"
    # A gather takes L from kv_lora_rank and R from the cache: an entry of 1153 bytes fits no R.
    odd = torch.zeros(4, 4, 2 * (cfg.L + cfg.R) + 1, dtype=torch.uint8, device=device)
    with pytest.raises(RuntimeError, match="L from kv_lora_rank, R from the cache"):
        mlakv.gather_cache_slots(odd, x.slot_mapping, kv_lora_rank=cfg.L, cache_format="bf16")
    with pytest.raises(RuntimeError, match="mla_rope_cache_prefill: q: expected 3 dims"):
        mlakv.mla_rope_cache_prefill(x.positions, x.slot_mapping, x.cos_sin_cache, x.kv_c,
                                     x.k_pe, x.kv_cache, cache_format="bf16")
    assert torch.equal(x.kv_cache, before)
    counts = mlakv.new_error_counts(device)
    with pytest.raises(RuntimeError, match="mlakv: num_out_rows: expected >= 0, got -1"):
        mlakv.gather_cache_sequences(x.kv_cache.view(torch.bfloat16),
                                     torch.zeros(1, 1, dtype=torch.int32, device=device),
                                     torch.tensor([0, 1], dtype=torch.int32, device=device), -1,
                                     kv_lora_rank=cfg.L, error_counts=counts)


def test_raw_ops_take_vllms_leading_arguments(device):
    """torch.ops.mlakv.rotary_embedding and concat_and_cache_mla called with vLLM's arguments only
    (the trailing optional ones left out) do what the wrappers do."""
    cfg = TP8
    x = make_mla_inputs(cfg, "bf16", T=4, device=device)
    y = make_mla_inputs(cfg, "bf16", T=4, device=device)
    q_pe = x.q_pe.clone()
    k_pe = x.k_pe.clone().unsqueeze(1)
    torch.ops.mlakv.rotary_embedding(x.positions, q_pe, k_pe, cfg.R, x.cos_sin_cache, False)
    q_expected = x.q_pe.clone()
    k_expected = x.k_pe.clone().unsqueeze(1)
    mlakv.rotary_embedding(x.positions, q_expected, k_expected, x.cos_sin_cache)
    assert_bytes_equal(q_pe, q_expected)
    assert_bytes_equal(k_pe, k_expected)
    torch.ops.mlakv.concat_and_cache_mla(x.kv_c, x.k_pe, x.kv_cache, x.slot_mapping, "bf16")
    mlakv.concat_and_cache_mla(y.kv_c.copy_(x.kv_c), y.k_pe.copy_(x.k_pe), y.kv_cache,
                               y.slot_mapping.copy_(x.slot_mapping), cache_format="bf16")
    assert_bytes_equal(x.kv_cache, y.kv_cache)
    z = make_mla_inputs(cfg, "fp8_e4m3", T=4, device=device)
    torch.ops.mlakv.concat_and_cache_mla(z.kv_c, z.k_pe, z.kv_cache, z.slot_mapping, "fp8",
                                         z.kv_cache_scale)
    assert z.kv_cache.any()


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_cache_of_one_block_with_any_block_stride(fmt, device):
    """A view of one block (here a transposed [4, 1, entry] buffer: block stride 1152) or of
    blocks of one entry carries a stride that is never used: the op takes it and writes and reads
    the bytes of a contiguous cache."""
    cfg = TP8
    x = make_mla_inputs(cfg, fmt, T=4, device=device, num_blocks=1, block_size=4)
    packed = mlakv.allocate_cache(1, 4, cfg.L, cfg.R, fmt, device=device, fill=0)
    entry = packed.shape[-1]
    odd = torch.zeros(4, 1, entry, dtype=packed.dtype, device=device).transpose(0, 1)
    assert odd.shape == packed.shape and odd.stride(0) != packed.stride(0)
    for cache in (packed, odd):
        mlakv.concat_and_cache_mla(x.kv_c, x.k_pe, cache, x.slot_mapping, cache_format=fmt)
    assert_bytes_equal(odd, packed)
    got = mlakv.gather_cache_slots(odd, x.slot_mapping, kv_lora_rank=cfg.L, cache_format=fmt)
    want = mlakv.gather_cache_slots(packed, x.slot_mapping, kv_lora_rank=cfg.L, cache_format=fmt)
    assert_bytes_equal(got, want)
    # Blocks of one entry whose token stride could hold no entry (3 elements).
    buf = torch.zeros(4 * entry, dtype=packed.dtype, device=device)
    one = buf.as_strided((4, 1, entry), (entry, 3, 1))
    mlakv.concat_and_cache_mla(x.kv_c, x.k_pe, one, x.slot_mapping, cache_format=fmt)
    assert_bytes_equal(buf.view(1, 4, entry), packed)


def _with_unused_strides(t: torch.Tensor, junk: int = 3) -> torch.Tensor:
    """A copy of t whose size-1 dims have stride ``junk`` (never used for addressing)."""
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    strides = [junk if n == 1 else s for n, s in zip(out.shape, out.stride())]
    return out.as_strided(out.shape, strides).copy_(t)


@pytest.mark.parametrize("T, Td", [(1, 1), (1, 0), (4, 2)])
def test_unused_strides_of_size_one_dims(T, Td, device):
    """The stride of a size-1 dim is never used and may be anything: kv_c [512, 1].t() is a
    [1, 512] tensor with strides (1, 1) (contiguous for torch), and a one-head query side may
    have any head stride. The op takes them as they are and writes the bytes of contiguous
    tensors (the backends get the contiguous strides: the CUDA kernels keep their 16-byte
    path)."""
    cfg = OpConfig("one_head", H=1, L=512, R=64, P=128)
    x = make_mla_inputs(cfg, "bf16", T=T, Td=Td, device=device)
    y = make_mla_inputs(cfg, "bf16", T=T, Td=Td, device=device)
    for name in ("kv_c", "k_pe", "q_pe", "ql_nope", "q_out", "q", "k_pe_out", "kv_c_out"):
        setattr(y, name, _with_unused_strides(getattr(y, name)))
    if T == 1:
        y.kv_c = torch.empty(cfg.L, 1, dtype=x.kv_c.dtype, device=device).t().copy_(x.kv_c)
        assert y.kv_c.stride() == (1, 1) and y.kv_c.is_contiguous()
    q_prefill_x = torch.full_like(x.q, 5.0)
    q_prefill_y = _with_unused_strides(q_prefill_x)
    call_mla(mlakv.mla_rope_cache, x, "bf16", q_prefill_out=q_prefill_x)
    call_mla(mlakv.mla_rope_cache, y, "bf16", q_prefill_out=q_prefill_y)
    for name in ("kv_cache", "q_out", "q", "k_pe_out", "kv_c_out"):
        assert_bytes_equal(getattr(y, name), getattr(x, name))
    assert_bytes_equal(q_prefill_y, q_prefill_x)
    assert (x.kv_cache.view(torch.uint8) != SENTINEL).any()


def test_gather_cache_sequences_empty_block_table(device):
    """An empty block table ([B, 0], or B = 0) has no entry to read: rows are zeros and counted
    ([B, 0]) or untouched (B = 0), never a read through the empty tensor's pointer."""
    cfg = TP8
    cache = mlakv.allocate_cache(4, 4, cfg.L, cfg.R, "bf16", device=device)
    counts = mlakv.new_error_counts(device)
    out = torch.full((4, cfg.L + cfg.R), 7.0, device=device)
    mlakv.gather_cache_sequences(cache, torch.empty(2, 0, dtype=torch.int32, device=device),
                                 torch.tensor([0, 1, 3], dtype=torch.int32, device=device), 4,
                                 kv_lora_rank=cfg.L, cache_format="bf16", out=out,
                                 error_counts=counts)
    assert torch.equal(out[:3], torch.zeros_like(out[:3])) and bool((out[3] == 7.0).all())
    assert mlakv.read_error_counts(counts)["bad_block_index"] == 3
    out.fill_(7.0)
    mlakv.gather_cache_sequences(cache, torch.empty(0, 4, dtype=torch.int32, device=device),
                                 torch.tensor([0], dtype=torch.int32, device=device), 4,
                                 kv_lora_rank=cfg.L, cache_format="bf16", out=out,
                                 error_counts=counts)
    assert bool((out == 7.0).all())
    assert mlakv.read_error_counts(counts)["bad_block_index"] == 3


def test_rotary_embedding_counts_bad_positions(device):
    """rotary_embedding's error_counts: a position past the table is counted, and the rows are
    the reference's."""
    table = mlakv.rope_cos_sin_cache(64, 16, device=device)
    positions = torch.tensor([0, 99, 3], device=device)
    q = torch.randn(3, 2, 64).bfloat16().to(device)
    want = q.clone()
    counts = mlakv.new_error_counts(device=device)
    mlakv.rotary_embedding(positions, q, None, table, error_counts=counts)
    assert mlakv.read_error_counts(counts)["bad_position"] == 1
    ref.rotary_embedding(positions, want, None, table)
    assert_bytes_equal(q, want)


# ---- tables ------------------------------------------------------------------------------------
def test_rope_tables():
    t = mlakv.rope_cos_sin_cache(64, 32)
    assert t.shape == (32, 64) and t.dtype == torch.float32
    assert torch.all(t[0, :32] == 1) and torch.all(t[0, 32:] == 0)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert torch.allclose(t[5, :32].double(), torch.cos(5 * inv_freq), atol=1e-7)
    y = mlakv.yarn_cos_sin_cache(64, factor=40.0, original_max_position=4096)
    assert y.shape == (163840, 64)
    # High-frequency dims are extrapolated (unchanged), low-frequency ones interpolated.
    assert torch.allclose(y[7, :4], t[7, :4])
    assert mlakv.yarn_get_mscale(40.0, 1.0) == pytest.approx(1 + 0.1 * math.log(40.0))


def test_rope_tables_against_literals():
    """The tables' angles and scale against values worked out by hand (tests/test_tables.cpp's
    literals): row 1's angle of each frequency (atan2 of its sin and cos, so a flipped sin
    fails), YaRN's ramp with and without clipped betas, and its mscale ratio."""
    def angles(t, pairs):
        for i, want in pairs:
            assert math.atan2(float(t[1, 32 + i]), float(t[1, i])) == pytest.approx(want,
                                                                                     rel=1e-12), i
    plain = mlakv.rope_cos_sin_cache(64, 2, dtype=torch.float64)
    angles(plain, [(0, 1.0), (5, 10000 ** (-10 / 64)), (31, 10000 ** (-62 / 64))])
    # DeepSeek-V3's YaRN (factor 40, original 4096, betas 32 / 1): extrapolated, ramped,
    # interpolated.
    yarn = mlakv.yarn_cos_sin_cache(64, max_position=2, dtype=torch.float64)
    angles(yarn, [(0, 1.0), (5, 0.23713737056616555), (11, 0.03900692656714386),
                  (15, 0.008334508951020777), (23, 3.33380358040831e-05)])
    # beta_fast = beta_slow = 4096 / (2 pi) * 1.01: the ramp's both ends clip to dim 0 and 1.
    b = 658.4176333734474
    clipped = mlakv.yarn_cos_sin_cache(64, factor=2.0, beta_fast=b, beta_slow=b, max_position=2,
                                       dtype=torch.float64)
    angles(clipped, [(0, 1.0), (1, 0.37494710466622794), (31, 6.66760716081662e-05)])
    scaled = mlakv.yarn_cos_sin_cache(64, factor=4.0, mscale=0.9, mscale_all_dim=0.707,
                                      max_position=1, dtype=torch.float64)
    want = (0.1 * 0.9 * math.log(4) + 1) / (0.1 * 0.707 * math.log(4) + 1)
    assert float(scaled[0, 0]) == pytest.approx(want, rel=1e-12)


def _round_once(v64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 -> bfloat16 / float16 rounded once, to nearest-even: the nearest of the twice-rounded
    value (via float32) and its two neighbours, an even one on a tie."""
    c = v64.to(torch.float32).to(dtype)
    bits = c.view(torch.int16).to(torch.int32)
    cands = torch.stack([c] + [((bits + d) & 0xFFFF).to(torch.int16).view(dtype) for d in (-1, 1)])
    err = (cands.double() - v64).abs()
    err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
    odd = (cands.view(torch.int16) & 1).to(torch.int64)
    score = torch.where(err == err.min(0).values, odd, torch.full_like(odd, 2))
    return cands.gather(0, score.argmin(0).unsqueeze(0)).squeeze(0)


@pytest.mark.parametrize("dtype,twice_differs", [(torch.bfloat16, 4), (torch.float16, 16)])
def test_rope_tables_of_16_bits_are_rounded_once(dtype, twice_differs):
    """A 16-bit table is the float64 values rounded once (not through float32: that double
    rounding differs in a few entries, counted here so that the test can tell the two apart)."""
    y64 = mlakv.yarn_cos_sin_cache(64, max_position=4096, dtype=torch.float64)
    got = mlakv.yarn_cos_sin_cache(64, max_position=4096, dtype=dtype)
    want = _round_once(y64, dtype)
    assert_bytes_equal(got, want)
    twice = y64.to(torch.float32).to(dtype)
    assert int((twice.view(torch.int16) != want.view(torch.int16)).sum()) == twice_differs


# ---- NaN inputs ---------------------------------------------------------------------------------
def _poison_nans(t: torch.Tensor):
    """NaNs of several encodings (positive quiet, negative, all payload bits set) in row 0 and the
    last row of t."""
    int_type = {2: torch.int16, 4: torch.int32}[t.element_size()]
    bits = t.view(int_type)
    flat = bits.reshape(bits.shape[0], -1)
    if t.element_size() == 2:
        nans = [0x7FC0 if t.dtype == torch.bfloat16 else 0x7E00, -1, 0x7FFF]
    else:
        nans = [0x7FC00000, -1, 0x7FFFFFFF]
    for row in (0, flat.shape[0] - 1):
        for j, v in enumerate(nans):
            flat[row, 3 + 5 * j] = v


@pytest.mark.parametrize("fmt", ["bf16", "fp32", "fp8_e4m3", "fp8_ds_mla"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", [False, True])
def test_nan_inputs_match_reference(fmt, dtype, norm, device):
    """NaN inputs: the reference writes the library's bytes (docs/decisions.md: canonical NaN
    encodings, a value copied into its own dtype kept as it is, the fp8_ds_mla tile amax ignores
    NaN so the tile's other values keep their scale)."""
    if fmt == "fp8_ds_mla" and dtype != torch.bfloat16:
        pytest.skip("fp8_ds_mla needs a bf16 model dtype")
    cfg = TP8
    x = make_mla_inputs(cfg, fmt, dtype=dtype, device=device, seed=40)
    for name in ("kv_c", "k_pe", "q_pe", "ql_nope", "q"):
        _poison_nans(getattr(x, name))
    y = x.clone()
    call_mla(mlakv.mla_rope_cache, x, fmt, norm=norm)
    call_mla(ref.mla_rope_cache, y, fmt, norm=norm)
    for name in ("kv_cache", "q_out", "q", "k_pe_out", "kv_c_out"):
        assert_bytes_equal(getattr(x, name), getattr(y, name))
    scale = x.kv_cache_scale if fmt in FP8_FORMATS else None
    for out_dtype in (torch.float32, torch.bfloat16):
        a = mlakv.gather_cache_slots(x.kv_cache, x.slot_mapping, kv_lora_rank=cfg.L,
                                     cache_format=fmt, kv_cache_scale=scale, out_dtype=out_dtype)
        e = ref.gather_cache_slots(x.kv_cache, x.slot_mapping, kv_lora_rank=cfg.L,
                                   cache_format=fmt, kv_cache_scale=scale, out_dtype=out_dtype)
        assert_bytes_equal(a, e)
    # The unfused primitives on the same inputs.
    u, v = x.clone(), y.clone()
    for lib_or_ref, z in ((mlakv, u), (ref, v)):
        lib_or_ref.concat_and_cache_mla(z.kv_c, z.k_pe, z.kv_cache, z.slot_mapping,
                                        cache_format=fmt, kv_cache_scale=scale)
        lib_or_ref.rotary_embedding(z.positions, z.q_pe, None, z.cos_sin_cache)
        lib_or_ref.decode_q_concat(z.ql_nope, z.q_pe, z.q_out[:z.Td])
        lib_or_ref.rms_norm(z.kv_c, z.kv_norm_weight, 1e-6, out=z.kv_c_out)
    for name in ("kv_cache", "q_pe", "q_out", "kv_c_out"):
        assert_bytes_equal(getattr(u, name), getattr(v, name))


def test_gather_wrappers_reject_a_cache_of_two_dims_by_name(device):
    """A cache that is not [num_blocks, block_size, entry] is the same named RuntimeError whether
    the op allocates the output or the wrapper does (error_counts given), never an IndexError."""
    cfg = TP8
    flat = mlakv.allocate_cache(4, 4, cfg.L, cfg.R, "bf16", device=device).view(16, -1)
    slots = torch.arange(3, device=device)
    counts = mlakv.new_error_counts(device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    cu = torch.tensor([0, 2], dtype=torch.int32, device=device)
    for kw in ({}, {"error_counts": counts}):
        with pytest.raises(RuntimeError, match="kv_cache: expected \\[num_blocks, block_size"):
            mlakv.gather_cache_slots(flat, slots, kv_lora_rank=cfg.L, cache_format="bf16", **kw)
        with pytest.raises(RuntimeError, match="kv_cache: expected \\[num_blocks, block_size"):
            mlakv.gather_cache_sequences(flat, table, cu, 2, kv_lora_rank=cfg.L,
                                         cache_format="bf16", **kw)


def test_gather_cache_sequences_past_the_block_table_width(device):
    """A sequence longer than its block table row: the rows past the table are zeros (and
    counted) in the op, and the reference gives the same bytes instead of an IndexError."""
    cfg = MINICPM3
    cache = mlakv.allocate_cache(4, 4, cfg.L, cfg.R, "bf16", device=device, fill=1)
    table = torch.tensor([[1]], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 9], dtype=torch.int32, device=device)
    counts = mlakv.new_error_counts(device)
    a = mlakv.gather_cache_sequences(cache, table, cu, 9, kv_lora_rank=cfg.L, cache_format="bf16",
                                     error_counts=counts)
    e = ref.gather_cache_sequences(cache, table, cu, 9, kv_lora_rank=cfg.L, cache_format="bf16")
    assert_bytes_equal(a, e)
    assert bool(a[:4].ne(0).all()) and not bool(a[4:].any())
    assert mlakv.read_error_counts(counts)["bad_block_index"] == 5


def test_gather_reference_with_out_and_a_negative_start(device):
    """mlakv.reference's gathers take the wrappers' out= (its dtype wins; the sequences' op writes
    only the covered rows), and skip a leading sequence of negative start as every backend does
    (ops.h), not wrap it around to the last rows."""
    cfg = MINICPM3
    g = torch.Generator().manual_seed(23)
    nb, bs = 4, 4
    cache = mlakv.allocate_cache(nb, bs, cfg.L, cfg.R, "bf16", device=device)
    kv_c = torch.randn(nb * bs, cfg.L, generator=g).to(torch.bfloat16).to(device)
    k_pe = torch.randn(nb * bs, cfg.R, generator=g).to(torch.bfloat16).to(device)
    mlakv.concat_and_cache_mla(kv_c, k_pe, cache, torch.arange(nb * bs, device=device),
                               cache_format="bf16")
    kw = dict(kv_lora_rank=cfg.L, cache_format="bf16")
    slots = torch.tensor([3, -1, 7], device=device)
    for op in (mlakv, ref):
        out = torch.full((5, cfg.L + cfg.R), 7.0, device=device)
        assert op.gather_cache_slots(cache, slots, out=out, **kw) is out
        if op is mlakv:
            got = out
        else:
            assert_bytes_equal(out, got)
    assert bool(got[3:].eq(7).all())  # rows past N untouched
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32, device=device)
    for cu in ([0, 3, 5], [-2, 3, 5]):
        cu = torch.tensor(cu, dtype=torch.int32, device=device)
        for op in (mlakv, ref):
            out = torch.full((7, cfg.L + cfg.R), 7.0, dtype=torch.bfloat16, device=device)
            assert op.gather_cache_sequences(cache, table, cu, out=out, **kw) is out
            fresh = op.gather_cache_sequences(cache, table, cu, 4, **kw)
            if op is mlakv:
                got, got_fresh = out, fresh
            else:
                assert_bytes_equal(out, got)
                assert_bytes_equal(fresh, got_fresh)
        covered = 5 if int(cu[0]) == 0 else 2  # a negative start: sequence 0 skipped whole
        assert bool(got[5:].eq(7).all()) and bool(got[:5 - covered].eq(7).all())
        assert not bool(got[5 - covered:5].eq(7).any())  # the covered rows hold cache entries


# ---- what the binding and the wrappers add -------------------------------------------------------
def test_padding_rows_of_every_per_token_input(device):
    """T is slot_mapping's length in the fused op and in concat_and_cache_mla: positions, kv_c and
    k_pe may all have graph-padding rows (here with positions past the table), never read."""
    cfg = TP8
    T, pad = 5, 3
    x = make_mla_inputs(cfg, "bf16", T=T, device=device, pad_rows=pad, seed=50)
    x.positions = torch.cat([x.positions, torch.full((pad,), 10 ** 6, device=device)])
    y = x.clone()
    counts = mlakv.new_error_counts(device)
    call_mla(mlakv.mla_rope_cache, x, "bf16", error_counts=counts)
    call_mla(ref.mla_rope_cache, y, "bf16")
    for name in ("kv_cache", "q_out", "q", "k_pe_out", "kv_c_out"):
        assert_bytes_equal(getattr(x, name), getattr(y, name))
    assert mlakv.read_error_counts(counts)["bad_position"] == 0
    u, v = x.clone(), y.clone()
    mlakv.concat_and_cache_mla(u.kv_c, u.k_pe, u.kv_cache, u.slot_mapping, cache_format="bf16",
                               error_counts=counts)
    ref.concat_and_cache_mla(v.kv_c, v.k_pe, v.kv_cache, v.slot_mapping, cache_format="bf16")
    assert_bytes_equal(u.kv_cache, v.kv_cache)


def test_eps_reaches_the_norms(device):
    """A non-default eps is applied by the fused op and by rms_norm (with eps of the order of the
    mean square, the result differs from the default eps's)."""
    cfg = MINICPM3
    x = make_mla_inputs(cfg, "bf16", device=device, seed=51)
    y, z = x.clone(), x.clone()
    call_mla(mlakv.mla_rope_cache, x, "bf16", kv_norm_eps=0.5)
    call_mla(ref.mla_rope_cache, y, "bf16", kv_norm_eps=0.5)
    call_mla(ref.mla_rope_cache, z, "bf16")
    assert_bytes_equal(x.kv_cache, y.kv_cache)
    assert_bytes_equal(x.kv_c_out, y.kv_c_out)
    assert not torch.equal(y.kv_c_out, z.kv_c_out)
    out = mlakv.rms_norm(x.kv_c, x.kv_norm_weight, 0.5)
    assert_bytes_equal(out, ref.rms_norm(x.kv_c, x.kv_norm_weight, 0.5))
    assert not torch.equal(out, ref.rms_norm(x.kv_c, x.kv_norm_weight, 1e-6))


def test_fp8_is_fp8_e4m3_everywhere(device):
    """The format name "fp8" means fp8_e4m3 in the ops (raw and wrapped) and in the gathers."""
    cfg = MINICPM3
    x = make_mla_inputs(cfg, "fp8_e4m3", device=device, seed=52)
    y, z = x.clone(), x.clone()
    torch.ops.mlakv.concat_and_cache_mla(x.kv_c, x.k_pe, x.kv_cache, x.slot_mapping, "fp8",
                                         x.kv_cache_scale)
    mlakv.concat_and_cache_mla(y.kv_c, y.k_pe, y.kv_cache, y.slot_mapping,
                               cache_format="fp8_e4m3", kv_cache_scale=y.kv_cache_scale)
    mlakv.concat_and_cache_mla(z.kv_c, z.k_pe, z.kv_cache, z.slot_mapping,
                               cache_format="fp8_e5m2", kv_cache_scale=z.kv_cache_scale)
    assert_bytes_equal(x.kv_cache, y.kv_cache)
    assert not torch.equal(x.kv_cache, z.kv_cache)
    for kw in ({}, {"error_counts": mlakv.new_error_counts(device)}):
        a = mlakv.gather_cache_slots(x.kv_cache, x.slot_mapping, kv_lora_rank=cfg.L,
                                     cache_format="fp8", kv_cache_scale=x.kv_cache_scale, **kw)
        e = ref.gather_cache_slots(x.kv_cache, x.slot_mapping, kv_lora_rank=cfg.L,
                                   cache_format="fp8_e4m3", kv_cache_scale=x.kv_cache_scale)
        assert_bytes_equal(a, e)
    assert mlakv.cache_latent_dtype("fp8") == torch.float8_e4m3fn
    # The parts' element types: fp8_ds_mla's rope part is bf16, the others' the latent's.
    assert mlakv.cache_rope_dtype("fp8_ds_mla") == torch.bfloat16
    assert mlakv.cache_rope_dtype("fp8") == torch.float8_e4m3fn
    assert mlakv.cache_rope_dtype("fp16") == torch.float16


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2"])
def test_gathers_take_the_format_of_a_typed_cache(fmt, device):
    """cache_format="auto" in the gather wrappers reads a typed cache in its dtype's format."""
    cfg = MINICPM3
    x = make_mla_inputs(cfg, fmt, device=device, seed=53)
    scale = x.kv_cache_scale if fmt in FP8_FORMATS else None
    mlakv.concat_and_cache_mla(x.kv_c, x.k_pe, x.kv_cache, x.slot_mapping, cache_format=fmt,
                               kv_cache_scale=scale)
    typed = x.kv_cache.view(mlakv.cache_latent_dtype(fmt))
    e = ref.gather_cache_slots(x.kv_cache, x.slot_mapping, kv_lora_rank=cfg.L, cache_format=fmt,
                               kv_cache_scale=scale)
    for kw in ({}, {"error_counts": mlakv.new_error_counts(device)}):
        a = mlakv.gather_cache_slots(typed, x.slot_mapping, kv_lora_rank=cfg.L,
                                     kv_cache_scale=scale, **kw)
        assert_bytes_equal(a, e)


def test_gathers_of_a_split_cache(device):
    """A split cache (latent + rope tensors) reads back as the combined one, whether the op or
    the wrapper (error_counts given) allocates the output; a kv_lora_rank that is not the latent
    tensor's width is rejected by name."""
    cfg = MINICPM3
    x = make_mla_inputs(cfg, "bf16", device=device, seed=54)
    nb, bs = x.kv_cache.shape[:2]
    latent = torch.full((nb, bs, cfg.L), 1.5, dtype=torch.bfloat16, device=device)
    rope = torch.full((nb, bs, cfg.R), 2.5, dtype=torch.bfloat16, device=device)
    combined = torch.full((nb, bs, cfg.L + cfg.R), 1.5, dtype=torch.bfloat16, device=device)
    combined[:, :, cfg.L:] = 2.5
    mlakv.concat_and_cache_mla(x.kv_c, x.k_pe, latent, x.slot_mapping, kv_cache_rope=rope)
    mlakv.concat_and_cache_mla(x.kv_c, x.k_pe, combined, x.slot_mapping)
    slots = torch.arange(nb * bs, device=device)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=device)
    table = torch.tensor([[1, 0], [3, 2]], dtype=torch.int32, device=device)
    for kw in ({}, {"error_counts": mlakv.new_error_counts(device)}):
        a = mlakv.gather_cache_slots(latent, slots, kv_lora_rank=cfg.L, kv_cache_rope=rope, **kw)
        assert_bytes_equal(a, mlakv.gather_cache_slots(combined, slots, kv_lora_rank=cfg.L))
        a = mlakv.gather_cache_sequences(latent, table, cu, 7, kv_lora_rank=cfg.L,
                                         kv_cache_rope=rope, **kw)
        assert_bytes_equal(a, mlakv.gather_cache_sequences(combined, table, cu, 7,
                                                           kv_lora_rank=cfg.L))
    with pytest.raises(RuntimeError, match="kv_cache: expected a latent part of 128 values"):
        torch.ops.mlakv.gather_cache_slots(latent, "bf16", None, rope, slots, 128, torch.float32)


def test_binding_rejects_what_the_core_cannot_see(device):
    """Arguments the binding checks itself (the core gets only pointers and strides), each named,
    nothing written."""
    cfg = TP8
    x = make_mla_inputs(cfg, "fp8_e4m3", T=4, device=device, seed=55)
    before = x.kv_cache.clone()

    def concat(cache=x.kv_cache, fmt="fp8_e4m3", k_pe=x.k_pe, **kw):
        kw.setdefault("kv_cache_scale", x.kv_cache_scale)
        mlakv.concat_and_cache_mla(x.kv_c, k_pe, cache, x.slot_mapping, cache_format=fmt, **kw)

    with pytest.raises(RuntimeError, match="kv_cache_scale: expected at least one element"):
        concat(kv_cache_scale=x.kv_cache_scale[:0])
    with pytest.raises(RuntimeError, match="error_counts: expected a contiguous tensor of at "
                                           "least 4 elements"):
        concat(error_counts=mlakv.new_error_counts(device)[:2])
    # An entry with an innermost stride of 2 (the core sees only block and token strides).
    wide = torch.zeros(4, 4, 2 * x.kv_cache.shape[2], dtype=torch.uint8, device=device)
    with pytest.raises(RuntimeError, match="kv_cache: expected a contiguous entry"):
        concat(cache=wide[:, :, ::2])
    assert not wide.any()
    # A k_pe of several heads is not vLLM's [T, 1, R].
    with pytest.raises(RuntimeError, match="k_pe"):
        concat(k_pe=torch.stack([x.k_pe, x.k_pe], dim=1))
    assert torch.equal(x.kv_cache, before), "a rejected op must write nothing"
    # fp8_ds_mla is a byte cache only, even with e4m3 elements of the right count.
    ds = torch.zeros(4, 4, 656, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    kv_c = x.kv_c.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="fp8_ds_mla cache is a uint8 byte tensor"):
        mlakv.concat_and_cache_mla(kv_c, x.k_pe, ds, x.slot_mapping, cache_format="fp8_ds_mla")
    assert not ds.view(torch.uint8).any()
    # q_scale without q_out would be ignored.
    y = make_mla_inputs(cfg, "bf16", T=4, device=device, seed=56)
    before = y.kv_cache.clone()
    with pytest.raises(RuntimeError, match="q_scale: given without q_out"):
        call_mla(mlakv.mla_rope_cache, y, "bf16", decode=False, q_scale=x.kv_cache_scale)
    assert torch.equal(y.kv_cache, before)
    # A device Td that is not an int32 count (its first element is read).
    for td in (torch.zeros(0, dtype=torch.int32, device=device), torch.zeros(1, device=device)):
        with pytest.raises(RuntimeError, match="num_decode_tokens_device: expected an int32 "
                                               "tensor of at least one element"):
            call_mla(mlakv.mla_rope_cache, y, "bf16", num_decode_tokens_device=td)
    assert torch.equal(y.kv_cache, before)
    # A 3-D query whose heads are not head_size wide.
    q_pe = y.q_pe.clone()
    with pytest.raises(RuntimeError, match="query: expected head_size 32, got 64"):
        mlakv.rotary_embedding(y.positions, q_pe, None, y.cos_sin_cache[:, :32], head_size=32)
    assert torch.equal(q_pe, y.q_pe)
    # The functional gather (no error_counts) names a negative row count like the wrapper does.
    with pytest.raises(RuntimeError, match="mlakv: num_out_rows: expected >= 0, got -1"):
        mlakv.gather_cache_sequences(y.kv_cache, torch.zeros(1, 1, dtype=torch.int32,
                                                              device=device),
                                     torch.tensor([0, 1], dtype=torch.int32, device=device), -1,
                                     kv_lora_rank=cfg.L, cache_format="bf16")


def test_allocate_cache(device):
    """A new cache is zeros (every format reads back zeros), or every byte `fill`; fp8_ds_mla
    exists for L = 512, R = 64 only and as bytes only."""
    cfg = TP8
    slots = torch.arange(8, device=device)
    for fmt in ["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla"]:
        cache = mlakv.allocate_cache(2, 4, cfg.L, cfg.R, fmt, device=device)
        assert cache.shape == (2, 4, mlakv.cache_entry_bytes(fmt, cfg.L, cfg.R))
        assert cache.dtype == torch.uint8 and not cache.any()
        got = mlakv.gather_cache_slots(cache, slots, kv_lora_rank=cfg.L, cache_format=fmt)
        assert torch.equal(got, torch.zeros(8, cfg.L + cfg.R, device=device))
        assert bool((mlakv.allocate_cache(2, 4, cfg.L, cfg.R, fmt, device=device,
                                          fill=SENTINEL) == SENTINEL).all())
    with pytest.raises(ValueError, match="fp8_ds_mla needs L = 512 and R = 64"):
        mlakv.allocate_cache(2, 4, 256, 32, "fp8_ds_mla")
    with pytest.raises(ValueError, match="uint8 byte tensor only"):
        mlakv.allocate_cache(2, 4, cfg.L, cfg.R, "fp8_ds_mla", typed=True)


def test_decode_and_prefill_wrappers_set_td(device):
    """mla_rope_cache_decode is Td = T and mla_rope_cache_prefill Td = 0, also when a device Td
    is passed along (it is dropped, as the C++ entry points have none)."""
    cfg = TP8
    T = 5
    td = torch.tensor([2], dtype=torch.int32, device=device)
    x = make_mla_inputs(cfg, "bf16", T=T, Td=T, device=device, seed=57)
    y = x.clone()
    call_mla(mlakv.mla_rope_cache_decode, x, "bf16", prefill=False, num_decode_tokens_device=td)
    call_mla(ref.mla_rope_cache, y, "bf16", prefill=False)
    for name in ("kv_cache", "q_out"):
        assert_bytes_equal(getattr(x, name), getattr(y, name))
    x = make_mla_inputs(cfg, "bf16", T=T, Td=0, device=device, seed=58)
    y = x.clone()
    call_mla(mlakv.mla_rope_cache_prefill, x, "bf16", decode=False, num_decode_tokens_device=td)
    call_mla(ref.mla_rope_cache, y, "bf16", decode=False)
    for name in ("kv_cache", "q"):
        assert_bytes_equal(getattr(x, name), getattr(y, name))


# ---- the caller's floating-point environment ---------------------------------------------------
@contextlib.contextmanager
def _caller_float_env(upward=False, flush_denormal=False):
    """This thread with the rounding mode upward (glibc fesetround; x86-64's FE_UPWARD) and/or
    flush-to-zero + denormals-are-zero (torch.set_flush_denormal), put back afterwards."""
    libc = ctypes.CDLL(None)
    try:
        if upward:
            assert libc.fesetround(0x800) == 0
        if flush_denormal:
            assert torch.set_flush_denormal(True)
        yield
    finally:
        libc.fesetround(0)
        torch.set_flush_denormal(False)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64's fenv constants")
def test_float_arguments_round_to_nearest_in_any_environment(device):
    """The binding turns a schema's float (a double: eps, scale_floor) into the core's float rounded
    to nearest, whatever rounding mode or flush-to-zero the calling thread has: upward rounding
    would move eps = 1e-6 up an ulp, and flush-to-zero would make eps = 1e-40 zero (an all-zero
    row then normalizes to NaN instead of 0)."""
    g = torch.Generator().manual_seed(40)
    x = (torch.randn(6, 512, generator=g) * 1e-5).to(device)
    w = torch.ones(512, device=device)
    zeros = torch.zeros(6, 512, device=device)

    def run():
        return (mlakv.rms_norm(x, w, 1e-6),
                mlakv.rms_norm(zeros, w, 1e-40),
                *mlakv.rmsnorm_quant(zeros, w, 1e-40, scale_floor=1.2345678e-38),
                *mlakv.rmsnorm_quant(x, w, 1e-6, scale_floor=1e-10 / 448))

    want = run()
    assert not torch.isnan(want[1]).any()
    for upward, flush in ((True, False), (False, True), (True, True)):
        with _caller_float_env(upward, flush):
            got = run()
        for a, b in zip(got, want):
            assert_bytes_equal(a, b)
