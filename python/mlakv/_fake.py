"""Fake (meta) kernels of torch.ops.mlakv.*: shapes and dtypes only, for torch.compile / FakeTensor.

The ops that write into their arguments return nothing, so their fake kernels only check what the
real kernels would reject before they look at shapes: every tensor on one device. (A meta tensor
among real ones picks these kernels too, and would otherwise pass silently with nothing written.)
The functional gather ops return a new ``[rows, L + R]`` tensor.
"""

import torch

from mlakv.cache import cache_latent_width, op_errors


def _one_device(op, args):
    devices = {a.device for a in args if isinstance(a, torch.Tensor)}
    if len(devices) > 1:
        raise RuntimeError(f"mlakv: {op}: expected every tensor on one device, got tensors on "
                           + ", ".join(sorted(str(d) for d in devices)))


def _writes_only(op):
    def fake(*args, **kwargs):
        _one_device(op, list(args) + list(kwargs.values()))
    return fake


for _name in ("mla_rope_cache", "rotary_embedding", "concat_and_cache_mla", "decode_q_concat",
              "rms_norm", "gather_cache_slots_out", "gather_cache_sequences_out", "rmsnorm_quant",
              "mla_rmsnorm_quant", "per_token_group_quant_fp8"):
    torch.library.register_fake(f"mlakv::{_name}")(_writes_only(_name))


def _gather_width(kv_cache, cache_format, kv_lora_rank, kv_cache_rope, out_dtype):
    # What the real gather ops reject before they look at the data, with their exception type.
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise RuntimeError(f"mlakv: out_dtype: expected float32 or bfloat16, got {out_dtype}")
    with op_errors():
        return cache_latent_width(kv_cache, cache_format, kv_lora_rank, kv_cache_rope)


@torch.library.register_fake("mlakv::gather_cache_slots")
def _gather_cache_slots_fake(kv_cache, cache_format, kv_cache_scale, kv_cache_rope, slots,
                             kv_lora_rank, out_dtype):
    _one_device("gather_cache_slots", (kv_cache, kv_cache_scale, kv_cache_rope, slots))
    width = _gather_width(kv_cache, cache_format, kv_lora_rank, kv_cache_rope, out_dtype)
    return kv_cache.new_empty((slots.shape[0], width), dtype=out_dtype)


@torch.library.register_fake("mlakv::gather_cache_sequences")
def _gather_cache_sequences_fake(kv_cache, cache_format, kv_cache_scale, kv_cache_rope,
                                 block_table, cu_seq_lens, num_out_rows, kv_lora_rank, out_dtype):
    _one_device("gather_cache_sequences",
                (kv_cache, kv_cache_scale, kv_cache_rope, block_table, cu_seq_lens))
    torch._check(num_out_rows >= 0,
                 lambda: f"mlakv: num_out_rows: expected >= 0, got {num_out_rows}")
    width = _gather_width(kv_cache, cache_format, kv_lora_rank, kv_cache_rope, out_dtype)
    return kv_cache.new_empty((num_out_rows, width), dtype=out_dtype)
