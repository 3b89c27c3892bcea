"""Python wrappers of torch.ops.mlakv.* (CPU and CUDA kernels).

Terms (DESIGN.md): T tokens (decode tokens first, then prefill tokens), Td decode tokens, H query
heads, L = kv_lora_rank, R = qk_rope_head_dim, P = per-head nope width of the un-absorbed query.
The *model dtype* is the dtype of ``kv_c`` (float32, float16 or bfloat16); every model-dtype
argument has it. The innermost dimension of every tensor must be contiguous; other strides are
free (views into larger tensors are fine). Per-token tensors may have more rows than T (CUDA-graph
padding): the ops that write the cache take T from ``slot_mapping.shape[0]`` and never touch the
extra rows.

Caches are ``[num_blocks, block_size, entry]`` tensors (see ``mlakv.cache``); ``cache_format``
names the format ("bf16", "fp16", "fp32", "fp8_e4m3" or "fp8", "fp8_e5m2", "fp8_ds_mla"), or
"auto" to take it from a typed cache's dtype. ``kv_cache_rope`` (optional) holds the rope part in
a separate ``[num_blocks, block_size, R]`` tensor (split layout; not for fp8_ds_mla).

``cos_sin_cache`` is ``[max_position, R]``: R/2 cosines then R/2 sines per position (vLLM's
layout, see ``mlakv.tables``); float32 preferred, bfloat16 / float16 accepted. Positions outside
``[0, max_position)`` are clamped and counted. Slots ``< 0`` are padding (not written); slots
``>= num_blocks * block_size`` are skipped and counted. Counters go to ``error_counts`` (an int32
``[4]`` tensor on the op's device, ``mlakv.new_error_counts``) when given.

Argument errors raise ``RuntimeError`` with the library's message, which names the argument, what
was expected and what was given; nothing is written then.
"""

from typing import Optional

import torch

from mlakv.cache import cache_latent_width, canonical_format

_ops = torch.ops.mlakv


def mla_rope_cache(positions: torch.Tensor, slot_mapping: torch.Tensor,
                   cos_sin_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                   kv_cache: torch.Tensor, *, cache_format: str = "auto",
                   kv_cache_scale: Optional[torch.Tensor] = None,
                   kv_cache_rope: Optional[torch.Tensor] = None, is_neox: bool = False,
                   kv_norm_weight: Optional[torch.Tensor] = None, kv_norm_eps: float = 1e-6,
                   k_pe_out: Optional[torch.Tensor] = None,
                   kv_c_out: Optional[torch.Tensor] = None, q_pe: Optional[torch.Tensor] = None,
                   ql_nope: Optional[torch.Tensor] = None, q_out: Optional[torch.Tensor] = None,
                   q_scale: Optional[torch.Tensor] = None, q: Optional[torch.Tensor] = None,
                   q_prefill_out: Optional[torch.Tensor] = None, num_decode_tokens: int = 0,
                   num_decode_tokens_device: Optional[torch.Tensor] = None,
                   error_counts: Optional[torch.Tensor] = None,
                   ds_mla_pow2_scale: bool = False) -> None:
    """The fused MLA op: RoPE, optional RMSNorm, cache write and the query side, in one launch.

    K side, every token ``t < T`` (``T = slot_mapping.shape[0]``):
    ``kv_c [>=T, L]`` -> RMSNorm with ``kv_norm_weight [L]`` (if given) -> model dtype;
    ``k_pe [>=T, R]`` (or ``[>=T, 1, R]``) -> RoPE at ``positions[t]`` -> model dtype; both are
    quantized per the cache format and written as one entry at ``slot_mapping[t]``.
    ``k_pe_out [>=T, R]`` / ``kv_c_out [>=T, L]`` (optional, model dtype; may be ``k_pe`` /
    ``kv_c`` themselves) receive the rotated k_pe and the normalized kv_c (prefill needs both).

    Decode query side, rows ``t < Td`` (when ``q_out`` is given):
    ``q_out[t, h] = [ql_nope[t, h] (L) | RoPE(q_pe[t, h]) (R)]`` with ``q_pe [>=Td, H, R]``,
    ``ql_nope [>=Td, H, L]`` and ``q_out [>=Td, H, L + R]`` in the model dtype or float8 (stored as
    ``value / q_scale``, ``q_scale`` an fp32 ``[1]`` tensor). Leave ``ql_nope`` as None when the
    absorb GEMM already wrote the nope part into ``q_out`` (``torch.bmm(..., out=q_out[..., :L])``):
    it is not copied again.

    Prefill query side, rows ``Td <= t < T`` (when ``q`` is given): RoPE on the last R values of
    each head of ``q [>=T, H, P + R]``, in place, or into ``q_prefill_out`` (whole head written).

    ``Td`` is ``num_decode_tokens`` (host int in ``[0, T]``), or the int32 ``[1]`` device tensor
    ``num_decode_tokens_device`` when given (clamped to ``[0, T]`` and counted; then the decode
    tensors need T rows), so one captured CUDA graph serves batches with different splits.

    ``ds_mla_pow2_scale``: fp8_ds_mla only, round each tile scale up to a power of two.
    ``kv_cache_scale``: fp32 ``[1]`` scale of the per-tensor fp8 formats (None: 1.0).
    """
    _ops.mla_rope_cache(positions, slot_mapping, cos_sin_cache, is_neox, kv_c, k_pe, kv_cache,
                        cache_format, kv_cache_scale, kv_cache_rope, kv_norm_weight,
                        float(kv_norm_eps), k_pe_out, kv_c_out, q_pe, ql_nope, q_out, q_scale, q,
                        q_prefill_out, int(num_decode_tokens), num_decode_tokens_device,
                        error_counts, ds_mla_pow2_scale)


