"""Paged MLA cache formats, allocation helpers and the device error counters.

A cache is a tensor ``[num_blocks, block_size, entry]``: token ``slot`` lives in block
``slot // block_size`` at offset ``slot % block_size``. Every format can be held as a ``uint8``
byte tensor (``entry = cache_entry_bytes(format, L, R)``); the raw and per-tensor fp8 formats can
also be held as a tensor of their own element type (``entry = L + R``).

Formats (DESIGN.md):

* ``bf16`` / ``fp16`` / ``fp32``: ``L + R`` values, latent ``kv_c`` then the rotated ``k_pe``.
* ``fp8_e4m3`` / ``fp8_e5m2``: ``L + R`` fp8 values, ``value = byte * scale`` with one per-tensor
  fp32 scale in device memory (absent means 1.0).
* ``fp8_ds_mla`` (FlashMLA's sparse format, L = 512, R = 64 only): 656 bytes: 512 e4m3 values in
  four tiles of 128, four fp32 tile scales, then 64 bf16 rope values.
"""

import contextlib
from typing import Dict, Optional

import torch

CACHE_FORMATS = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla")

DS_MLA_LATENT_DIM = 512
DS_MLA_ROPE_DIM = 64
DS_MLA_TILE = 128
DS_MLA_NUM_TILES = 4
DS_MLA_ENTRY_BYTES = 656

_LATENT_DTYPE = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "fp8_ds_mla": torch.float8_e4m3fn,
}

_FORMAT_OF_DTYPE = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
}

# Names of the int32 counters an op increments instead of failing on a device (context.h).
ERROR_COUNTER_NAMES = ("bad_slot", "bad_position", "bad_decode_count", "bad_block_index")


def canonical_format(cache_format: str, kv_cache: Optional[torch.Tensor] = None) -> str:
    """The mlakv name of a format: ``"fp8"`` is ``fp8_e4m3``; ``"auto"`` takes a typed cache's."""
    if cache_format == "fp8":
        return "fp8_e4m3"
    if cache_format == "auto":
        if kv_cache is None or kv_cache.dtype not in _FORMAT_OF_DTYPE:
            raise ValueError("cache_format 'auto' needs a typed cache tensor (bfloat16, float16, "
                             "float32, float8_e4m3fn, float8_e5m2); a uint8 cache needs a format")
        return _FORMAT_OF_DTYPE[kv_cache.dtype]
    if cache_format not in CACHE_FORMATS:
        raise ValueError(f"cache_format: expected one of {CACHE_FORMATS}, 'fp8' or 'auto', "
                         f"got {cache_format!r}")
    return cache_format


def cache_latent_dtype(cache_format: str) -> torch.dtype:
    """Element type of the latent part (fp8_ds_mla: float8_e4m3fn)."""
    return _LATENT_DTYPE[canonical_format(cache_format)]


def cache_rope_dtype(cache_format: str) -> torch.dtype:
    """Element type of the rope part (fp8_ds_mla: bfloat16)."""
    fmt = canonical_format(cache_format)
    return torch.bfloat16 if fmt == "fp8_ds_mla" else _LATENT_DTYPE[fmt]


def is_per_tensor_fp8(cache_format: str) -> bool:
    return canonical_format(cache_format) in ("fp8_e4m3", "fp8_e5m2")


