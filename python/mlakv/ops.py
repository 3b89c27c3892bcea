"""Python wrappers of torch.ops.mlakv.* (CPU and CUDA kernels).

Terms (DESIGN.md): T tokens (decode tokens first, then prefill tokens), Td decode tokens, H query
heads, L = kv_lora_rank, R = qk_rope_head_dim, P = per-head nope width of the un-absorbed query.
The *model dtype* is the dtype of ``kv_c`` (float32, float16 or bfloat16); every model-dtype
argument has it. The innermost dimension of every tensor must be contiguous; other strides must be
positive on dims of size > 1 (any on size-1 dims), so views into larger tensors are fine (not an
``expand()``ed one: stride 0); the rmsnorm_quant ops also need 16-byte row strides and data
pointers aligned to 16 bytes. Per-token tensors may have more rows than T (CUDA-graph padding):
the ops that write the cache take T from ``slot_mapping.shape[0]`` and never touch the extra
rows.

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

from mlakv.cache import canonical_format, gather_row_width, op_errors

_ops = torch.ops.mlakv


def _count(n):
    """A host count (Td, rows) as the ops take it (their schemas say SymInt, so that a new value
    does not compile a new graph): a SymInt passes as it is (``int()`` of one would specialize it
    wherever it is traced symbolically); anything else becomes a Python int."""
    return n if isinstance(n, torch.SymInt) else int(n)


def _row_count(n, name):
    """``_count(n)`` of a count the wrapper allocates rows by: a negative one is refused by name
    (the op would name it too, but only after torch refused the allocation). Under torch.compile
    the check is a runtime assert: a Python comparison would guard on the count, which fails for
    a data-dependent one (``.item()``)."""
    n = _count(n)
    if torch.compiler.is_compiling():  # (dynamo takes only a constant message)
        torch._check(n >= 0, lambda: "mlakv: num_out_rows / num_tokens: expected >= 0")
    elif n < 0:
        raise RuntimeError(f"mlakv: {name}: expected >= 0, got {n}")
    return n


def _size(t, name, dim):
    """``t.shape[dim]`` for a wrapper's own arithmetic, with the op's error (RuntimeError) for a
    0-dim tensor, whose shape has no such entry (an IndexError otherwise)."""
    if t.dim() == 0:
        raise RuntimeError(f"mlakv: {name}: expected at least 1 dim, got a 0-dim tensor")
    return t.shape[dim]


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
    With a ``q_prefill_out`` other than ``q`` this calls ``torch.ops.mlakv.mla_rope_cache
    .q_prefill_out``, whose schema leaves ``q`` read only (torch.compile then does not copy it).

    ``Td`` is ``num_decode_tokens`` (host int in ``[0, T]``), or the int32 ``[1]`` device tensor
    ``num_decode_tokens_device`` when given (clamped to ``[0, T]`` and counted; then the decode
    tensors need T rows, and ``num_decode_tokens`` must stay 0: it would be ignored), so one
    captured CUDA graph serves batches with different splits.

    ``ds_mla_pow2_scale``: fp8_ds_mla only, round each tile scale up to a power of two.
    ``kv_cache_scale``: fp32 ``[1]`` scale of the per-tensor fp8 formats (None: 1.0).
    """
    # With a separate q_prefill_out, the overload whose schema leaves q read only (the default
    # one marks q written, for the in-place form), so torch.compile need not copy q. A view of q
    # at q's address (the in-place form again) may take either: a write through an argument that
    # aliases q is a write to q for torch.
    op = _ops.mla_rope_cache
    if q_prefill_out is not None and q is not None and q_prefill_out is not q:
        op = op.q_prefill_out
    op(positions, slot_mapping, cos_sin_cache, is_neox, kv_c, k_pe, kv_cache, cache_format,
       kv_cache_scale, kv_cache_rope, kv_norm_weight, float(kv_norm_eps), k_pe_out, kv_c_out, q_pe,
       ql_nope, q_out, q_scale, q, q_prefill_out, _count(num_decode_tokens),
       num_decode_tokens_device, error_counts, ds_mla_pow2_scale)


def mla_rope_cache_decode(positions, slot_mapping, cos_sin_cache, kv_c, k_pe, kv_cache,
                          **kwargs) -> None:
    """``mla_rope_cache`` with every token a decode token (Td = T); same arguments."""
    kwargs["num_decode_tokens"] = _size(slot_mapping, "slot_mapping", 0)
    kwargs.pop("num_decode_tokens_device", None)
    mla_rope_cache(positions, slot_mapping, cos_sin_cache, kv_c, k_pe, kv_cache, **kwargs)