def mla_rope_cache_decode(positions, slot_mapping, cos_sin_cache, kv_c, k_pe, kv_cache,
                          **kwargs) -> None:
    """``mla_rope_cache`` with every token a decode token (Td = T); same arguments."""
    kwargs["num_decode_tokens"] = slot_mapping.shape[0]
    kwargs.pop("num_decode_tokens_device", None)
    mla_rope_cache(positions, slot_mapping, cos_sin_cache, kv_c, k_pe, kv_cache, **kwargs)


def mla_rope_cache_prefill(positions, slot_mapping, cos_sin_cache, kv_c, k_pe, kv_cache,
                           **kwargs) -> None:
    """``mla_rope_cache`` with every token a prefill token (Td = 0); same arguments."""
    kwargs["num_decode_tokens"] = 0
    kwargs.pop("num_decode_tokens_device", None)
    mla_rope_cache(positions, slot_mapping, cos_sin_cache, kv_c, k_pe, kv_cache, **kwargs)


def mla_rope_cache_mixed(positions, slot_mapping, cos_sin_cache, kv_c, k_pe, kv_cache,
                         **kwargs) -> None:
    """``mla_rope_cache`` with Td as given (``num_decode_tokens`` or its device form)."""
    mla_rope_cache(positions, slot_mapping, cos_sin_cache, kv_c, k_pe, kv_cache, **kwargs)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor,
                     key: Optional[torch.Tensor], cos_sin_cache: torch.Tensor, *,
                     is_neox: bool = False, head_size: Optional[int] = None,
                     error_counts: Optional[torch.Tensor] = None) -> None:
    """vLLM's ``rotary_embedding``: rotates, in place, the first ``rot_dim``
    (``= cos_sin_cache.shape[1]``) values of every head of ``query [>=T, Hq, head_size]`` (and of
    ``key [>=T, Hk, head_size]``).

    ``T = positions.shape[0]``. ``query``/``key`` may also be 2-D ``[>=T, H * head_size]`` (then
    ``head_size`` is required). Model dtype; rounding as in the fused op.
    """
    if head_size is None:
        if query.dim() != 3:
            raise RuntimeError("mlakv: rotary_embedding: head_size: required for a 2-D query")
        head_size = query.shape[-1]
    _ops.rotary_embedding(positions, query, key, int(head_size), cos_sin_cache, is_neox,
                          error_counts)


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, *, cache_format: str = "auto",
                         kv_cache_scale: Optional[torch.Tensor] = None,
                         kv_cache_rope: Optional[torch.Tensor] = None,
                         error_counts: Optional[torch.Tensor] = None,
                         ds_mla_pow2_scale: bool = False) -> None:
    """vLLM's ``concat_and_cache_mla``: writes ``[kv_c[t] | k_pe[t]]`` (``kv_c [>=T, L]``, ``k_pe
    [>=T, R]`` or ``[>=T, 1, R]``, already rotated, model dtype) at ``slot_mapping[t]``, quantized
    per the cache format; ``T = slot_mapping.shape[0]``."""
    _ops.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, cache_format, kv_cache_scale,
                              kv_cache_rope, error_counts, ds_mla_pow2_scale)


def decode_q_concat(ql_nope: torch.Tensor, q_pe: torch.Tensor, q_out: torch.Tensor, *,
                    q_scale: Optional[torch.Tensor] = None) -> None:
    """``q_out[t, h] = [ql_nope[t, h] | q_pe[t, h]]`` for ``t < T = q_out.shape[0]``.

    ``ql_nope [>=T, H, L]`` and ``q_pe [>=T, H, R]`` (already rotated) in the model dtype;
    ``q_out [T, H, L + R]`` in the model dtype or float8 (``value / q_scale``)."""
    _ops.decode_q_concat(ql_nope, q_pe, q_out, q_scale)


