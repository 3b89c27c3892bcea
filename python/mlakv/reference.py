"""A pure-PyTorch reference of every mlakv op, written from DESIGN.md, not from the C++ code.

The functions take the same arguments as the wrappers in ``mlakv.ops`` and write their outputs the
same way (in place), so a test runs both on cloned inputs and compares. Math follows the contract:

* RoPE in fp32 with fma semantics: ``x' = fma(x, c, -(y*s))``, ``y' = fma(y, c, x*s)``, rounded
  once to the output dtype. The fma is emulated exactly in float64 (see ``fma_f32``).
* RMSNorm: the fp32 sum of squares in the library's documented order (docs/rmsnorm_quant.md: the
  pairwise tree over the row padded with +0 to a power of two), then ``x * rsqrt(mean + eps) * w``
  in fp32 steps (the square root and the reciprocal correctly rounded), rounded once: the
  kernels' bytes exactly.
* FP8: saturating round-to-nearest-even (clamp to +-max first: torch's casts do not saturate),
  NaN as below; stored value = ``cvt(x / scale)`` with the value first rounded to the model dtype.
* NaN: a computed or converted output that is NaN has the library's canonical encoding
  (docs/decisions.md "Encoders"): 0x7fff for bf16 / fp16, 0x7fffffff for fp32, 0x7f for fp8,
  whatever the sign and payload (torch's casts keep the sign, fp32 the payload too): see
  ``encode``. A value moved into a tensor of its own dtype (kv_c into a cache of the model dtype,
  ql_nope into q_out) is copied, its bytes kept, as the library does.
* fp8_ds_mla: per tile of 128, scale = ``max(amax / 448, FLT_MIN)`` (optionally rounded up to a
  power of two; the amax ignores NaN, as the library's does), 512 e4m3 bytes, 4 fp32 scales, 64
  bf16 rope values.
* rmsnorm_quant (docs/rmsnorm_quant.md): ``s = round(x + residual)``, ``y = round(RMSNorm(s))``,
  per group ``scale = max(amax / 448, floor)`` (amax ignoring NaN; default floor ``1e-10 / 448``;
  optionally rounded up to a power of two), ``q = e4m3(y / scale)``. These functions return their
  outputs, allocated when not given, as the wrappers do.
"""

from typing import Optional

import torch

from mlakv.cache import (DS_MLA_LATENT_DIM, DS_MLA_NUM_TILES, DS_MLA_TILE, canonical_format,
                         cache_latent_dtype)

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FLT_MIN = torch.finfo(torch.float32).tiny


# ---- numerics ----------------------------------------------------------------------------------
def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``fma(a, b, c)`` of float32 tensors with one rounding, emulated in float64.

    ``a * b`` is exact in float64 (48 significant bits). The float64 sum ``s = a*b + c`` may round;
    TwoSum gives its exact error ``e``. Rounding ``s + e`` to odd in float64 (53 bits) and then to
    nearest-even in float32 (24 bits) equals a single correct rounding, since 53 >= 24 + 2."""
    prod = a.double() * b.double()
    cc = c.double()
    s = prod + cc
    bb = s - prod
    err = (prod - (s - bb)) + (cc - bb)
    inexact = err != 0
    s_is_odd = (s.view(torch.int64) & 1) == 1
    inf = torch.full_like(s, float("inf"))
    toward = torch.where(err > 0, inf, -inf)
    s_odd = torch.where(inexact & ~s_is_odd, torch.nextafter(s, toward), s)
    return s_odd.to(torch.float32)


def rope_rotate(x: torch.Tensor, y: torch.Tensor, c: torch.Tensor, s: torch.Tensor):
    """One rotation in fp32: ``(fma(x, c, -(y*s)), fma(y, c, x*s))``; float32 in and out."""
    return fma_f32(x, c, -(y * s)), fma_f32(y, c, x * s)


# The library's NaN encodings (docs/decisions.md "Encoders"): the bits of every NaN output.
_CANONICAL_NAN = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.bfloat16: (torch.int16, 0x7FFF),
                  torch.float16: (torch.int16, 0x7FFF), torch.float8_e4m3fn: (torch.uint8, 0x7F),
                  torch.float8_e5m2: (torch.uint8, 0x7F)}


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 -> dtype, rounded to nearest-even (fp8: saturating, +-inf too), every NaN as the
    library's canonical NaN of dtype."""
    out = (x.clamp(-FP8_MAX[dtype], FP8_MAX[dtype]) if dtype in FP8_MAX else x).to(dtype)
    nan = torch.isnan(x)
    if bool(nan.any()):
        int_type, bits = _CANONICAL_NAN[dtype]
        out = torch.where(nan, torch.tensor(bits, dtype=int_type), out.view(int_type)).view(dtype)
    return out


