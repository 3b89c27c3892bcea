"""A DeepSeek-V3 Multi-head Latent Attention layer on a paged cache, using the mlakv ops.

The layer takes what an inference engine passes: a batch of decode tokens (one per sequence)
followed by the tokens of prefill sequences, with positions, slot mapping, block table and sequence
lengths. Decode tokens take the absorbed path: the W_UK GEMM writes straight into the nope part of
``q_out`` and the fused op adds the rotated rope part, writes the cache entries and normalizes
``kv_c``; attention then runs over the latent cache. Prefill tokens take the un-absorbed path: K and
V come from ``kv_b_proj`` of the new tokens' normalized ``kv_c`` and of the earlier context read
back from the cache. Attention itself is plain PyTorch.

``MLAKV_FUSED=0`` (environment, read at every forward unless ``fused`` is given to the
constructor) switches to the unfused primitives (rms_norm, rotary_embedding, concat_and_cache_mla,
decode_q_concat); both paths write identical bytes and return identical outputs.
"""

import math
import os
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mlakv import ops
from mlakv.cache import allocate_cache, canonical_format, is_per_tensor_fp8
from mlakv.tables import (rope_cos_sin_cache, yarn_cos_sin_cache, yarn_max_position,
                          yarn_softmax_scale_multiplier)