def rms_norm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[t] = input[t] * rsqrt(mean(input[t]^2) + eps) * weight`` for ``t < input.shape[0]``.

    ``input [T, N]``, ``weight [N]``, ``out [>=T, N]`` (allocated when None; may be ``input``),
    all in the model dtype; fp32 math, rounded once. Returns ``out``."""
    if out is None:
        out = torch.empty_like(input)
    _ops.rms_norm(out, input, weight, float(eps))
    return out


def _gather_format(cache_format, kv_cache):
    # Resolve "auto" here so that the op (and its fake kernel) always see a concrete name. A bad
    # name is an argument error like the ops' own: RuntimeError (as concat_and_cache_mla gives).
    try:
        return canonical_format(cache_format, kv_cache)
    except ValueError as e:
        raise RuntimeError(f"mlakv: {e}") from None


def gather_cache_slots(kv_cache: torch.Tensor, slots: torch.Tensor, *, kv_lora_rank: int,
                       cache_format: str = "auto",
                       kv_cache_scale: Optional[torch.Tensor] = None,
                       kv_cache_rope: Optional[torch.Tensor] = None,
                       out_dtype: torch.dtype = torch.float32,
                       out: Optional[torch.Tensor] = None,
                       error_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reads back entries, dequantized: ``out[i]`` (``[L + R]``, float32 or bfloat16) is the entry
    at ``slots[i]`` for ``i < N = slots.shape[0]``; slots ``< 0`` or out of range give zeros
    (out-of-range slots are counted). Returns a new ``[N, L + R]`` tensor of ``out_dtype``, or
    writes the given ``out [>=N, L + R]`` (its dtype wins) and returns it."""
    fmt = _gather_format(cache_format, kv_cache)
    if out is None and error_counts is None:
        return _ops.gather_cache_slots(kv_cache, fmt, kv_cache_scale, kv_cache_rope, slots,
                                       int(kv_lora_rank), out_dtype)
    if out is None:
        width = cache_latent_width(kv_cache, fmt, kv_lora_rank, kv_cache_rope)
        out = torch.empty(slots.shape[0], width, dtype=out_dtype, device=kv_cache.device)
    _ops.gather_cache_slots_out(out, kv_cache, fmt, kv_cache_scale, kv_cache_rope, slots,
                                int(kv_lora_rank), error_counts)
    return out


def gather_cache_sequences(kv_cache: torch.Tensor, block_table: torch.Tensor,
                           cu_seq_lens: torch.Tensor, num_out_rows: int, *, kv_lora_rank: int,
                           cache_format: str = "auto",
                           kv_cache_scale: Optional[torch.Tensor] = None,
                           kv_cache_rope: Optional[torch.Tensor] = None,
                           out_dtype: torch.dtype = torch.float32,
                           out: Optional[torch.Tensor] = None,
                           error_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reads whole sequences back, dequantized (the context of chunked prefill).

    Sequence ``b < B`` (``B = cu_seq_lens.shape[0] - 1``, int32, non-decreasing, starting at 0)
    has ``cu_seq_lens[b + 1] - cu_seq_lens[b]`` tokens; its token ``i`` lives in block
    ``block_table[b, i // block_size]`` (int32 ``[>=B, max_blocks]``) and goes to row
    ``cu_seq_lens[b] + i`` of a new ``[num_out_rows, L + R]`` tensor of ``out_dtype``, returned.
    Rows at or past ``num_out_rows`` are not written; rows no sequence covers are zeros; block ids
    outside ``[0, num_blocks)`` give zeros and are counted. ``num_out_rows`` comes from the host
    (usually ``cu_seq_lens[-1]``), so the op never reads device memory on the host. With ``out``
    given (``num_out_rows`` is then ``out.shape[0]``), only the covered rows are written."""
    fmt = _gather_format(cache_format, kv_cache)
    if out is None and error_counts is None:
        return _ops.gather_cache_sequences(kv_cache, fmt, kv_cache_scale, kv_cache_rope,
                                           block_table, cu_seq_lens, int(num_out_rows),
                                           int(kv_lora_rank), out_dtype)
    if out is None:
        width = cache_latent_width(kv_cache, fmt, kv_lora_rank, kv_cache_rope)
        out = torch.zeros(int(num_out_rows), width, dtype=out_dtype, device=kv_cache.device)
    _ops.gather_cache_sequences_out(out, kv_cache, fmt, kv_cache_scale, kv_cache_rope,
                                    block_table, cu_seq_lens, int(kv_lora_rank), error_counts)
    return out