def _index(t: torch.Tensor, n: int) -> torch.Tensor:
    return t[:n].to(torch.int64).cpu()


def cos_sin_rows(cos_sin_cache: torch.Tensor, positions: torch.Tensor):
    """(cos, sin) float32 ``[T, R/2]`` at the positions, clamped into the table."""
    max_pos = cos_sin_cache.shape[0]
    half = cos_sin_cache.shape[1] // 2
    pos = positions.to(torch.int64).clamp(0, max_pos - 1)
    rows = cos_sin_cache.float().cpu()[pos.cpu()]
    return rows[:, :half], rows[:, half:]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool):
    """RoPE of ``x [T, ..., R]`` (float32) with ``cos/sin [T, R/2]``; float32, not rounded."""
    R = x.shape[-1]
    half = R // 2
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [half]
    c = cos.reshape(shape)
    s = sin.reshape(shape)
    if is_neox:
        first, second = x[..., :half], x[..., half:]
    else:
        first, second = x[..., 0::2], x[..., 1::2]
    a, b = rope_rotate(first, second, c, s)
    out = torch.empty_like(x)
    if is_neox:
        out[..., :half], out[..., half:] = a, b
    else:
        out[..., 0::2], out[..., 1::2] = a, b
    return out


def tree_sum_squares(s: torch.Tensor) -> torch.Tensor:
    """fp32 sum of the squares of ``s [T, N]`` (float32) as the complete binary tree over the index,
    the row padded with +0 to a power of two (RMSNorm's documented order), as [T, 1]."""
    sq = s * s
    T, N = sq.shape
    width = 1 << (N - 1).bit_length()  # N rounded up to a power of two
    if width > N:
        sq = torch.cat([sq, sq.new_zeros(T, width - N)], dim=1)  # + 0.0 leaves every sum unchanged
    while sq.shape[1] > 1:
        sq = sq[:, 0::2] + sq[:, 1::2]  # one level: elements 2j and 2j + 1 into element j
    return sq


