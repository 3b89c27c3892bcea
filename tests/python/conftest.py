"""Shared fixtures of the Python suite: named configs, devices, input builders, comparisons."""

import dataclasses

import pytest
import torch

import mlakv
from mlakv import reference as ref


@dataclasses.dataclass(frozen=True)
class OpConfig:
    name: str
    H: int
    L: int
    R: int
    P: int

    def __str__(self):
        return self.name


# The named configs of the core tests (DESIGN.md "Other shapes to keep working").
CONFIGS = [
    OpConfig("deepseek_v3", H=128, L=512, R=64, P=128),
    OpConfig("deepseek_v3_tp8", H=16, L=512, R=64, P=128),
    OpConfig("kimi_k2", H=64, L=512, R=64, P=128),
    OpConfig("deepseek_v2_lite", H=16, L=512, R=64, P=128),
    OpConfig("minicpm3", H=40, L=256, R=32, P=64),
]
CONFIG_IDS = [c.name for c in CONFIGS]

RAW_FORMATS = ["bf16", "fp16", "fp32"]
FP8_FORMATS = ["fp8_e4m3", "fp8_e5m2"]
ALL_FORMATS = RAW_FORMATS + FP8_FORMATS + ["fp8_ds_mla"]


def formats_for(cfg: OpConfig):
    """fp8_ds_mla exists for L = 512, R = 64 only."""
    return [f for f in ALL_FORMATS if f != "fp8_ds_mla" or (cfg.L, cfg.R) == (512, 64)]


def config_format_params():
    return [pytest.param(c, f, id=f"{c.name}-{f}") for c in CONFIGS for f in formats_for(c)]


def _cuda_ready():
    return torch.cuda.is_available() and mlakv.cuda_kernels_available()


def _cuda_devices():
    """The current GPU, and cuda:1 when two are visible: its tensors while cuda:0 stays current."""
    if not _cuda_ready():
        return []
    return ["cuda"] + (["cuda:1"] if torch.cuda.device_count() > 1 else [])


DEVICES = ["cpu"] + _cuda_devices()
requires_cuda = pytest.mark.skipif(not _cuda_ready(),
                                   reason="needs a GPU and the extension's CUDA kernels")


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


SENTINEL = 0x5A  # every byte of a fresh test cache: untouched entries must keep it


@dataclasses.dataclass
class MlaInputs:
    """Inputs of one mla_rope_cache call (T tokens, Td of them decode) plus its outputs."""
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cos_sin_cache: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    kv_cache: torch.Tensor
    kv_cache_scale: torch.Tensor
    kv_norm_weight: torch.Tensor
    q_pe: torch.Tensor
    ql_nope: torch.Tensor
    q_out: torch.Tensor
    q: torch.Tensor
    k_pe_out: torch.Tensor
    kv_c_out: torch.Tensor
    Td: int

    def clone(self):
        return MlaInputs(**{k: (v.clone() if isinstance(v, torch.Tensor) else v)
                            for k, v in dataclasses.asdict(self).items()})


def make_mla_inputs(cfg: OpConfig, fmt: str, T=6, Td=2, dtype=torch.bfloat16, device="cpu",
                    num_blocks=5, block_size=4, seed=0, max_pos=300, pad_rows=0) -> MlaInputs:
    """Random inputs (never zeros): a slot mapping over several blocks with one padding slot,
    per-token tensors with ``pad_rows`` extra rows, outputs poisoned."""
    g = torch.Generator().manual_seed(seed)
    rows = T + pad_rows

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    num_slots = num_blocks * block_size
    perm = torch.randperm(num_slots, generator=g)[:T]
    slots = perm.clone()
    if T > 2:
        slots[T // 2] = -1
    positions = torch.randint(0, max_pos, (T,), generator=g)
    scale = torch.tensor([0.37], dtype=torch.float32, device=device)
    return MlaInputs(
        positions=positions.to(device),
        slot_mapping=slots.to(device),
        cos_sin_cache=mlakv.yarn_cos_sin_cache(cfg.R, factor=40.0, original_max_position=4096,
                                               max_position=max_pos, device=device),
        kv_c=rnd(rows, cfg.L, scale=2.0),
        k_pe=rnd(rows, cfg.R, scale=2.0),
        kv_cache=mlakv.allocate_cache(num_blocks, block_size, cfg.L, cfg.R, fmt, device=device,
                                      fill=SENTINEL),
        kv_cache_scale=scale,
        kv_norm_weight=(1.0 + 0.25 * torch.randn(cfg.L, generator=g)).to(dtype).to(device),
        q_pe=rnd(rows, cfg.H, cfg.R),
        ql_nope=rnd(rows, cfg.H, cfg.L),
        q_out=torch.full((rows, cfg.H, cfg.L + cfg.R), 7.0, dtype=dtype, device=device),
        q=rnd(rows, cfg.H, cfg.P + cfg.R),
        k_pe_out=torch.full((rows, cfg.R), -3.0, dtype=dtype, device=device),
        kv_c_out=torch.full((rows, cfg.L), -3.0, dtype=dtype, device=device),
        Td=Td,
    )


def mla_kwargs(x: MlaInputs, fmt: str, norm=True, decode=True, prefill=True, **extra):
    kw = dict(cache_format=fmt, kv_cache_scale=x.kv_cache_scale if fmt in FP8_FORMATS else None,
              kv_norm_weight=x.kv_norm_weight if norm else None, k_pe_out=x.k_pe_out,
              kv_c_out=x.kv_c_out, num_decode_tokens=x.Td)
    if decode:
        kw.update(q_pe=x.q_pe, ql_nope=x.ql_nope, q_out=x.q_out)
    if prefill:
        kw.update(q=x.q)
    kw.update(extra)
    return kw


def call_mla(fn, x: MlaInputs, fmt: str, **kw):
    fn(x.positions, x.slot_mapping, x.cos_sin_cache, x.kv_c, x.k_pe, x.kv_cache,
       **mla_kwargs(x, fmt, **kw))


# ---- comparisons -------------------------------------------------------------------------------
def ulp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of their dtype (same-sign finite values)."""
    assert a.dtype == b.dtype
    int_type = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    ia = a.cpu().contiguous().view(int_type).to(torch.int64)
    ib = b.cpu().contiguous().view(int_type).to(torch.int64)
    sign = 1 << (8 * a.element_size() - 1)
    # Map sign-magnitude to a monotonic integer line.
    ia = torch.where(ia < 0, -(ia + sign), ia)
    ib = torch.where(ib < 0, -(ib + sign), ib)
    return (ia - ib).abs()


def assert_ulp_close(actual, expected, max_ulp=1):
    d = ulp_diff(actual, expected)
    assert int(d.max()) <= max_ulp, f"max ulp difference {int(d.max())} > {max_ulp}"


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor):
    a = actual.cpu().contiguous().view(torch.uint8)
    e = expected.cpu().contiguous().view(torch.uint8)
    if not torch.equal(a, e):
        bad = (a != e).nonzero()
        raise AssertionError(f"{bad.shape[0]} bytes differ, first at {bad[0].tolist()}: "
                             f"{int(a[tuple(bad[0])])} != {int(e[tuple(bad[0])])}")
