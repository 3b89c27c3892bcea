"""mlakv: fused RoPE + paged KV-cache write for Multi-head Latent Attention, for PyTorch.

``import mlakv`` loads the C++ extension, which registers ``torch.ops.mlakv.*`` (CPU and CUDA
kernels), and the fake kernels that let the ops run under ``torch.compile``. The functions below
are thin, documented wrappers of those ops; ``mlakv.reference`` holds a pure-PyTorch reference of
each, ``mlakv.modules`` a DeepSeek-V3 MLA attention layer built on them, and ``python -m
mlakv.bench`` a benchmark. ``mlakv.set_pdl`` / ``mlakv.pdl()`` turn on programmatic dependent
launch of the CUDA ops (``mlakv.launch``).
"""

import os as _os

import torch as _torch

__version__ = "0.1.0"


def _load_extension():
    """Loads ``_C.so``: from ``$MLAKV_TORCH_LIBRARY`` when set (a CMake build tree), else from
    the package folder (pip install)."""
    path = _os.environ.get("MLAKV_TORCH_LIBRARY")
    if not path:
        path = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "_C.so")
    if not _os.path.exists(path):
        raise ImportError(
            f"mlakv: the torch extension was not found at {path}; build it with "
            "`pip install .` or set MLAKV_TORCH_LIBRARY to the _C.so of a CMake build "
            "(-DMLAKV_TORCH=ON)")
    _torch.ops.load_library(path)
    return path


_library_path = _load_extension()

from mlakv import _fake  # noqa: E402,F401  (registers the fake kernels)
from mlakv.cache import (  # noqa: E402,F401
    CACHE_FORMATS, ERROR_COUNTER_NAMES, allocate_cache, cache_entry_bytes, cache_latent_dtype,
    cache_rope_dtype, new_error_counts, read_error_counts)
from mlakv.launch import pdl, pdl_enabled, set_pdl  # noqa: E402,F401
from mlakv.ops import (  # noqa: E402,F401
    concat_and_cache_mla, decode_q_concat, gather_cache_sequences, gather_cache_slots,
    mla_rmsnorm_quant, mla_rope_cache, mla_rope_cache_decode, mla_rope_cache_mixed,
    mla_rope_cache_prefill, per_token_group_quant_fp8, rms_norm, rmsnorm_quant, rotary_embedding)
from mlakv.tables import rope_cos_sin_cache, yarn_cos_sin_cache, yarn_get_mscale  # noqa: E402,F401


__all__ = [
    "CACHE_FORMATS", "ERROR_COUNTER_NAMES", "allocate_cache", "cache_entry_bytes",
    "cache_latent_dtype", "cache_rope_dtype", "concat_and_cache_mla", "cuda_kernels_available",
    "decode_q_concat", "gather_cache_sequences", "gather_cache_slots", "mla_rmsnorm_quant",
    "mla_rope_cache", "mla_rope_cache_decode", "mla_rope_cache_mixed", "mla_rope_cache_prefill",
    "new_error_counts", "pdl", "pdl_enabled", "per_token_group_quant_fp8", "read_error_counts",
    "rms_norm", "rmsnorm_quant", "rope_cos_sin_cache", "rotary_embedding", "set_pdl",
    "yarn_cos_sin_cache", "yarn_get_mscale"]


def cuda_kernels_available() -> bool:
    """True when the extension registered CUDA kernels (built with the CUDA backend)."""
    return _torch._C._dispatch_has_kernel_for_dispatch_key("mlakv::mla_rope_cache", "CUDA")
