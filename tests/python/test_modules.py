"""The DeepSeek-V3 MLA layer of mlakv.modules: fused == unfused, paged == dense, graphs == eager."""

import copy
import math

import pytest
import torch

import mlakv
from mlakv.modules import DeepseekV3MLAttention, MLAConfig, dense_mla_reference, init_mla_weights_

from conftest import requires_cuda


class PagedEngine:
    """A minimal engine around one layer: block tables, slots and batches of decode tokens
    followed by prefill chunks, as vLLM would build them."""

    def __init__(self, layer, max_blocks_per_seq=6, seed=0):
        self.layer = layer
        self.bs = layer.config.block_size
        self.max_blocks = max_blocks_per_seq
        g = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(layer.config.num_blocks, generator=g).tolist()
        self.tables = {}
        self.lens = {}
        self.hidden = {}   # every token's hidden state per sequence, for the dense reference
        self.outputs = {}  # every token's layer output per sequence
        self.g = g

    def _slot(self, seq, pos):
        table = self.tables.setdefault(seq, [])
        while len(table) <= pos // self.bs:
            table.append(self.free_blocks.pop())
        return table[pos // self.bs] * self.bs + pos % self.bs

    def step(self, decode_seqs, prefill, pad_to=None):
        """decode_seqs: sequence ids taking one token each; prefill: (sequence id, new tokens).
        Returns the inputs it built (for graph tests) and records the outputs."""
        layer = self.layer
        dev = layer.kv_cache.device
        dtype = layer.config.dtype
        order = [(s, 1) for s in decode_seqs] + list(prefill)
        positions, slots, hidden = [], [], []
        for seq, n in order:
            start = self.lens.get(seq, 0)
            h = torch.randn(n, layer.config.hidden_size, generator=self.g).to(dtype)
            self.hidden.setdefault(seq, []).append(h)
            for p in range(start, start + n):
                positions.append(p)
                slots.append(self._slot(seq, p))
            self.lens[seq] = start + n
            hidden.append(h)
        block_table = torch.full((len(order), self.max_blocks), -1, dtype=torch.int32)
        for b, (seq, _) in enumerate(order):
            block_table[b, :len(self.tables[seq])] = torch.tensor(self.tables[seq])
        inputs = dict(
            hidden_states=torch.cat(hidden).to(dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_table=block_table.to(dev),
            seq_lens=torch.tensor([self.lens[s] for s, _ in order], dtype=torch.int32,
                                  device=dev),
            num_decode=len(decode_seqs),
            prefill_query_lens=[n for _, n in prefill] if prefill else None)
        out = layer(**inputs)
        self._record(order, out)
        return inputs, out

    def _record(self, order, out):
        row = 0
        for seq, n in order:
            self.outputs.setdefault(seq, []).append(out[row:row + n].float().cpu())
            row += n

    def dense_check(self, seq, rtol):
        """The sequence's outputs over all steps against the dense layer over the whole sequence."""
        hidden = torch.cat(self.hidden[seq])
        got = torch.cat(self.outputs[seq])
        layer = self.layer
        want = dense_mla_reference(layer, hidden.to(layer.kv_cache.device),
                                   torch.arange(hidden.shape[0], device=layer.kv_cache.device))
        want = want.cpu()
        err = (got - want).abs().max().item()
        scale = want.abs().max().item()
        assert err <= rtol * scale, f"seq {seq}: max error {err:.3g} vs max |ref| {scale:.3g}"


def make_layer(device="cpu", fused=None, seed=0, **overrides):
    torch.manual_seed(seed)
    layer = DeepseekV3MLAttention(MLAConfig.small(**overrides), device=device, fused=fused)
    init_mla_weights_(layer, torch.Generator().manual_seed(seed))
    return layer


SCENARIO = [
    # (decode sequences, prefill chunks)
    ([], [(0, 5), (1, 3), (2, 4)]),               # pure prefill
    ([0, 1], [(2, 3), (3, 6)]),                   # mixed: decodes, a second chunk, a new prompt
    ([0, 1, 2, 3], []),                           # pure decode
    ([3, 2], [(4, 2)]),
    ([0, 1, 2, 3, 4], []),
    ([], [(0, 2), (1, 3)]),                       # two chunks of sequences with cached context
]


@pytest.mark.parametrize("cache_format", ["bf16", "fp8_e4m3"])
def test_fused_equals_unfused(cache_format, monkeypatch):
    """MLAKV_FUSED=1 and MLAKV_FUSED=0 give identical outputs and caches, step after step."""
    fused_layer = make_layer(cache_format=cache_format, kv_cache_scale=0.05)
    unfused_layer = copy.deepcopy(fused_layer)
    engines = {}
    for env, layer in (("1", fused_layer), ("0", unfused_layer)):
        monkeypatch.setenv("MLAKV_FUSED", env)
        assert layer.use_fused() == (env == "1")
        engine = PagedEngine(layer)
        for decode, prefill in SCENARIO:
            engine.step(decode, prefill)
        engines[env] = engine
    assert torch.equal(fused_layer.kv_cache, unfused_layer.kv_cache)
    for seq in engines["1"].outputs:
        for a, b in zip(engines["1"].outputs[seq], engines["0"].outputs[seq]):
            assert torch.equal(a, b), f"sequence {seq}"


@pytest.mark.parametrize("dtype,cache_format,rtol", [
    # Relative to the largest output; observed: fp32 3e-7, bf16 4e-3, fp8 2e-2.
    (torch.float32, "fp32", 1e-5),
    (torch.bfloat16, "bf16", 2e-2),
    (torch.bfloat16, "fp8_e4m3", 6e-2),
])
@pytest.mark.parametrize("fused", [True, False])
def test_paged_steps_equal_dense_layer(dtype, cache_format, rtol, fused):
    """Prefill (chunked for one sequence), then several decode steps, equals the same layer run
    as one plain, non-paged causal computation over each whole sequence."""
    layer = make_layer(fused=fused, dtype=dtype, cache_format=cache_format, kv_cache_scale=0.05)
    engine = PagedEngine(layer)
    for decode, prefill in SCENARIO:
        engine.step(decode, prefill)
    for seq in range(5):
        engine.dense_check(seq, rtol)


@pytest.mark.parametrize("fused", [True, False])
def test_config_eps_reaches_every_norm(fused):
    """rms_norm_eps of the config is the eps of the q_a and kv_a norms on both paths (0.5: of the
    order of the activations' mean square, so a wrong eps shows against the dense layer)."""
    layer = make_layer(fused=fused, dtype=torch.float32, cache_format="fp32", rms_norm_eps=0.5)
    engine = PagedEngine(layer)
    engine.step([], [(0, 6), (1, 3)])
    engine.step([0, 1], [])
    for seq in (0, 1):
        engine.dense_check(seq, 1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_fp8_cache_holds_values_over_the_config_scale(fused):
    """kv_cache_scale of the config is the per-tensor fp8 cache's scale: the stored e4m3 values
    times the scale are the bf16 layer's cache values (to e4m3's precision)."""
    fp8 = make_layer(fused=fused, cache_format="fp8_e4m3", kv_cache_scale=0.05)
    bf16 = make_layer(fused=fused, cache_format="bf16")
    slots = None
    for layer in (fp8, bf16):
        engine = PagedEngine(layer)
        inputs, _ = engine.step([], [(0, 6), (1, 3)])
        slots = inputs["slot_mapping"]
    stored = fp8.kv_cache.view(torch.float8_e4m3fn).flatten(0, 1)[slots].float() * 0.05
    want = bf16.kv_cache.view(torch.bfloat16).flatten(0, 1)[slots].float()
    torch.testing.assert_close(stored, want, rtol=2 ** -3, atol=0.05 * 2 ** -9)


@pytest.mark.parametrize("fused", [True, False])
def test_fp8_ds_mla_cache(fused):
    """A layer on FlashMLA's fp8_ds_mla cache (L = 512, R = 64; no per-tensor scale) equals the
    dense layer to fp8's precision."""
    layer = make_layer(fused=fused, kv_lora_rank=512, qk_rope_head_dim=64,
                       cache_format="fp8_ds_mla")
    assert layer.kv_cache_scale is None
    engine = PagedEngine(layer)
    for decode, prefill in SCENARIO[:3]:
        engine.step(decode, prefill)
    for seq in range(4):
        engine.dense_check(seq, 6e-2)


@pytest.mark.parametrize("fused", [True, False])
def test_fused_argument_overrides_the_environment(fused, monkeypatch):
    """DeepseekV3MLAttention(fused=...) picks the path whatever MLAKV_FUSED says."""
    from mlakv import modules

    def unused(*args, **kwargs):
        raise AssertionError("the other path's op was called")

    monkeypatch.setenv("MLAKV_FUSED", "0" if fused else "1")
    monkeypatch.setattr(modules.ops, "concat_and_cache_mla" if fused else "mla_rope_cache",
                        unused)
    layer = make_layer(fused=fused)
    assert layer.use_fused() == fused
    PagedEngine(layer).step([], [(0, 4)])


def test_config_without_q_lora_and_plain_rope():
    """DeepSeek-V2-Lite style: q_proj straight from the hidden state, no YaRN."""
    layer = make_layer(dtype=torch.float32, cache_format="fp32", q_lora_rank=None,
                       rope_scaling=None)
    engine = PagedEngine(layer)
    engine.step([], [(0, 6), (1, 2)])
    engine.step([0, 1], [])
    engine.step([1, 0], [])
    for seq in (0, 1):
        engine.dense_check(seq, 1e-5)


def test_yarn_softmax_scale_and_table_follow_the_config():
    """The softmax scale takes mscale_all_dim (DeepSeek's yarn_get_mscale, squared) and the RoPE
    table every YaRN field, mscale and mscale_all_dim distinct so that a swap shows."""
    rs = {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 24.0,
          "beta_slow": 2.0, "mscale": 0.9, "mscale_all_dim": 0.707}
    layer = make_layer(rope_scaling=rs)
    m = 0.1 * 0.707 * math.log(4.0) + 1.0
    assert layer.scaling == pytest.approx((layer.P + layer.R) ** -0.5 * m * m)
    table = mlakv.yarn_cos_sin_cache(layer.R, base=layer.config.rope_theta, factor=4.0,
                                     original_max_position=64, beta_fast=24.0, beta_slow=2.0,
                                     mscale=0.9, mscale_all_dim=0.707,
                                     max_position=layer.cos_sin_cache.shape[0])
    assert torch.equal(layer.cos_sin_cache, table)


def test_forward_rejects_bad_batches():
    layer = make_layer()
    engine = PagedEngine(layer)
    inputs, _ = engine.step([], [(0, 4)])
    with pytest.raises(ValueError, match="num_decode"):
        layer(**{**inputs, "num_decode": 9})
    with pytest.raises(ValueError, match="prefill_query_lens"):
        layer(**{**inputs, "prefill_query_lens": [3]})
    # Lengths of the right count and sum, each within its sequence, one of them negative.
    inputs, _ = engine.step([], [(0, 2), (1, 2)])   # seq_lens [6, 2]
    with pytest.raises(ValueError, match="prefill_query_lens"):
        layer(**{**inputs, "prefill_query_lens": [5, -1]})


@pytest.mark.parametrize("cache_format", ["bf16", "fp8_e4m3"])
def test_dtype_casts_keep_the_fixed_dtype_buffers(cache_format):
    """layer.to(dtype) / .half() cast the weights, not the RoPE table, the cache or its scale (the
    ops' contract: float32 table and scale, the cache in its format's dtype). An engine's
    layer.to(model dtype), which leaves the weights as they are, leaves the outputs as they are."""
    layer = make_layer(cache_format=cache_format, kv_cache_scale=0.05)
    twin = copy.deepcopy(layer)
    names = ("cos_sin_cache", "kv_cache", "kv_cache_scale")
    before = {name: getattr(layer, name) for name in names}
    layer.to(layer.config.dtype)
    outs = [PagedEngine(l, seed=5).step([], [(0, 4)])[1] for l in (layer, twin)]
    assert torch.equal(outs[0], outs[1])
    for cast in (lambda m: m.half(), lambda m: m.to(torch.float32)):
        cast(layer)
        for name, old in before.items():
            new = getattr(layer, name)
            assert (new is None) if old is None else (new.dtype == old.dtype), name
    assert layer.kv_a_layernorm.dtype == torch.float32  # the weights do follow
    assert torch.equal(layer.cos_sin_cache, before["cos_sin_cache"])  # the table's values kept


@pytest.mark.parametrize("fused", [True, False])
def test_forward_after_a_dtype_cast(fused):
    """layer.half() of a bf16 layer: the config's dtype follows the weights, and the layer runs
    in fp16, prefill and decode, equal to the dense layer."""
    layer = make_layer(fused=fused).half()
    assert layer.config.dtype == torch.float16
    engine = PagedEngine(layer)
    for decode, prefill in SCENARIO[:3]:
        _, out = engine.step(decode, prefill)
        assert out.dtype == torch.float16
    for seq in range(4):
        engine.dense_check(seq, 2e-2)


def test_fp8_ds_mla_needs_a_bf16_layer():
    """fp8_ds_mla stores bf16 rope parts, so a layer of another dtype is refused when it is built
    or cast, not at its first forward; a refused cast leaves the layer as it was."""
    ds_mla = dict(kv_lora_rank=512, qk_rope_head_dim=64, cache_format="fp8_ds_mla")
    with pytest.raises(ValueError, match="fp8_ds_mla needs a bfloat16 model dtype"):
        make_layer(dtype=torch.float16, **ds_mla)
    layer = make_layer(**ds_mla)
    weight = layer.kv_b_proj.weight.clone()
    for cast in (layer.half, layer.float, lambda: layer.to(torch.float16)):
        with pytest.raises(ValueError, match="fp8_ds_mla needs a bfloat16 model dtype"):
            cast()
    assert layer.kv_b_proj.weight.dtype == torch.bfloat16
    assert layer.config.dtype == torch.bfloat16
    assert torch.equal(layer.kv_b_proj.weight, weight)
    layer.to(layer.kv_cache.device)  # a move without a cast is allowed
    engine = PagedEngine(layer)
    for decode, prefill in SCENARIO[:2]:
        engine.step(decode, prefill)
    # Other formats take any model dtype.
    assert make_layer(cache_format="fp8_e4m3").half().config.dtype == torch.float16


def test_empty_batch():
    """T = 0 (e.g. a padded engine step with nothing to do): an empty output, nothing written."""
    layer = make_layer()
    cache = layer.kv_cache.clone()
    dev = layer.kv_cache.device
    out = layer(hidden_states=torch.empty(0, layer.config.hidden_size, dtype=layer.config.dtype),
                positions=torch.empty(0, dtype=torch.int64),
                slot_mapping=torch.empty(0, dtype=torch.int64),
                block_table=torch.empty(0, 6, dtype=torch.int32, device=dev),
                seq_lens=torch.empty(0, dtype=torch.int32, device=dev), num_decode=0)
    assert out.shape == (0, layer.config.hidden_size)
    assert torch.equal(layer.kv_cache, cache)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fused", [True, False])
def test_decode_step_compiles_without_graph_breaks(fused, backend):
    """torch.compile(fullgraph=True) of a decode-only step: no graph break (the absorbed q is copied
    into q_out's nope part when compiled), the eager step's output and the eager step's cache.
    aot_eager also functionalizes the graph, so the ops' in-place writes (the cache, q_out) must
    survive it as their schemas declare them."""
    layer = make_layer(fused=fused)
    engine = PagedEngine(layer)
    engine.step([], [(0, 5), (1, 3)])
    twin = copy.deepcopy(layer)
    inputs, eager = engine.step([0, 1], [])
    assert not torch.equal(twin.kv_cache, layer.kv_cache)  # the step writes the cache
    torch._dynamo.reset()
    compiled = torch.compile(twin, fullgraph=True, backend=backend)
    # The twin's cache is the layer's before this step: the same step gives the same output.
    got = compiled(**inputs)
    assert torch.equal(got, eager)
    assert torch.equal(twin.kv_cache, layer.kv_cache)


def test_padded_decode_row_attends_to_nothing():
    """A decode row of a padded (graph-sized) batch, seq_len 0 and no blocks, gives zeros, not NaN,
    and leaves the real row's attention as it is alone (up to the batched einsum's rounding)."""
    layer = make_layer()
    engine = PagedEngine(layer)
    engine.step([], [(0, 5)])
    H, D = layer.config.num_heads, layer.L + layer.R
    q_out = torch.randn(2, H, D, generator=torch.Generator().manual_seed(3)).to(layer.config.dtype)
    table = torch.full((2, engine.max_blocks), -1, dtype=torch.int32)
    table[0, 0] = engine.tables[0][0]
    with torch.no_grad():
        both = layer._decode_attention(q_out, table, torch.tensor([5, 0], dtype=torch.int32))
        alone = layer._decode_attention(q_out[:1], table[:1], torch.tensor([5], dtype=torch.int32))
    assert torch.equal(both[1], torch.zeros_like(both[1]))
    torch.testing.assert_close(both[:1], alone)  # the batched einsum may round differently


@requires_cuda
@pytest.mark.parametrize("cache_format", ["bf16", "fp8_e4m3"])
def test_decode_step_in_cuda_graph_equals_eager(cache_format):
    layer = make_layer(device="cuda", cache_format=cache_format, kv_cache_scale=0.05)
    engine = PagedEngine(layer)
    engine.step([], [(0, 5), (1, 7), (2, 3)])
    static, _ = engine.step([0, 1, 2], [])      # eager warm-up of the decode shapes
    static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in static.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    saved = layer.kv_cache.clone()
    with torch.cuda.stream(stream):
        layer(**static)
    torch.cuda.current_stream().wait_stream(stream)
    layer.kv_cache.copy_(saved)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(**static)
    layer.kv_cache.copy_(saved)
    for _ in range(3):
        before = layer.kv_cache.clone()
        inputs, eager_out = engine.step([2, 0, 1], [])   # eager step (new tokens, new slots)
        eager_cache = layer.kv_cache.clone()
        layer.kv_cache.copy_(before)
        for k, v in inputs.items():
            if isinstance(v, torch.Tensor):
                static[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(layer.kv_cache, eager_cache)
        torch.testing.assert_close(static_out, eager_out, rtol=0, atol=0)
