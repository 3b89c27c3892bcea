"""RoPE cos/sin tables: plain and DeepSeek YaRN, in vLLM's ``cos_sin_cache`` layout.

A table is ``[max_position, R]``: row p holds ``cos(p * inv_freq)`` (R/2 values) then
``sin(p * inv_freq)`` (R/2 values). It is computed in float64 and rounded once to the requested
dtype (16-bit dtypes go through float32 with round-to-odd, which keeps the rounding single).
"""

import math

import torch


def _round_table(table64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype in (torch.float64, torch.float32):
        return table64.to(dtype)
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"table dtype: expected float32, bfloat16 or float16 (the ops' table "
                         f"dtypes), or float64 (the exact table, for references), got {dtype}")
    f = table64.to(torch.float32)
    back = f.to(torch.float64)
    inexact = back != table64
    # Round-to-odd: truncate toward zero, then make the last bit sticky when inexact.
    too_big = back.abs() > table64.abs()
    f = torch.where(inexact & too_big, torch.nextafter(f, torch.zeros_like(f)), f)
    bits = f.view(torch.int32)
    bits = torch.where(inexact, bits | 1, bits)
    return bits.view(torch.float32).to(dtype)


def _table_from_inv_freq(inv_freq: torch.Tensor, max_position: int, mscale: float,
                         dtype: torch.dtype, device) -> torch.Tensor:
    t = torch.arange(max_position, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    table = torch.cat([freqs.cos() * mscale, freqs.sin() * mscale], dim=-1)
    return _round_table(table, dtype).to(device)


def _check_rotary_dim(rotary_dim: int):
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected a positive even number, got {rotary_dim}")


def rope_cos_sin_cache(rotary_dim: int, max_position: int, base: float = 10000.0,
                       dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """Plain RoPE: ``inv_freq[i] = base ** (-2i / rotary_dim)``; returns ``[max_position, R]``."""
    _check_rotary_dim(rotary_dim)
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    inv_freq = 1.0 / (base ** exponent)
    return _table_from_inv_freq(inv_freq, max_position, 1.0, dtype, device)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """``0.1 * mscale * ln(scale) + 1`` for ``scale > 1``, else 1 (DeepSeek's yarn_get_mscale)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale_multiplier(factor: float, mscale_all_dim: float) -> float:
    """The multiplier of the attention softmax scale under YaRN: ``yarn_get_mscale(...)**2``."""
    m = yarn_get_mscale(factor, mscale_all_dim)
    return m * m


def _yarn_correction_dim(num_rotations, dim, base, max_position):
    return (dim * math.log(max_position / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_max_position(original_max_position: int, factor: float) -> int:
    return int(math.ceil(original_max_position * factor))


def yarn_cos_sin_cache(rotary_dim: int, base: float = 10000.0, factor: float = 40.0,
                       original_max_position: int = 4096, beta_fast: float = 32.0,
                       beta_slow: float = 1.0, mscale: float = 1.0, mscale_all_dim: float = 1.0,
                       attn_factor: float = 1.0, extrapolation_factor: float = 1.0,
                       max_position: int = None, dtype: torch.dtype = torch.float32,
                       device="cpu") -> torch.Tensor:
    """DeepSeek YaRN (vLLM's ``DeepseekScalingRotaryEmbedding``).

    Returns ``[max_position, R]``; ``max_position`` defaults to
    ``ceil(original_max_position * factor)`` (a smaller value gives the first rows only, which is
    what tests with short sequences want)."""
    _check_rotary_dim(rotary_dim)
    R = rotary_dim
    low = max(math.floor(_yarn_correction_dim(beta_fast, R, base, original_max_position)), 0)
    high = min(math.ceil(_yarn_correction_dim(beta_slow, R, base, original_max_position)), R - 1)
    if low == high:
        high += 0.001
    i = torch.arange(R // 2, dtype=torch.float64)
    pos_freqs = base ** (2 * i / R)
    inv_freq_extra = 1.0 / pos_freqs
    inv_freq_inter = 1.0 / (factor * pos_freqs)
    ramp = ((i - low) / (high - low)).clamp(0.0, 1.0)
    mask = (1.0 - ramp) * extrapolation_factor
    inv_freq = inv_freq_inter * (1.0 - mask) + inv_freq_extra * mask
    m = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim) * attn_factor
    if max_position is None:
        max_position = yarn_max_position(original_max_position, factor)
    return _table_from_inv_freq(inv_freq, max_position, m, dtype, device)