def mla_rope_cache_prefill(positions, slot_mapping, cos_sin_cache, kv_c, k_pe, kv_cache,
                           **kwargs) -> None:
    """``mla_rope_cache`` with every token a prefill token (Td = 0); same arguments, ``q``
    required (as the C++ ``mla_rope_cache_prefill``)."""
    if kwargs.get("q") is None:
        raise RuntimeError("mlakv: mla_rope_cache_prefill: q: expected 3 dims [T, H, P + R] "
                           "(the prefill Q side), got absent")
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
    """vLLM's ``rotary_embedding`` (its arguments, with ``head_size`` and ``is_neox`` by keyword;
    ``torch.ops.mlakv.rotary_embedding`` takes them in vLLM's order): rotates, in place, the first
    ``rot_dim`` (``= cos_sin_cache.shape[1]``) values of every head of ``query [>=T, Hq,
    head_size]`` (and of ``key [>=T, Hk, head_size]``).

    ``T = positions.shape[0]``. ``query``/``key`` may also be 2-D ``[>=T, H * head_size]`` (then
    ``head_size`` is required). Model dtype; rounding as in the fused op.
    """
    if head_size is None:
        if query.dim() == 2:
            raise RuntimeError("mlakv: rotary_embedding: head_size: required for a 2-D query")
        # A query of another rank than 2 or 3 is the op's error, with its message.
        head_size = query.shape[-1] if query.dim() > 0 else 0
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
    ``q_out [T, H, L + R]`` in the model dtype or float8 (``value / q_scale``). With a model-dtype
    ``q_out``, ``ql_nope`` may be ``q_out[..., :L]`` itself and ``q_pe`` ``q_out[..., L:]``; a part
    already in place is not copied onto itself."""
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
    with op_errors():
        return canonical_format(cache_format, kv_cache)


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
        width = gather_row_width(kv_cache, fmt, kv_lora_rank, kv_cache_rope, out_dtype)
        out = torch.empty(_size(slots, "slots", 0), width, dtype=out_dtype,
                          device=kv_cache.device)
    _ops.gather_cache_slots_out(out, kv_cache, fmt, kv_cache_scale, kv_cache_rope, slots,
                                int(kv_lora_rank), error_counts)
    return out


def gather_cache_sequences(kv_cache: torch.Tensor, block_table: torch.Tensor,
                           cu_seq_lens: torch.Tensor, num_out_rows=None, *, kv_lora_rank: int,
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
    outside ``[0, num_blocks)``, and tokens past their ``block_table`` row, give zeros and are
    counted. ``num_out_rows`` comes from the host (usually ``cu_seq_lens[-1]``), so the op never
    reads device memory on the host. With ``out`` given, ``num_out_rows`` is ``out.shape[0]``:
    leave it None or pass that value (another is refused; under torch.compile by a runtime assert,
    as a Python comparison would guard on a count that may be data-dependent). Only the covered
    rows of ``out`` are written: a workspace larger than ``cu_seq_lens[-1]`` keeps its rows past
    that."""
    fmt = _gather_format(cache_format, kv_cache)
    if out is not None and num_out_rows is not None:
        n, rows = _count(num_out_rows), _size(out, "out", 0)
        if torch.compiler.is_compiling():  # (dynamo takes only a constant message)
            # (two bounds: torch drops a runtime assert of equality between a data-dependent count
            # and a dynamic size once it has replaced the one by the other)
            torch._check(n <= rows, lambda: "mlakv: num_out_rows: expected out.shape[0]")
            torch._check(n >= rows, lambda: "mlakv: num_out_rows: expected out.shape[0]")
        elif n != rows:
            raise RuntimeError(f"mlakv: num_out_rows: expected out.shape[0] = {rows} (out is "
                               f"given; or None), got {n}")
    elif out is None and num_out_rows is None:
        raise RuntimeError("mlakv: num_out_rows: expected the rows of the new output (out is "
                           "absent), got None")
    if out is None and error_counts is None:
        return _ops.gather_cache_sequences(kv_cache, fmt, kv_cache_scale, kv_cache_rope,
                                           block_table, cu_seq_lens, _count(num_out_rows),
                                           int(kv_lora_rank), out_dtype)
    if out is None:
        rows = _row_count(num_out_rows, "num_out_rows")
        width = gather_row_width(kv_cache, fmt, kv_lora_rank, kv_cache_rope, out_dtype)
        out = torch.zeros(rows, width, dtype=out_dtype, device=kv_cache.device)
    _ops.gather_cache_sequences_out(out, kv_cache, fmt, kv_cache_scale, kv_cache_rope,
                                    block_table, cu_seq_lens, int(kv_lora_rank), error_counts)
    return out


# ---- RMSNorm + fp8 per-token-group quantization (docs/rmsnorm_quant.md) ------------------------
def _quant_outputs(x, name, T, group_size, out, scales, column_major_scales):
    """``out [T, N]`` e4m3 and ``scales [T, N / G]`` fp32 for ``x [>=T, N]`` (the argument
    ``name``): the given tensors, else new ones (scales row-major, or column-major: stride
    ``[1, T]``, DeepGEMM's layout)."""
    N = _size(x, name, -1)
    if out is None:
        out = torch.empty(T, N, dtype=torch.float8_e4m3fn, device=x.device)
    if scales is None:
        groups = N // group_size if group_size > 0 else 0
        if column_major_scales:
            scales = torch.empty(groups, T, dtype=torch.float32, device=x.device).t()
        else:
            scales = torch.empty(T, groups, dtype=torch.float32, device=x.device)
    return out, scales


