"""Fake (meta) kernels of torch.ops.mlakv.*: shapes and dtypes only, for torch.compile / FakeTensor.

The ops that write into their arguments return nothing, so their fake kernels only check what the
real kernels would reject before they look at shapes: every tensor on one device. (A meta tensor
among real ones picks these kernels too, and would otherwise pass silently with nothing written.)
The functional gather ops return a new ``[rows, L + R]`` tensor, after the checks of the real
ops that need no data (index tensors' dims and dtypes, the cache's layout, ``out_dtype``), so that
a traced graph fails where eager would.
"""

import torch

from mlakv.cache import canonical_format, gather_row_width, is_per_tensor_fp8, op_errors


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


torch.library.register_fake("mlakv::mla_rope_cache.q_prefill_out")(
    _writes_only("mla_rope_cache"))


def _index_tensor(name, t, dims, dtypes):
    # What the real gather ops check of an index tensor before they read it (dims, dtype).
    if t.dim() != dims or t.dtype not in dtypes:
        allowed = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise RuntimeError(f"mlakv: {name}: expected a {dims}-D {allowed} tensor, got "
                           f"{t.dtype} of shape {list(t.shape)}")


def _gather_checks(op, kv_cache, cache_format, kv_cache_scale, kv_cache_rope, index_tensors,
                   kv_lora_rank, out_dtype):
    # The real op's rejections that need no data: devices, index tensors, the format (its name;
    # "auto" from a typed cache), the cache's layout (with out_dtype, gather_row_width) and the
    # scale (float32, at least one element, on a format that takes one).
    _one_device(op, (kv_cache, kv_cache_scale, kv_cache_rope) + tuple(t for t, _, _ in
                                                                     index_tensors))
    for t, name, (dims, dtypes) in index_tensors:
        _index_tensor(name, t, dims, dtypes)
    with op_errors():
        fmt = canonical_format(cache_format, kv_cache)
    width = gather_row_width(kv_cache, fmt, kv_lora_rank, kv_cache_rope, out_dtype)
    if kv_cache_scale is not None:
        if kv_cache_scale.dtype != torch.float32 or kv_cache_scale.numel() < 1:
            raise RuntimeError(f"mlakv: kv_cache_scale: expected a float32 scale tensor of at "
                               f"least one element, got {kv_cache_scale.dtype} of shape "
                               f"{list(kv_cache_scale.shape)}")
        if not is_per_tensor_fp8(fmt):
            raise RuntimeError(f"mlakv: kv_cache: a scale is taken by the per-tensor fp8 formats "
                               f"only, got one for a {fmt} cache")
    return width


_SLOTS = (1, (torch.int32, torch.int64))


@torch.library.register_fake("mlakv::gather_cache_slots")
def _gather_cache_slots_fake(kv_cache, cache_format, kv_cache_scale, kv_cache_rope, slots,
                             kv_lora_rank, out_dtype):
    width = _gather_checks("gather_cache_slots", kv_cache, cache_format, kv_cache_scale,
                           kv_cache_rope, ((slots, "slots", _SLOTS),), kv_lora_rank, out_dtype)
    return kv_cache.new_empty((slots.shape[0], width), dtype=out_dtype)


@torch.library.register_fake("mlakv::gather_cache_sequences")
def _gather_cache_sequences_fake(kv_cache, cache_format, kv_cache_scale, kv_cache_rope,
                                 block_table, cu_seq_lens, num_out_rows, kv_lora_rank, out_dtype):
    torch._check(num_out_rows >= 0,
                 lambda: f"mlakv: num_out_rows: expected >= 0, got {num_out_rows}")
    width = _gather_checks("gather_cache_sequences", kv_cache, cache_format, kv_cache_scale,
                           kv_cache_rope, ((block_table, "block_table", (2, (torch.int32,))),
                                           (cu_seq_lens, "cu_seq_lens", (1, (torch.int32,)))),
                           kv_lora_rank, out_dtype)
    torch._check(cu_seq_lens.shape[0] >= 1,
                 lambda: "mlakv: cu_seq_lens: expected B + 1 >= 1 elements, got none")
    return kv_cache.new_empty((num_out_rows, width), dtype=out_dtype)