def rms_norm_values(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [T, N]`` as float32 values, before rounding to the output dtype."""
    xf = x.float().cpu()
    mean = tree_sum_squares(xf) / xf.shape[-1]
    # sqrt and 1 / x in float64, rounded once to float32: the correctly rounded fp32 results (53 >=
    # 2 * 24 + 2 bits). torch's own fp32 sqrt on the CPU is not always (1 ulp off for some inputs:
    # torch 2.11, AVX-512).
    root = torch.sqrt((mean + torch.tensor(eps, dtype=torch.float32)).double()).float()
    inv = (1.0 / root.double()).float()
    return (xf * inv) * weight.float().cpu()


# ---- cache encoding ----------------------------------------------------------------------------
def pow2_round_up(scale: torch.Tensor) -> torch.Tensor:
    """Positive normal float32 scales rounded up to a power of two (inf stays inf)."""
    bits = scale.view(torch.int32)
    exp = bits & 0x7F800000
    needs = ((bits & 0x007FFFFF) != 0) & (exp != 0x7F800000)
    return torch.where(needs, exp + 0x00800000, bits).view(torch.float32)


def amax_ignoring_nan(v: torch.Tensor) -> torch.Tensor:
    """max |v| over the last dimension, NaN ignored (a group of NaN only gives 0)."""
    mag = v.abs()
    return torch.where(torch.isnan(mag), torch.zeros_like(mag), mag).amax(-1)


def ds_mla_tile_scale(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    scale = amax / 448.0
    scale = torch.where(scale >= FLT_MIN, scale, torch.full_like(scale, FLT_MIN))
    return pow2_round_up(scale) if pow2 else scale


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: itself (its bytes) when it has that dtype, else ``encode``d."""
    return t if t.dtype == dtype else encode(t.float(), dtype)


def encode_entries(kv_c: torch.Tensor, k_pe: torch.Tensor, cache_format: str,
                   scale: Optional[float] = None, pow2: bool = False) -> torch.Tensor:
    """Cache entries as bytes ``[T, entry_bytes]`` from model-dtype tensors (``kv_c [T, L]``,
    rotated ``k_pe [T, R]``)."""
    fmt = canonical_format(cache_format)
    T = kv_c.shape[0]
    if fmt == "fp8_ds_mla":
        tiles = kv_c.float().reshape(T, DS_MLA_NUM_TILES, DS_MLA_TILE)
        scales = ds_mla_tile_scale(amax_ignoring_nan(tiles), pow2)  # [T, 4]
        q = encode(tiles / scales.unsqueeze(-1), torch.float8_e4m3fn).reshape(T, DS_MLA_LATENT_DIM)
        rope = _cast(k_pe, torch.bfloat16)
        return torch.cat([q.view(torch.uint8), scales.contiguous().view(torch.uint8),
                          rope.contiguous().view(torch.uint8)], dim=-1)
    values = torch.cat([kv_c, k_pe], dim=-1)
    dtype = cache_latent_dtype(fmt)
    if dtype in FP8_MAX:
        s = torch.tensor(1.0 if scale is None else scale, dtype=torch.float32)
        return encode(values.float() / s, dtype).view(torch.uint8)
    return _cast(values, dtype).contiguous().view(torch.uint8)


def decode_entries(entries: torch.Tensor, cache_format: str, L: int, R: int,
                   scale: Optional[float] = None) -> torch.Tensor:
    """Bytes ``[N, entry_bytes]`` -> float32 ``[N, L + R]`` (dequantized, fp32 products)."""
    fmt = canonical_format(cache_format)
    N = entries.shape[0]
    entries = entries.contiguous()
    if fmt == "fp8_ds_mla":
        q = entries[:, :DS_MLA_LATENT_DIM].view(torch.float8_e4m3fn).float()
        scales = entries[:, DS_MLA_LATENT_DIM:DS_MLA_LATENT_DIM + 16].contiguous().view(
            torch.float32)
        rope = entries[:, DS_MLA_LATENT_DIM + 16:].contiguous().view(torch.bfloat16).float()
        latent = (q.reshape(N, DS_MLA_NUM_TILES, DS_MLA_TILE) * scales.unsqueeze(-1)).reshape(
            N, DS_MLA_LATENT_DIM)
        return torch.cat([latent, rope], dim=-1)
    dtype = cache_latent_dtype(fmt)
    values = entries.view(dtype).float()
    if dtype in FP8_MAX:
        values = values * torch.tensor(1.0 if scale is None else scale, dtype=torch.float32)
    return values


def _scale_value(t: Optional[torch.Tensor]) -> Optional[float]:
    return None if t is None else float(t.reshape(-1)[0].item())


def _cache_rows(kv_cache: torch.Tensor, kv_cache_rope: Optional[torch.Tensor]):
    """(latent bytes ``[num_slots, *]``, rope bytes or None) of a cache, on the CPU."""
    nb, bs = kv_cache.shape[0], kv_cache.shape[1]
    latent = kv_cache.cpu().contiguous().view(torch.uint8).reshape(nb * bs, -1)
    rope = None
    if kv_cache_rope is not None:
        rope = kv_cache_rope.cpu().contiguous().view(torch.uint8).reshape(nb * bs, -1)
    return latent, rope


def _write_back(kv_cache: torch.Tensor, latent: torch.Tensor, kv_cache_rope, rope):
    kv_cache.copy_(latent.reshape(kv_cache.shape[0], kv_cache.shape[1], -1).view(kv_cache.dtype)
                   .to(kv_cache.device))
    if kv_cache_rope is not None:
        kv_cache_rope.copy_(rope.reshape(kv_cache_rope.shape[0], kv_cache_rope.shape[1], -1)
                            .view(kv_cache_rope.dtype).to(kv_cache_rope.device))


def write_cache(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_c_vals: torch.Tensor,
                k_pe_vals: torch.Tensor, cache_format: str,
                kv_cache_scale: Optional[torch.Tensor] = None,
                kv_cache_rope: Optional[torch.Tensor] = None, pow2: bool = False):
    """Writes the entries of model-dtype tensors ``kv_c_vals [T, L]``, ``k_pe_vals [T, R]`` (on
    the CPU) at the slots; slot < 0 and slots past the cache are skipped."""
    fmt = canonical_format(cache_format, kv_cache)
    T = slot_mapping.shape[0]
    L = kv_c_vals.shape[-1]
    entries = encode_entries(kv_c_vals, k_pe_vals, fmt, _scale_value(kv_cache_scale), pow2)
    latent, rope = _cache_rows(kv_cache, kv_cache_rope)
    num_slots = latent.shape[0]
    slots = _index(slot_mapping, T)
    latent_bytes = L * cache_latent_dtype(fmt).itemsize if kv_cache_rope is not None else None
    for t in range(T):
        s = int(slots[t])
        if s < 0 or s >= num_slots:
            continue
        if kv_cache_rope is None:
            latent[s] = entries[t]
        else:
            latent[s] = entries[t, :latent_bytes]
            rope[s] = entries[t, latent_bytes:]
    _write_back(kv_cache, latent, kv_cache_rope, rope)


# ---- the ops -----------------------------------------------------------------------------------
def mla_rope_cache(positions, slot_mapping, cos_sin_cache, kv_c, k_pe, kv_cache, *,
                   cache_format="auto", kv_cache_scale=None, kv_cache_rope=None, is_neox=False,
                   kv_norm_weight=None, kv_norm_eps=1e-6, k_pe_out=None, kv_c_out=None,
                   q_pe=None, ql_nope=None, q_out=None, q_scale=None, q=None, q_prefill_out=None,
                   num_decode_tokens=0, num_decode_tokens_device=None, error_counts=None,
                   ds_mla_pow2_scale=False) -> None:
    """Reference of ``mlakv.mla_rope_cache`` (same arguments; error counters are not kept, and
    argument errors are the library's to report: beside a device Td the host one is not read)."""
    T = slot_mapping.shape[0]
    model = kv_c.dtype
    if num_decode_tokens_device is not None:
        Td = int(num_decode_tokens_device.reshape(-1)[0].item())
        Td = min(max(Td, 0), T)
    else:
        Td = int(num_decode_tokens)
    cos, sin = cos_sin_rows(cos_sin_cache, positions[:T])
    if k_pe.dim() == 3:
        k_pe = k_pe[:, 0]

    # K side.
    # Model-dtype tensors on the CPU: normalized (or copied) kv_c and rotated k_pe.
    if kv_norm_weight is not None:
        kv_vals = encode(rms_norm_values(kv_c[:T], kv_norm_weight, kv_norm_eps), model)
    else:
        kv_vals = kv_c[:T].cpu()
    k_vals = encode(apply_rope(k_pe[:T].float().cpu(), cos, sin, is_neox), model)
    write_cache(kv_cache, slot_mapping, kv_vals, k_vals, cache_format, kv_cache_scale,
                kv_cache_rope, ds_mla_pow2_scale)
    if k_pe_out is not None:
        dst = k_pe_out[:, 0] if k_pe_out.dim() == 3 else k_pe_out
        dst[:T].copy_(k_vals)
    if kv_c_out is not None:
        kv_c_out[:T].copy_(kv_vals)

    # Decode Q side.
    if q_out is not None and Td > 0:
        L = q_out.shape[-1] - q_pe.shape[-1]
        rope = encode(apply_rope(q_pe[:Td].float().cpu(), cos[:Td], sin[:Td], is_neox), model)
        if q_out.dtype in FP8_MAX:  # the library requires ql_nope here
            vals = torch.cat([ql_nope[:Td].float().cpu(), rope.float()], dim=-1)
            s = torch.tensor(1.0 if q_scale is None else _scale_value(q_scale))
            q_out[:Td].copy_(encode(vals / s, q_out.dtype))
        else:  # q_out has the model dtype: ql_nope (when given) is copied as it is
            if ql_nope is not None:
                q_out[:Td, :, :L].copy_(ql_nope[:Td])
            q_out[:Td, :, L:].copy_(rope)

    # Prefill Q side.
    if q is not None and Td < T:
        R = cos_sin_cache.shape[1]
        head = q[Td:T].float().cpu()
        rope = encode(apply_rope(head[..., -R:], cos[Td:], sin[Td:], is_neox), model)
        dst = q if q_prefill_out is None else q_prefill_out
        if q_prefill_out is not None:
            dst[Td:T, :, :-R].copy_(q[Td:T, :, :-R])
        dst[Td:T, :, -R:].copy_(encode(rope, dst.dtype))


def rotary_embedding(positions, query, key, cos_sin_cache, *, is_neox=False, head_size=None,
                     error_counts=None) -> None:
    """Reference of ``mlakv.rotary_embedding``."""
    T = positions.shape[0]
    rot = cos_sin_cache.shape[1]
    if head_size is None:  # as the op: a 3-D query gives the head size of a 2-D key
        head_size = query.shape[-1]
    cos, sin = cos_sin_rows(cos_sin_cache, positions[:T])
    for t in (query, key):
        if t is None:
            continue
        view = t if t.dim() == 3 else t.view(t.shape[0], -1, head_size)
        vals = view[:T, :, :rot].float().cpu()
        view[:T, :, :rot].copy_(encode(apply_rope(vals, cos, sin, is_neox), t.dtype))


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, *, cache_format="auto",
                         kv_cache_scale=None, kv_cache_rope=None, error_counts=None,
                         ds_mla_pow2_scale=False) -> None:
    """Reference of ``mlakv.concat_and_cache_mla``."""
    T = slot_mapping.shape[0]
    if k_pe.dim() == 3:
        k_pe = k_pe[:, 0]
    write_cache(kv_cache, slot_mapping, kv_c[:T].cpu(), k_pe[:T].cpu(), cache_format,
                kv_cache_scale, kv_cache_rope, ds_mla_pow2_scale)