@dataclass
class MLAConfig:
    """Shapes and settings of one MLA layer (Hugging Face DeepSeek-V3 config names)."""

    hidden_size: int = 7168
    num_heads: int = 128                     # H on this rank
    q_lora_rank: Optional[int] = 1536        # None: q_proj straight from the hidden state
    kv_lora_rank: int = 512                  # L
    qk_nope_head_dim: int = 128              # P
    qk_rope_head_dim: int = 64               # R
    v_head_dim: int = 128                    # V
    rope_theta: float = 10000.0
    # YaRN parameters (DeepSeek-V3's); None: plain RoPE over max_position_embeddings.
    rope_scaling: Optional[dict] = field(default_factory=lambda: {
        "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    max_position_embeddings: int = 163840    # rows of the cos/sin table kept (<= YaRN's max)
    rms_norm_eps: float = 1e-6
    cache_format: str = "bf16"
    kv_cache_scale: float = 1.0              # per-tensor fp8 formats
    block_size: int = 64
    num_blocks: int = 1024
    dtype: torch.dtype = torch.bfloat16

    @staticmethod
    def deepseek_v3(**overrides) -> "MLAConfig":
        return replace(MLAConfig(), **overrides)

    @staticmethod
    def small(**overrides) -> "MLAConfig":
        """A layer small enough for CPU tests, with YaRN and every projection of the real one."""
        base = MLAConfig(hidden_size=256, num_heads=4, q_lora_rank=96, kv_lora_rank=64,
                         qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                         rope_scaling={"factor": 4.0, "original_max_position_embeddings": 64,
                                       "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707,
                                       "mscale_all_dim": 0.707},
                         max_position_embeddings=256, block_size=4, num_blocks=64)
        return replace(base, **overrides)


def _fused_from_env() -> bool:
    return os.environ.get("MLAKV_FUSED", "1") != "0"


class DeepseekV3MLAttention(nn.Module):
    """DeepSeek-V3 MLA attention over a paged latent cache (``self.kv_cache``)."""

    def __init__(self, config: MLAConfig, device=None, fused: Optional[bool] = None):
        super().__init__()
        c = config
        self.config = c
        self.fused = fused
        self.H, self.L, self.R = c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim
        self.P, self.V = c.qk_nope_head_dim, c.v_head_dim
        self.cache_format = canonical_format(c.cache_format)
        self._check_model_dtype(c.dtype)
        kw = dict(device=device, dtype=c.dtype)
        qk_head = self.P + self.R
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, self.H * qk_head, bias=False, **kw)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False, **kw)
            self.q_a_layernorm = nn.Parameter(torch.ones(c.q_lora_rank, **kw))
            self.q_b_proj = nn.Linear(c.q_lora_rank, self.H * qk_head, bias=False, **kw)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, self.L + self.R, bias=False, **kw)
        self.kv_a_layernorm = nn.Parameter(torch.ones(self.L, **kw))
        self.kv_b_proj = nn.Linear(self.L, self.H * (self.P + self.V), bias=False, **kw)
        self.o_proj = nn.Linear(self.H * self.V, c.hidden_size, bias=False, **kw)

        self.scaling = qk_head ** -0.5
        rs = c.rope_scaling
        if rs is not None:
            self.scaling *= yarn_softmax_scale_multiplier(rs["factor"], rs.get("mscale_all_dim", 0))
            max_pos = min(c.max_position_embeddings,
                          yarn_max_position(rs["original_max_position_embeddings"], rs["factor"]))
            table = yarn_cos_sin_cache(
                self.R, base=c.rope_theta, factor=rs["factor"],
                original_max_position=rs["original_max_position_embeddings"],
                beta_fast=rs.get("beta_fast", 32.0), beta_slow=rs.get("beta_slow", 1.0),
                mscale=rs.get("mscale", 1.0), mscale_all_dim=rs.get("mscale_all_dim", 0.0),
                max_position=max_pos)
        else:
            table = rope_cos_sin_cache(self.R, c.max_position_embeddings, base=c.rope_theta)
        self.register_buffer("cos_sin_cache", table.to(device), persistent=False)
        self.register_buffer("kv_cache", allocate_cache(c.num_blocks, c.block_size, self.L, self.R,
                                                        self.cache_format, device=device),
                             persistent=False)
        scale = None
        if is_per_tensor_fp8(self.cache_format):
            scale = torch.tensor([c.kv_cache_scale], dtype=torch.float32, device=device)
        self.register_buffer("kv_cache_scale", scale, persistent=False)

    # Buffers whose dtype is part of the op's contract: the RoPE table and the cache scale stay
    # float32, the cache keeps its format's dtype.
    _FIXED_DTYPE_BUFFERS = ("cos_sin_cache", "kv_cache", "kv_cache_scale")

    def _check_model_dtype(self, dtype: torch.dtype) -> None:
        # The op's rule (fp8_ds_mla stores bf16 rope parts), refused when the layer is built or
        # cast rather than at its first forward.
        if self.cache_format == "fp8_ds_mla" and dtype != torch.bfloat16:
            raise ValueError("mlakv: DeepseekV3MLAttention: cache_format fp8_ds_mla needs a "
                             f"bfloat16 model dtype, got {dtype}")

    def _apply(self, fn, recurse=True):
        """``.to(dtype)``, ``.half()``, ``.bfloat16()`` cast the weights but not the buffers of a
        fixed dtype: those only follow a change of device. The config's dtype (the activations'
        in forward) follows the weights. A cast the cache format does not allow is refused before
        anything moves."""
        w = self.kv_b_proj.weight
        self._check_model_dtype(fn(torch.empty(0, dtype=w.dtype, device=w.device)).dtype)
        kept = {name: self._buffers[name] for name in self._FIXED_DTYPE_BUFFERS
                if self._buffers.get(name) is not None}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            new = self._buffers[name]
            if new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        weight_dtype = self.kv_b_proj.weight.dtype
        if weight_dtype != self.config.dtype:
            self.config = replace(self.config, dtype=weight_dtype)
        return self

    # ---- weights seen per head -----------------------------------------------------------------
    def _w_kv_b(self) -> torch.Tensor:
        """kv_b_proj's weight as [H, P + V, L]."""
        return self.kv_b_proj.weight.view(self.H, self.P + self.V, self.L)

    def w_uk_t(self) -> torch.Tensor:
        """W_UK^T [H, P, L]: q_nope [H, T, P] @ W_UK^T = ql_nope [H, T, L]."""
        return self._w_kv_b()[:, :self.P, :]

    def w_uv(self) -> torch.Tensor:
        """W_UV [H, V, L]: latent attention output [T, H, L] -> [T, H, V]."""
        return self._w_kv_b()[:, self.P:, :]

    def use_fused(self) -> bool:
        return _fused_from_env() if self.fused is None else self.fused

    # ---- forward -------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                num_decode: int, prefill_query_lens: Optional[Sequence[int]] = None
                ) -> torch.Tensor:
        """One layer over a mixed batch.

        hidden_states [T, hidden]; positions [T] (int64); slot_mapping [T] (int64, < 0: padding);
        block_table [B, max_blocks] int32; seq_lens [B] int32, each sequence's length including
        this step's tokens. The first ``num_decode`` sequences are decode sequences, one token each
        (rows [0, num_decode)); the others are prefill sequences whose tokens follow in order.
        ``prefill_query_lens`` (host ints, one per prefill sequence) gives their token counts;
        None means each prefill sequence is all new (query length = sequence length). Tokens
        before a prefill sequence's new ones are read back from the cache. Returns [T, hidden].

        A decode-only batch (``num_decode == T``) never reads device memory on the host, so it can
        be captured in a CUDA graph. Inference only: runs under no_grad (the ops have no autograd).
        """
        T = hidden_states.shape[0]
        Td = int(num_decode)
        if not 0 <= Td <= T:
            raise ValueError(f"num_decode: expected 0 <= num_decode <= T = {T}, got {Td}")
        q = self._project_q(hidden_states)                 # [T, H, P + R]
        kv = self.kv_a_proj_with_mqa(hidden_states)        # [T, L + R]
        kv_c, k_pe = kv[:, :self.L], kv[:, self.L:]
        if self.use_fused():
            q_out, kv_c_normed, k_pe_rot = self._rope_cache_fused(q, kv_c, k_pe, positions,
                                                                  slot_mapping, Td)
        else:
            q_out, kv_c_normed, k_pe_rot = self._rope_cache_unfused(q, kv_c, k_pe, positions,
                                                                    slot_mapping, Td)
        outs = []
        if Td > 0:
            outs.append(self._decode_attention(q_out, block_table[:Td], seq_lens[:Td]))
        if Td < T:
            outs.append(self._prefill_attention(q[Td:], kv_c_normed[Td:], k_pe_rot[Td:],
                                                block_table[Td:], seq_lens[Td:],
                                                prefill_query_lens))
        if not outs:   # T = 0
            attn = hidden_states.new_empty(0, self.H, self.V)
        else:
            attn = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)   # [T, H, V]
        return self.o_proj(attn.reshape(T, self.H * self.V).to(self.config.dtype))

    def _project_q(self, hidden_states: torch.Tensor) -> torch.Tensor:
        T = hidden_states.shape[0]
        if self.config.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q_c = self.q_a_proj(hidden_states)
            q_c = ops.rms_norm(q_c, self.q_a_layernorm, self.config.rms_norm_eps)
            q = self.q_b_proj(q_c)
        return q.view(T, self.H, self.P + self.R)

    def _absorb_into(self, q: torch.Tensor, Td: int, out: torch.Tensor) -> None:
        # [H, Td, P] @ [H, P, L] -> [H, Td, L], written through a transposed view of `out`. Dynamo
        # refuses a non-contiguous out= (fullgraph=True): compiled, the product is copied in.
        q_nope = q[:Td, :, :self.P].transpose(0, 1)
        if torch.compiler.is_compiling():
            out.copy_(torch.bmm(q_nope, self.w_uk_t()).transpose(0, 1))
        else:
            torch.bmm(q_nope, self.w_uk_t(), out=out.transpose(0, 1))

    def _rope_cache_fused(self, q, kv_c, k_pe, positions, slot_mapping, Td):
        T = q.shape[0]
        q_out = None
        if Td > 0:
            q_out = torch.empty(Td, self.H, self.L + self.R, dtype=q.dtype, device=q.device)
            self._absorb_into(q, Td, q_out[:, :, :self.L])
        kv_c_out = k_pe_out = None
        if Td < T:
            kv_c_out = torch.empty(T, self.L, dtype=q.dtype, device=q.device)
            k_pe_out = torch.empty(T, self.R, dtype=q.dtype, device=q.device)
        ops.mla_rope_cache(
            positions, slot_mapping, self.cos_sin_cache, kv_c, k_pe, self.kv_cache,
            cache_format=self.cache_format, kv_cache_scale=self.kv_cache_scale,
            kv_norm_weight=self.kv_a_layernorm, kv_norm_eps=self.config.rms_norm_eps,
            k_pe_out=k_pe_out, kv_c_out=kv_c_out,
            q_pe=q[:, :, self.P:] if Td > 0 else None, q_out=q_out,
            q=q if Td < T else None, num_decode_tokens=Td)
        return q_out, kv_c_out, k_pe_out

    def _rope_cache_unfused(self, q, kv_c, k_pe, positions, slot_mapping, Td):
        T = q.shape[0]
        kv_c_normed = ops.rms_norm(kv_c, self.kv_a_layernorm, self.config.rms_norm_eps)
        k_pe_rot = k_pe.clone()
        # vLLM's rotary_emb(positions, q_pe, k_pe): every token's q rope part, in place.
        ops.rotary_embedding(positions[:T], q[:, :, self.P:], k_pe_rot.view(T, 1, self.R),
                             self.cos_sin_cache, head_size=self.R)
        ops.concat_and_cache_mla(kv_c_normed, k_pe_rot, self.kv_cache, slot_mapping,
                                 cache_format=self.cache_format,
                                 kv_cache_scale=self.kv_cache_scale)
        q_out = None
        if Td > 0:
            ql_nope = torch.empty(Td, self.H, self.L, dtype=q.dtype, device=q.device)
            self._absorb_into(q, Td, ql_nope)
            q_out = torch.empty(Td, self.H, self.L + self.R, dtype=q.dtype, device=q.device)
            ops.decode_q_concat(ql_nope, q[:Td, :, self.P:], q_out)
        return q_out, kv_c_normed, k_pe_rot

    def _read_cache_slots(self, slots: torch.Tensor) -> torch.Tensor:
        return ops.gather_cache_slots(self.kv_cache, slots, kv_lora_rank=self.L,
                                      cache_format=self.cache_format,
                                      kv_cache_scale=self.kv_cache_scale, out_dtype=torch.float32)

    def _decode_attention(self, q_out, block_table, seq_lens) -> torch.Tensor:
        """Absorbed attention of one query token per sequence over its latent cache: fixed
        shapes, no host reads (CUDA-graph safe). Returns [Td, H, V] float32."""
        Td, max_blocks = block_table.shape
        bs = self.config.block_size
        offsets = torch.arange(bs, device=block_table.device, dtype=torch.int64)
        slots = block_table.to(torch.int64).unsqueeze(-1) * bs + offsets       # [Td, MB, bs]
        S = max_blocks * bs
        kv = self._read_cache_slots(slots.reshape(-1)).view(Td, S, self.L + self.R)
        scores = torch.einsum("thd,tsd->ths", q_out.float(), kv) * self.scaling
        pos = torch.arange(S, device=kv.device)
        masked = pos.view(1, 1, S) >= seq_lens.to(torch.int64).view(Td, 1, 1)
        probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
        # A padding row (seq_len 0: every score masked) attends to nothing: zeros, not NaN.
        probs = probs.masked_fill(masked.all(dim=-1, keepdim=True), 0.0)
        latent = torch.einsum("ths,tsl->thl", probs, kv[..., :self.L])          # [Td, H, L]
        return torch.einsum("thl,hvl->thv", latent, self.w_uv().float())

    def _prefill_attention(self, q, kv_c_new, k_pe_new, block_table, seq_lens,
                           query_lens) -> torch.Tensor:
        """Un-absorbed causal attention of the prefill sequences; their earlier context comes
        back from the cache. Returns [T - Td, H, V] float32."""
        seq_lens_host = [int(s) for s in seq_lens.tolist()]
        if query_lens is None:
            query_lens = seq_lens_host
        query_lens = [int(n) for n in query_lens]
        if (len(query_lens) != len(seq_lens_host) or sum(query_lens) != q.shape[0]
                or min(query_lens, default=0) < 0):
            raise ValueError(f"prefill_query_lens: expected {len(seq_lens_host)} lengths >= 0 "
                             f"adding up to {q.shape[0]} prefill tokens, got {query_lens}")
        ctx_lens = [s - n for s, n in zip(seq_lens_host, query_lens)]
        if min(ctx_lens, default=0) < 0:
            raise ValueError("seq_lens: each prefill sequence length must be >= its query length")
        context = None
        total_ctx = sum(ctx_lens)
        if total_ctx > 0:
            cu = torch.tensor([0] + ctx_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
            context = ops.gather_cache_sequences(
                self.kv_cache, block_table, cu.to(block_table.device), total_ctx,
                kv_lora_rank=self.L, cache_format=self.cache_format,
                kv_cache_scale=self.kv_cache_scale, out_dtype=torch.float32)
        outs = []
        q_start = ctx_start = 0
        for n, ctx_len in zip(query_lens, ctx_lens):
            latent = kv_c_new[q_start:q_start + n].float()
            rope = k_pe_new[q_start:q_start + n].float()
            if ctx_len > 0:
                ctx = context[ctx_start:ctx_start + ctx_len]
                latent = torch.cat([ctx[:, :self.L], latent])
                rope = torch.cat([ctx[:, self.L:], rope])
            outs.append(self._causal_attention(q[q_start:q_start + n], latent, rope, ctx_len))
            q_start += n
            ctx_start += ctx_len
        return torch.cat(outs, dim=0)

    def _causal_attention(self, q, latent, rope, ctx_len) -> torch.Tensor:
        n, S = q.shape[0], latent.shape[0]
        kv = F.linear(latent.to(self.config.dtype), self.kv_b_proj.weight).float()
        kv = kv.view(S, self.H, self.P + self.V)
        k = torch.cat([kv[..., :self.P], rope.unsqueeze(1).expand(S, self.H, self.R)], dim=-1)
        v = kv[..., self.P:]
        scores = torch.einsum("qhd,shd->hqs", q.float(), k) * self.scaling
        visible = (torch.arange(S, device=q.device).view(1, S)
                   <= (ctx_len + torch.arange(n, device=q.device)).view(n, 1))
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        return torch.einsum("hqs,shv->qhv", probs, v)


def dense_mla_reference(layer: DeepseekV3MLAttention, hidden_states: torch.Tensor,
                        positions: torch.Tensor) -> torch.Tensor:
    """The same layer as a plain, non-paged multi-head computation over one whole sequence, in
    float32: un-absorbed Q/K/V, RoPE with float32 math, causal softmax attention, no cache.
    hidden_states [S, hidden], positions [S]; returns [S, hidden] float32."""
    c = layer.config
    H, L, R, P, V = layer.H, layer.L, layer.R, layer.P, layer.V
    x = hidden_states.float()
    S = x.shape[0]
    eps = c.rms_norm_eps

    def rms(v, w):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w.float()

    if c.q_lora_rank is None:
        q = x @ layer.q_proj.weight.float().T
    else:
        q = rms(x @ layer.q_a_proj.weight.float().T, layer.q_a_layernorm) @ \
            layer.q_b_proj.weight.float().T
    q = q.view(S, H, P + R)
    kv = x @ layer.kv_a_proj_with_mqa.weight.float().T
    kv_c = rms(kv[:, :L], layer.kv_a_layernorm)
    k_pe = kv[:, L:]
    rows = layer.cos_sin_cache.float()[positions.long()]
    cos, sin = rows[:, :R // 2], rows[:, R // 2:]

    def rope(t, c_, s_):   # GPT-J pairs
        a, b = t[..., 0::2], t[..., 1::2]
        return torch.stack([a * c_ - b * s_, b * c_ + a * s_], dim=-1).flatten(-2)

    q_pe = rope(q[..., P:], cos[:, None], sin[:, None])
    k_pe = rope(k_pe, cos, sin)
    kvb = (kv_c @ layer.kv_b_proj.weight.float().T).view(S, H, P + V)
    k = torch.cat([kvb[..., :P], k_pe[:, None, :].expand(S, H, R)], dim=-1)
    v = kvb[..., P:]
    qq = torch.cat([q[..., :P], q_pe], dim=-1)
    scores = torch.einsum("qhd,shd->hqs", qq, k) * layer.scaling
    causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    out = torch.einsum("hqs,shv->qhv", probs, v).reshape(S, H * V)
    return out @ layer.o_proj.weight.float().T


def init_mla_weights_(layer: DeepseekV3MLAttention, generator: Optional[torch.Generator] = None):
    """Random weights with unit-scale activations (tests and benchmarks; no checkpoint needed)."""
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 2:
                w = torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[1])
            else:
                w = 1.0 + 0.1 * torch.randn(p.shape, generator=generator)
            p.copy_(w.to(p.dtype))
    return layer