def _token_count(num_tokens, x, name):
    """T of a row tensor ``x`` (the argument ``name``): ``num_tokens`` when given, else its rows
    (as the ops take it)."""
    return _row_count(num_tokens, "num_tokens") if num_tokens is not None else _size(x, name, 0)


def _opt_count(num_tokens):
    return None if num_tokens is None else _count(num_tokens)


def rmsnorm_quant(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                  out: Optional[torch.Tensor] = None, scales: Optional[torch.Tensor] = None,
                  group_size: int = 128, scale_floor: Optional[float] = None,
                  pow2_scale: bool = False, residual: Optional[torch.Tensor] = None,
                  normed_out: Optional[torch.Tensor] = None, column_major_scales: bool = False,
                  num_tokens=None):
    """RMSNorm then fp8 e4m3 quantization per (token, group of ``group_size`` values), one pass.

    ``input [>=T, N]`` and ``weight [N]`` in the model dtype (``T = num_tokens``, default
    ``input.shape[0]``). With ``residual [>=T, N]``, ``input + residual`` is normalized and written
    back into ``residual`` (vLLM's ``fused_add_rms_norm``); ``normed_out [>=T, N]`` (model dtype,
    may be ``input``) receives the normalized rows. ``scale = max(amax / 448, scale_floor)``
    (default floor ``1e-10 / 448``: vLLM's and DeepGEMM's scales), rounded up to a power of two
    with ``pow2_scale``. Returns ``(out, scales)``: ``out [T, N]`` float8_e4m3fn and ``scales
    [T, N / group_size]`` float32, allocated when not given (``column_major_scales``: stride
    ``[1, T]``, the layout block-scaled GEMMs read)."""
    T = _token_count(num_tokens, input, "input")
    out, scales = _quant_outputs(input, "input", T, group_size, out, scales, column_major_scales)
    _ops.rmsnorm_quant(input, weight, float(eps), out, scales, int(group_size), scale_floor,
                       pow2_scale, residual, normed_out, _opt_count(num_tokens))
    return out, scales


def mla_rmsnorm_quant(q_c: torch.Tensor, q_weight: torch.Tensor, kv_c: torch.Tensor,
                      kv_weight: torch.Tensor, *, q_eps: float = 1e-6, kv_eps: float = 1e-6,
                      q_out: Optional[torch.Tensor] = None,
                      q_scales: Optional[torch.Tensor] = None,
                      kv_c_out: Optional[torch.Tensor] = None, group_size: int = 128,
                      scale_floor: Optional[float] = None, pow2_scale: bool = False,
                      q_normed_out: Optional[torch.Tensor] = None,
                      q_residual: Optional[torch.Tensor] = None,
                      column_major_scales: bool = False, num_tokens=None):
    """The two norms of an MLA layer in one launch: ``q_c [>=T, Nq]`` -> RMSNorm -> e4m3 values +
    fp32 group scales (as ``rmsnorm_quant``, with its ``normed_out`` and ``residual`` as
    ``q_normed_out`` and ``q_residual``), and ``kv_c [>=T, Nkv]`` -> RMSNorm -> ``kv_c_out`` in
    the model dtype (may be ``kv_c``: in place). ``T = num_tokens`` for both parts; without it
    each part takes its own rows (``q_c.shape[0]``, ``kv_c.shape[0]``), which may differ. Returns
    ``(q_out, q_scales, kv_c_out)``, allocated when not given."""
    T = _token_count(num_tokens, q_c, "q_c")
    q_out, q_scales = _quant_outputs(q_c, "q_c", T, group_size, q_out, q_scales,
                                     column_major_scales)
    if kv_c_out is None:
        kv_c_out = torch.empty(_token_count(num_tokens, kv_c, "kv_c"), _size(kv_c, "kv_c", -1),
                               dtype=kv_c.dtype, device=kv_c.device)
    _ops.mla_rmsnorm_quant(q_c, q_weight, float(q_eps), q_out, q_scales, kv_c, kv_weight,
                           float(kv_eps), kv_c_out, int(group_size), scale_floor, pow2_scale,
                           q_normed_out, q_residual, _opt_count(num_tokens))
    return q_out, q_scales, kv_c_out


def per_token_group_quant_fp8(input: torch.Tensor, group_size: int = 128, *,
                              out: Optional[torch.Tensor] = None,
                              scales: Optional[torch.Tensor] = None,
                              scale_floor: Optional[float] = None, pow2_scale: bool = False,
                              column_major_scales: bool = False, num_tokens=None):
    """vLLM's ``per_token_group_quant_fp8`` (the unfused second step): ``input [>=T, N]`` (model
    dtype) -> e4m3 values + fp32 scales per (token, group), the scale rule of ``rmsnorm_quant``.
    Returns ``(out, scales)``, allocated when not given."""
    T = _token_count(num_tokens, input, "input")
    out, scales = _quant_outputs(input, "input", T, group_size, out, scales, column_major_scales)
    _ops.per_token_group_quant_fp8(input, out, scales, int(group_size), scale_floor, pow2_scale,
                                   _opt_count(num_tokens))
    return out, scales