def decode_q_concat(ql_nope, q_pe, q_out, *, q_scale=None) -> None:
    """Reference of ``mlakv.decode_q_concat``."""
    T = q_out.shape[0]
    if q_out.dtype in FP8_MAX:
        vals = torch.cat([ql_nope[:T].float(), q_pe[:T].float()], dim=-1)
        s = torch.tensor(1.0 if q_scale is None else _scale_value(q_scale))
        q_out.copy_(encode(vals.cpu() / s, q_out.dtype).to(q_out.device))
    else:  # the model dtype: both parts copied as they are
        L = ql_nope.shape[-1]
        q_out[:, :, :L].copy_(ql_nope[:T])
        q_out[:, :, L:].copy_(q_pe[:T])


def rms_norm(input, weight, eps=1e-6, *, out=None):
    """Reference of ``mlakv.rms_norm``."""
    vals = encode(rms_norm_values(input, weight, eps), input.dtype).to(input.device)
    if out is None:
        return vals
    out[:input.shape[0]].copy_(vals)
    return out


def _gather(kv_cache, slots, kv_lora_rank, cache_format, kv_cache_scale, kv_cache_rope,
            out_dtype):
    fmt = canonical_format(cache_format, kv_cache)
    latent, rope = _cache_rows(kv_cache, kv_cache_rope)
    num_slots = latent.shape[0]
    L = kv_lora_rank
    scale = _scale_value(kv_cache_scale)
    if cache_latent_dtype(fmt) == out_dtype and fmt != "fp8_ds_mla":
        # Values of the output's own dtype are copied, their bytes kept (NaN payloads too).
        parts = [latent] if rope is None else [latent, rope]
        values = torch.cat([p.view(out_dtype) for p in parts], dim=-1)
    elif rope is None:
        values = encode(decode_entries(latent, fmt, L, None, scale), out_dtype)
    else:
        values = encode(torch.cat([decode_entries(latent, fmt, L, None, scale),
                                   decode_entries(rope, fmt, L, None, scale)], dim=-1), out_dtype)
    out = torch.zeros(slots.shape[0], values.shape[-1], dtype=out_dtype)
    for i, s in enumerate(slots.tolist()):
        if 0 <= s < num_slots:
            out[i] = values[s]
    return out