def cache_entry_bytes(cache_format: str, kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one token's entry (latent then rope)."""
    fmt = canonical_format(cache_format)
    if fmt == "fp8_ds_mla":
        if (kv_lora_rank, rope_dim) != (DS_MLA_LATENT_DIM, DS_MLA_ROPE_DIM):
            raise ValueError(f"fp8_ds_mla needs L = {DS_MLA_LATENT_DIM} and R = "
                             f"{DS_MLA_ROPE_DIM}, got L = {kv_lora_rank}, R = {rope_dim}")
        return DS_MLA_ENTRY_BYTES
    return (kv_lora_rank + rope_dim) * _LATENT_DTYPE[fmt].itemsize


def allocate_cache(num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int,
                   cache_format: str = "bf16", device="cpu", typed: bool = False,
                   fill: Optional[int] = None) -> torch.Tensor:
    """A combined paged cache ``[num_blocks, block_size, entry]``.

    ``typed=False`` gives a ``uint8`` tensor of ``cache_entry_bytes`` bytes per entry (every
    format); ``typed=True`` a tensor of the format's element type with ``L + R`` values per entry
    (raw and per-tensor fp8 formats). ``fill`` sets every byte (a sentinel for tests); else the
    memory is zeroed.
    """
    fmt = canonical_format(cache_format)
    entry = cache_entry_bytes(fmt, kv_lora_rank, rope_dim)
    cache = torch.zeros((num_blocks, block_size, entry), dtype=torch.uint8, device=device)
    if fill is not None:
        cache.fill_(fill)
    if typed:
        if fmt == "fp8_ds_mla":
            raise ValueError("an fp8_ds_mla cache is a uint8 byte tensor only")
        cache = cache.view(_LATENT_DTYPE[fmt])
    return cache


# The cache geometry every op accepts (src/core/validate.cpp): L a multiple of 16 in [16, 1024],
# R even in [2, 256].
LATENT_MULTIPLE = 16
MAX_LATENT_DIM = 1024
MAX_ROPE_DIM = 256


def cache_latent_width(kv_cache: torch.Tensor, cache_format: str, kv_lora_rank: int,
                       kv_cache_rope: Optional[torch.Tensor] = None) -> int:
    """L + R of a cache tensor: the width of one gathered row. Raises ValueError for a cache the
    ops reject by its layout alone (the binding's and the core's rules that need no data): not 3
    dims, an entry that is not contiguous, a negative stride, an element type that is neither
    uint8 nor the format's own, byte entries that do not hold whole values, a split fp8_ds_mla
    cache, one with another L than 512 or entries of other than 656 bytes, a rope part of other
    blocks than the latent part's, an entry narrower than L, and an L or R outside what every op
    accepts."""
    fmt = canonical_format(cache_format, kv_cache)
    for name, t in (("kv_cache", kv_cache), ("kv_cache_rope", kv_cache_rope)):
        if t is None:
            continue
        if t.dim() != 3:
            raise ValueError(f"{name}: expected [num_blocks, block_size, entry] (3 dims), got "
                             f"shape {list(t.shape)}")
        if t.shape[2] > 1 and t.stride(2) != 1:
            raise ValueError(f"{name}: expected a contiguous entry (innermost stride 1), got "
                             f"strides {list(t.stride())}")
        if t.stride(0) < 0 or t.stride(1) < 0:
            raise ValueError(f"{name}: expected non-negative strides, got {list(t.stride())}")
        if t.dtype != torch.uint8 and (fmt == "fp8_ds_mla" or t.dtype != _LATENT_DTYPE[fmt]):
            own = "" if fmt == "fp8_ds_mla" else f" or {_LATENT_DTYPE[fmt]}"
            raise ValueError(f"{name}: a {fmt} cache is a uint8{own} tensor, got {t.dtype}")
    if fmt == "fp8_ds_mla":
        if kv_cache_rope is not None:
            raise ValueError("kv_cache_rope: fp8_ds_mla has only the combined layout")
        if kv_lora_rank != DS_MLA_LATENT_DIM:
            raise ValueError(f"kv_cache: fp8_ds_mla needs L = {DS_MLA_LATENT_DIM} and R = "
                             f"{DS_MLA_ROPE_DIM}, got L = {kv_lora_rank}, R = {DS_MLA_ROPE_DIM} "
                             f"(L from kv_lora_rank)")
        entry_bytes = kv_cache.shape[2] * kv_cache.element_size()
        if entry_bytes != DS_MLA_ENTRY_BYTES:
            raise ValueError(f"kv_cache: an fp8_ds_mla entry is {DS_MLA_ENTRY_BYTES} bytes, got "
                             f"{entry_bytes} bytes per entry")
        return DS_MLA_LATENT_DIM + DS_MLA_ROPE_DIM
    elem = _LATENT_DTYPE[fmt].itemsize

    def values(name, t):  # the format's values in one entry of t
        entry_bytes = t.shape[2] * t.element_size()
        if entry_bytes % elem != 0:
            raise ValueError(f"{name}: a {fmt} cache holds whole values of {elem} bytes, got "
                             f"entries of {entry_bytes} bytes")
        return entry_bytes // elem

    latent = values("kv_cache", kv_cache)
    if kv_cache_rope is not None:
        if tuple(kv_cache_rope.shape[:2]) != tuple(kv_cache.shape[:2]):
            raise ValueError(f"kv_cache_rope: expected [{kv_cache.shape[0]}, {kv_cache.shape[1]}, "
                             f"R] like kv_cache, got shape {list(kv_cache_rope.shape)}")
        if kv_lora_rank >= 0 and kv_lora_rank != latent:
            raise ValueError(f"kv_cache: expected a latent part of {kv_lora_rank} values (L, from "
                             f"kv_lora_rank), got {latent}")
        L, R = latent, values("kv_cache_rope", kv_cache_rope)
    else:
        if kv_lora_rank < 0:
            raise ValueError(f"kv_lora_rank: expected >= 0, got {kv_lora_rank}")
        if kv_lora_rank > latent:
            raise ValueError(f"kv_lora_rank: expected at most {latent} (the values of a kv_cache "
                             f"entry), got {kv_lora_rank}")
        L, R = kv_lora_rank, latent - kv_lora_rank
    if not (LATENT_MULTIPLE <= L <= MAX_LATENT_DIM and L % LATENT_MULTIPLE == 0):
        raise ValueError(f"kv_cache: expected L (kv_lora_rank) a multiple of {LATENT_MULTIPLE} in "
                         f"[{LATENT_MULTIPLE}, {MAX_LATENT_DIM}], got L = {L}")
    if not (2 <= R <= MAX_ROPE_DIM and R % 2 == 0):
        raise ValueError(f"kv_cache: expected R (rope dim) even in [2, {MAX_ROPE_DIM}], got "
                         f"R = {R}")
    return L + R


def gather_row_width(kv_cache: torch.Tensor, cache_format: str, kv_lora_rank: int,
                     kv_cache_rope: Optional[torch.Tensor], out_dtype: torch.dtype) -> int:
    """The width L + R of the rows a gather op allocates, after the checks it makes before it
    allocates (``out_dtype``, the cache's layout); a failed one raises the op's RuntimeError."""
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise RuntimeError(f"mlakv: out_dtype: expected float32 or bfloat16, got {out_dtype}")
    with op_errors():
        return cache_latent_width(kv_cache, cache_format, kv_lora_rank, kv_cache_rope)


@contextlib.contextmanager
def op_errors():
    """The ValueError of a helper above, as the ops' own argument error: a RuntimeError
    ``mlakv: <message>`` (what a wrapper or fake kernel raises where the op would have)."""
    try:
        yield
    except ValueError as e:
        raise RuntimeError(f"mlakv: {e}") from None


def new_error_counts(device="cpu") -> torch.Tensor:
    """Zeroed int32 error counters for the ``error_counts`` argument of the ops."""
    return torch.zeros(len(ERROR_COUNTER_NAMES), dtype=torch.int32, device=device)


def read_error_counts(error_counts: torch.Tensor,
                      throw_if_nonzero: bool = False) -> Dict[str, int]:
    """The counters as a dict (copies to the host: synchronizes a CUDA stream). With
    ``throw_if_nonzero`` (for debugging an engine), a non-zero counter raises ``RuntimeError``
    naming each one. The counts add up over every op that was given the tensor: zero it
    (``error_counts.zero_()``) to check one step. (The C++ API's ``Context::checked`` instead
    throws from the op that counted.)"""
    values = error_counts.cpu().tolist()
    counts = {name: int(v) for name, v in zip(ERROR_COUNTER_NAMES, values)}
    nonzero = ", ".join(f"{name} = {v}" for name, v in counts.items() if v != 0)
    if throw_if_nonzero and nonzero:
        raise RuntimeError(f"mlakv: error_counts: non-zero counters: {nonzero}")
    return counts
