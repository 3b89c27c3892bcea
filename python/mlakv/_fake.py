"""Fake (meta) kernels of torch.ops.mlakv.*: shapes and dtypes only, for torch.compile / FakeTensor.

The ops that write into their arguments return nothing, so their fake kernels do nothing; the
functional gather ops return a new ``[rows, L + R]`` tensor.
"""

import torch

from mlakv.cache import cache_latent_width


def _writes_only(*args, **kwargs):
    return None


for _name in ("mla_rope_cache", "rotary_embedding", "concat_and_cache_mla", "decode_q_concat",
              "rms_norm", "gather_cache_slots_out", "gather_cache_sequences_out"):
    torch.library.register_fake(f"mlakv::{_name}")(_writes_only)


@torch.library.register_fake("mlakv::gather_cache_slots")
def _gather_cache_slots_fake(kv_cache, cache_format, kv_cache_scale, kv_cache_rope, slots,
                             kv_lora_rank, out_dtype):
    width = cache_latent_width(kv_cache, cache_format, kv_lora_rank, kv_cache_rope)
    return kv_cache.new_empty((slots.shape[0], width), dtype=out_dtype)


@torch.library.register_fake("mlakv::gather_cache_sequences")
def _gather_cache_sequences_fake(kv_cache, cache_format, kv_cache_scale, kv_cache_rope,
                                 block_table, cu_seq_lens, num_out_rows, kv_lora_rank, out_dtype):
    width = cache_latent_width(kv_cache, cache_format, kv_lora_rank, kv_cache_rope)
    return kv_cache.new_empty((num_out_rows, width), dtype=out_dtype)