def gather_cache_slots(kv_cache, slots, *, kv_lora_rank, cache_format="auto",
                       kv_cache_scale=None, kv_cache_rope=None, out_dtype=torch.float32, out=None,
                       error_counts=None) -> torch.Tensor:
    """Reference of ``mlakv.gather_cache_slots`` (result on the cache's device; with ``out``, its
    first N rows written, its dtype winning, and ``out`` returned)."""
    rows = _gather(kv_cache, slots.cpu().to(torch.int64), kv_lora_rank, cache_format,
                   kv_cache_scale, kv_cache_rope, out.dtype if out is not None else out_dtype)
    if out is None:
        return rows.to(kv_cache.device)
    out[:rows.shape[0]].copy_(rows)
    return out


def gather_cache_sequences(kv_cache, block_table, cu_seq_lens, num_out_rows=None, *, kv_lora_rank,
                           cache_format="auto", kv_cache_scale=None, kv_cache_rope=None,
                           out_dtype=torch.float32, out=None, error_counts=None) -> torch.Tensor:
    """Reference of ``mlakv.gather_cache_sequences`` (with ``out``: ``num_out_rows`` is its row
    count, only the rows a sequence covers are written, and ``out`` is returned; the wrapper's
    argument checks are its own, not repeated here)."""
    nb, bs = kv_cache.shape[0], kv_cache.shape[1]
    if out is not None:
        num_out_rows, out_dtype = out.shape[0], out.dtype
    cu = cu_seq_lens.cpu().tolist()
    table = block_table.cpu().to(torch.int64)
    slots = torch.full((num_out_rows,), -1, dtype=torch.int64)
    covered = torch.zeros(num_out_rows, dtype=torch.bool)
    for b in range(len(cu) - 1):
        if cu[b] < 0:   # a negative start (outside the contract): the sequence is skipped (ops.h)
            continue
        for i in range(cu[b + 1] - cu[b]):
            row = cu[b] + i
            if row >= num_out_rows:
                break
            covered[row] = True
            if i // bs >= table.shape[1]:  # past the block table's width: a zero row
                continue
            block = int(table[b, i // bs])
            if 0 <= block < nb:
                slots[row] = block * bs + i % bs
    rows = _gather(kv_cache, slots, kv_lora_rank, cache_format, kv_cache_scale, kv_cache_rope,
                   out_dtype)
    if out is None:
        return rows.to(kv_cache.device)
    out[covered.to(out.device)] = rows[covered].to(out.device)
    return out


# ---- RMSNorm + fp8 per-token-group quantization (docs/rmsnorm_quant.md) ------------------------
# vLLM's and DeepGEMM's scales: max(amax, 1e-10) / 448 == max(amax / 448, 1e-10 / 448).
DEFAULT_SCALE_FLOOR = float(torch.tensor(1e-10, dtype=torch.float32) / 448.0)


def group_quant_values(y: torch.Tensor, group_size: int, scale_floor: Optional[float] = None,
                       pow2_scale: bool = False):
    """e4m3 values ``[T, N]`` and fp32 scales ``[T, N / group_size]`` of ``y [T, N]`` (model
    dtype), on the CPU: ``scale = max(amax / 448, floor)`` (amax ignoring NaN; rounded up to a
    power of two with ``pow2_scale``), ``q = e4m3(y / scale)``."""
    T, N = y.shape
    v = y.cpu().float().view(T, N // group_size, group_size)
    floor = torch.tensor(DEFAULT_SCALE_FLOOR if scale_floor is None else scale_floor,
                         dtype=torch.float32)
    scale = torch.maximum(amax_ignoring_nan(v) / 448.0, floor)
    if pow2_scale:
        scale = pow2_round_up(scale)
    q = encode(v / scale.unsqueeze(-1), torch.float8_e4m3fn)
    return q.view(T, N), scale


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: Optional[torch.Tensor] = None):
    """``(y, s)`` on the CPU: ``s = round(x + residual)`` (``x`` without a residual) and ``y``, its
    RMSNorm rounded to the model dtype."""
    x = x.cpu()
    s = x if residual is None else encode(x.float() + residual.cpu().float(), x.dtype)
    return encode(rms_norm_values(s, weight, eps), x.dtype), s


def _quant_buffers(src: torch.Tensor, T: int, group_size: int, out, scales, column_major: bool):
    N = src.shape[-1]
    if out is None:
        out = torch.empty(T, N, dtype=torch.float8_e4m3fn, device=src.device)
    if scales is None:
        G = N // group_size
        scales = (torch.empty(G, T, dtype=torch.float32, device=src.device).t() if column_major
                  else torch.empty(T, G, dtype=torch.float32, device=src.device))
    return out, scales


def _rows(t: torch.Tensor, num_tokens) -> int:
    return t.shape[0] if num_tokens is None else int(num_tokens)


def rmsnorm_quant(input, weight, eps=1e-6, *, out=None, scales=None, group_size=128,
                  scale_floor=None, pow2_scale=False, residual=None, normed_out=None,
                  column_major_scales=False, num_tokens=None):
    """Reference of ``mlakv.rmsnorm_quant``: returns ``(out, scales)`` and writes ``residual``
    (the sum) and ``normed_out`` as the op does."""
    T = _rows(input, num_tokens)
    y, s = rms_norm_rows(input[:T], weight, eps, None if residual is None else residual[:T])
    q, sc = group_quant_values(y, group_size, scale_floor, pow2_scale)
    out, scales = _quant_buffers(input, T, group_size, out, scales, column_major_scales)
    if residual is not None:
        residual[:T].copy_(s)
    if normed_out is not None:
        normed_out[:T].copy_(y)
    out[:T].copy_(q)
    scales[:T].copy_(sc)
    return out, scales


def mla_rmsnorm_quant(q_c, q_weight, kv_c, kv_weight, *, q_eps=1e-6, kv_eps=1e-6, q_out=None,
                      q_scales=None, kv_c_out=None, group_size=128, scale_floor=None,
                      pow2_scale=False, q_normed_out=None, q_residual=None,
                      column_major_scales=False, num_tokens=None):
    """Reference of ``mlakv.mla_rmsnorm_quant``: returns ``(q_out, q_scales, kv_c_out)``."""
    T = _rows(q_c, num_tokens)
    T_kv = _rows(kv_c, num_tokens)   # each tensor's own rows unless num_tokens is given
    kv_y, _ = rms_norm_rows(kv_c[:T_kv], kv_weight, kv_eps)
    q_out, q_scales = rmsnorm_quant(q_c, q_weight, q_eps, out=q_out, scales=q_scales,
                                    group_size=group_size, scale_floor=scale_floor,
                                    pow2_scale=pow2_scale, normed_out=q_normed_out,
                                    residual=q_residual, column_major_scales=column_major_scales,
                                    num_tokens=T)
    if kv_c_out is None:
        kv_c_out = torch.empty(T_kv, kv_c.shape[-1], dtype=kv_c.dtype, device=kv_c.device)
    kv_c_out[:T_kv].copy_(kv_y)
    return q_out, q_scales, kv_c_out


def per_token_group_quant_fp8(input, group_size=128, *, out=None, scales=None, scale_floor=None,
                              pow2_scale=False, column_major_scales=False, num_tokens=None):
    """Reference of ``mlakv.per_token_group_quant_fp8``: returns ``(out, scales)``."""
    T = _rows(input, num_tokens)
    q, sc = group_quant_values(input[:T], group_size, scale_floor, pow2_scale)
    out, scales = _quant_buffers(input, T, group_size, out, scales, column_major_scales)
    out[:T].copy_(q)
    scales[:T].copy_(sc)
    return out, scales


# ---- a plain engine path (what torch.compile is benchmarked on) -------------------------------
def torch_mla_rope_cache_decode(positions, slot_mapping, cos_sin_cache, kv_c, k_pe, kv_cache,
                                q_pe, q_out, is_neox=False, kv_cache_scale=None):
    """The decode step as plain PyTorch would write it, float32 math: rotate q_pe into q_out's rope
    part and k_pe, then write ``[kv_c | k_pe]`` at the slots of a typed cache (bf16 / fp16 / fp32,
    or float8 quantized as ``value / kv_cache_scale``). Not bit-exact with the kernels (no fma);
    it is the baseline ``torch.compile`` is timed on."""
    T = slot_mapping.shape[0]
    R = cos_sin_cache.shape[1]
    half = R // 2
    rows = cos_sin_cache.index_select(0, positions[:T].long()).float()
    cos, sin = rows[:, :half], rows[:, half:]

    def rope(x, c, s):
        x = x.float()
        if is_neox:
            a, b = x[..., :half], x[..., half:]
            return torch.cat([a * c - b * s, b * c + a * s], dim=-1)
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)

    q_rot = rope(q_pe[:T], cos[:, None], sin[:, None])
    q_out[:T, :, -R:] = q_rot.to(q_out.dtype)
    k_rot = rope(k_pe[:T], cos, sin).to(kv_c.dtype)
    entry = torch.cat([kv_c[:T], k_rot], dim=-1)
    if kv_cache.dtype in FP8_MAX:
        m = FP8_MAX[kv_cache.dtype]
        value = entry.float() if kv_cache_scale is None else entry.float() / kv_cache_scale
        entry = value.clamp(-m, m).to(kv_cache.dtype)
    else:
        entry = entry.to(kv_cache.dtype)
    # Scatter whole entries as bytes (index_copy_ has no float8 kernels).
    flat = kv_cache.view(torch.uint8).view(-1, kv_cache.shape[-1] * kv_cache.element_size())
    flat.index_copy_(0, slot_mapping[:T].long(), entry.view(torch.uint8))
