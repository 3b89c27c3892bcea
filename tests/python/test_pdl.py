"""The programmatic dependent launch switch (mlakv.set_pdl / pdl_enabled / pdl, MLAKV_PDL=1).

The switch changes how the CUDA kernels launch, never what they write: a chain of ops (a torch
kernel, rmsnorm_quant, the fused op, rmsnorm_quant of the fused op's output) gives the same bytes
with PDL on and off, eagerly and replayed from a CUDA graph captured with PDL on. On the CPU the
switch is ignored (the same chain runs there too).
"""

import os
import subprocess
import sys

import pytest
import torch

import mlakv

from conftest import CONFIGS, assert_bytes_equal, call_mla, make_mla_inputs, requires_cuda

TP8 = CONFIGS[1]
OPS = torch.ops.mlakv


@pytest.fixture(autouse=True)
def restore_pdl():
    """Every test leaves the process-wide switch as it found it."""
    before = mlakv.pdl_enabled()
    yield
    mlakv.set_pdl(before)


# ---- the switch --------------------------------------------------------------------------------
def test_set_pdl_round_trips():
    for value in (True, False, True, False):
        mlakv.set_pdl(value)
        assert mlakv.pdl_enabled() is value
        assert OPS.get_pdl() is value


def test_pdl_context_manager_restores():
    mlakv.set_pdl(False)
    with mlakv.pdl():
        assert mlakv.pdl_enabled()
        with mlakv.pdl(enabled=False):
            assert not mlakv.pdl_enabled()
        assert mlakv.pdl_enabled()
    assert not mlakv.pdl_enabled()

    mlakv.set_pdl(True)
    with pytest.raises(ValueError):
        with mlakv.pdl(False):
            assert not mlakv.pdl_enabled()
            raise ValueError("leaves the block")
    assert mlakv.pdl_enabled()


def test_exported():
    for name in ("set_pdl", "pdl_enabled", "pdl"):
        assert name in mlakv.__all__ and callable(getattr(mlakv, name))


@pytest.mark.parametrize("value,expected", [("1", True), ("0", False), (None, False)])
def test_env_sets_default_at_import(value, expected):
    env = dict(os.environ)
    env.pop("MLAKV_PDL", None)
    if value is not None:
        env["MLAKV_PDL"] = value
    out = subprocess.run([sys.executable, "-c", "import mlakv; print(mlakv.pdl_enabled())"],
                         env=env, cwd=os.path.dirname(os.path.abspath(__file__)),
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == str(expected)


def test_ops_need_no_fake_kernel():
    """No tensors in or out: FakeTensor mode and opcheck run the real kernels."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    mlakv.set_pdl(True)
    with FakeTensorMode():
        assert mlakv.pdl_enabled()
    torch.library.opcheck(OPS.set_pdl.default, (True,))
    torch.library.opcheck(OPS.get_pdl.default, ())


def test_set_pdl_inside_compiled_code_is_an_error():
    def step(x):
        mlakv.set_pdl(True)
        return x + 1

    torch._dynamo.reset()
    with pytest.raises(Exception, match="outside torch.compile"):
        torch.compile(step, fullgraph=True, backend="eager")(torch.ones(2))


# ---- same bytes with PDL on and off ------------------------------------------------------------
T, TD, N_Q = 16, 5, 1536  # N_Q: q_c width (q_lora_rank of DeepSeek-V3)


class Chain:
    """Static buffers of the chain: mla inputs/outputs, q_c and the two rmsnorm_quant outputs."""

    def __init__(self, fmt, device, seed):
        self.fmt = fmt
        self.x = make_mla_inputs(TP8, fmt, T=T, Td=TD, device=device, seed=seed, num_blocks=8)
        g = torch.Generator().manual_seed(seed + 1000)
        self.kv_c_src = (torch.randn(T, TP8.L, generator=g) * 2).to(torch.bfloat16).to(device)
        self.q_c = torch.randn(T, N_Q, generator=g).to(torch.bfloat16).to(device)
        self.q_weight = (0.5 + torch.rand(N_Q, generator=g)).to(torch.bfloat16).to(device)
        self.q_fp8 = torch.full((T, N_Q), 3.0, device=device).to(torch.float8_e4m3fn)
        self.q_scales = torch.full((T, N_Q // 128), -7.0, device=device)
        self.kv_fp8 = torch.full((T, TP8.L), 3.0, device=device).to(torch.float8_e4m3fn)
        self.kv_scales = torch.full((T, TP8.L // 128), -7.0, device=device)
        self.x.kv_c.fill_(-5.0)  # the chain's first kernel writes the real kv_c

    def run(self):
        x = self.x
        x.kv_c[:T].copy_(self.kv_c_src)  # a torch kernel right before the mlakv ops
        OPS.rmsnorm_quant(self.q_c, self.q_weight, 1e-6, self.q_fp8, self.q_scales)
        call_mla(mlakv.mla_rope_cache, x, self.fmt)  # reads kv_c, writes kv_c_out
        OPS.rmsnorm_quant(x.kv_c_out[:T], x.kv_norm_weight, 1e-6, self.kv_fp8, self.kv_scales)

    def outputs(self):
        x = self.x
        return {"kv_cache": x.kv_cache, "q_out": x.q_out, "q": x.q, "k_pe_out": x.k_pe_out,
                "kv_c_out": x.kv_c_out, "q_fp8": self.q_fp8, "q_scales": self.q_scales,
                "kv_fp8": self.kv_fp8, "kv_scales": self.kv_scales}

    def load(self, other):
        """Copies another chain's inputs and poisoned outputs into these (static) buffers."""
        for name in ("positions", "slot_mapping", "kv_c", "k_pe", "kv_norm_weight", "q_pe",
                     "ql_nope", "q", "kv_cache", "q_out", "k_pe_out", "kv_c_out"):
            getattr(self.x, name).copy_(getattr(other.x, name))
        for name in ("kv_c_src", "q_c", "q_weight", "q_fp8", "q_scales", "kv_fp8", "kv_scales"):
            getattr(self, name).copy_(getattr(other, name))


def assert_same_outputs(actual: Chain, expected: Chain):
    want = expected.outputs()
    for name, got in actual.outputs().items():
        try:
            assert_bytes_equal(got, want[name])
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


FORMATS = ["bf16", "fp8_e4m3", "fp8_ds_mla"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_same_bytes_with_pdl_on_and_off(fmt, device):
    off, on = Chain(fmt, device, seed=30), Chain(fmt, device, seed=30)
    with mlakv.pdl(False):
        off.run()
    with mlakv.pdl(True):
        on.run()
    if device != "cpu":
        torch.cuda.synchronize(device)
    # The chain ran: the last op's scales come from the fused op's normalized kv_c.
    assert bool((off.kv_scales > 0).all()) and bool((off.q_scales > 0).all())
    assert_same_outputs(on, off)


@requires_cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_graph_captured_with_pdl_same_bytes(fmt):
    """A graph captured with PDL on, replayed (with PDL off by then: the graph keeps its launch
    attributes) over new inputs, writes what the eager chain without PDL writes."""
    graph_chain = Chain(fmt, "cuda", seed=40)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with mlakv.pdl(True):
        with torch.cuda.stream(stream):
            graph_chain.run()  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_chain.run()
    mlakv.set_pdl(False)
    for seed in (41, 42, 43):
        new = Chain(fmt, "cuda", seed=seed)
        graph_chain.load(new)
        graph.replay()
        new.run()
        torch.cuda.synchronize()
        assert_same_outputs(graph_chain, new)
