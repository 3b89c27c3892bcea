"""torch.library.opcheck of every op, torch.compile(fullgraph=True) and CUDA-graph capture."""

import contextlib

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

import mlakv
from mlakv import reference as ref

from conftest import (CONFIGS, assert_bytes_equal, call_mla, make_mla_inputs, mla_kwargs,
                      requires_cuda)

TP8 = CONFIGS[1]
OPS = torch.ops.mlakv


def _mla_args(x, fmt, **kw):
    k = mla_kwargs(x, fmt, **kw)
    return (x.positions, x.slot_mapping, x.cos_sin_cache, False, x.kv_c, x.k_pe, x.kv_cache, fmt,
            k.get("kv_cache_scale"), None, k.get("kv_norm_weight"), 1e-6, k.get("k_pe_out"),
            k.get("kv_c_out"), k.get("q_pe"), k.get("ql_nope"), k.get("q_out"), None, k.get("q"),
            None, x.Td, None, None, False)


def fill_padding_slot(x):
    """Gives the padding token a free slot (two tokens on one slot would race on a GPU)."""
    num_slots = x.kv_cache.shape[0] * x.kv_cache.shape[1]
    used = set(x.slot_mapping.tolist())
    free = next(s for s in range(num_slots) if s not in used)
    x.slot_mapping[x.slot_mapping < 0] = free


def _opcheck(op, args):
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "fp8_ds_mla"])
def test_opcheck_mla_rope_cache(fmt, device):
    x = make_mla_inputs(TP8, fmt, T=4, device=device)
    _opcheck(OPS.mla_rope_cache.default, _mla_args(x, fmt))
    # The decode-only form with a device Td and the error counters.
    x = make_mla_inputs(TP8, fmt, T=4, Td=4, device=device)
    args = list(_mla_args(x, fmt, prefill=False))
    args[20] = 0  # the host Td stays 0 beside a device one
    args[21] = torch.tensor([3], dtype=torch.int32, device=device)
    args[22] = mlakv.new_error_counts(device)
    _opcheck(OPS.mla_rope_cache.default, tuple(args))


def test_opcheck_mla_rope_cache_other_outputs(device):
    """The arguments the cases above leave out: a split cache (kv_cache_rope), a separate
    q_prefill_out, and an fp8 q_out with its q_scale."""
    x = make_mla_inputs(TP8, "bf16", T=4, device=device)
    args = list(_mla_args(x, "bf16"))
    blocks = x.kv_cache.shape[:2]
    args[6] = torch.zeros(*blocks, TP8.L, dtype=torch.bfloat16, device=device)
    args[9] = torch.zeros(*blocks, TP8.R, dtype=torch.bfloat16, device=device)
    args[19] = torch.zeros_like(x.q)
    _opcheck(OPS.mla_rope_cache.default, tuple(args))
    _opcheck(OPS.mla_rope_cache.q_prefill_out, tuple(args))
    args[16] = torch.zeros(x.q_out.shape, dtype=torch.float8_e4m3fn, device=device)
    args[17] = torch.tensor([0.02], device=device)
    # test_schema compares float8 outputs with arithmetic torch does not implement for float8
    # (test_rmsnorm_quant.py's test_opcheck says more); the other three run.
    torch.library.opcheck(OPS.mla_rope_cache.default, tuple(args),
                          test_utils=("test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def test_opcheck_primitives(device):
    x = make_mla_inputs(TP8, "bf16", T=4, device=device)
    T = x.slot_mapping.shape[0]
    _opcheck(OPS.rotary_embedding.default,
             (x.positions, x.q[:T, :, TP8.P:], x.k_pe[:T].clone().view(T, 1, TP8.R), TP8.R,
              x.cos_sin_cache, False, None))
    _opcheck(OPS.concat_and_cache_mla.default,
             (x.kv_c, x.k_pe, x.kv_cache, x.slot_mapping, "bf16", None, None,
              mlakv.new_error_counts(device), False))
    _opcheck(OPS.decode_q_concat.default, (x.ql_nope[:T], x.q_pe[:T], x.q_out[:T], None))
    _opcheck(OPS.rms_norm.default, (torch.empty_like(x.kv_c), x.kv_c, x.kv_norm_weight, 1e-6))


def _written_tensor_cases(device):
    """(op, args) of every op that writes into its arguments."""
    x = make_mla_inputs(TP8, "bf16", T=4, device=device)
    T, L, R, P = x.slot_mapping.shape[0], TP8.L, TP8.R, TP8.P
    counts = mlakv.new_error_counts(device)
    block_table = torch.tensor([[1, 0], [3, 2]], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32, device=device)
    rows = torch.randn(4, 1536, device=device).bfloat16()
    w = torch.ones(1536, device=device).bfloat16()
    kv_w = torch.ones(L, device=device).bfloat16()

    def quant_out():
        return (torch.empty(4, 1536, dtype=torch.float8_e4m3fn, device=device),
                torch.empty(4, 12, device=device))
    separate = list(_mla_args(make_mla_inputs(TP8, "bf16", T=4, device=device), "bf16"))
    separate[19] = torch.zeros_like(separate[18])  # q_prefill_out: q stays read only
    return [
        (OPS.mla_rope_cache.default, _mla_args(x, "bf16")),
        (OPS.mla_rope_cache.q_prefill_out, tuple(separate)),
        (OPS.rotary_embedding.default,
         (x.positions, x.q[:T, :, P:], x.k_pe[:T].clone().view(T, 1, R), R, x.cos_sin_cache,
          False, counts)),
        (OPS.concat_and_cache_mla.default,
         (x.kv_c, x.k_pe, x.kv_cache, x.slot_mapping, "bf16", None, None, counts, False)),
        (OPS.decode_q_concat.default, (x.ql_nope[:T], x.q_pe[:T], x.q_out[:T], None)),
        (OPS.rms_norm.default, (torch.empty_like(x.kv_c), x.kv_c, x.kv_norm_weight, 1e-6)),
        (OPS.gather_cache_slots_out.default,
         (torch.empty(T, L + R, device=device), x.kv_cache, "bf16", None, None, x.slot_mapping,
          L, counts)),
        (OPS.gather_cache_sequences_out.default,
         (torch.empty(8, L + R, device=device), x.kv_cache, "bf16", None, None, block_table, cu,
          L, counts)),
        (OPS.rmsnorm_quant.default,
         (rows, w, 1e-6, *quant_out(), 128, None, False, rows.clone(), torch.empty_like(rows))),
        (OPS.mla_rmsnorm_quant.default,
         (rows, w, 1e-6, *quant_out(), x.kv_c[:4], kv_w, 1e-6, torch.empty_like(x.kv_c[:4]))),
        (OPS.per_token_group_quant_fp8.default, (rows, *quant_out())),
    ]


def test_written_tensors_get_new_versions(device):
    """Every tensor an op writes (Tensor(a!) in its schema) has its version counter bumped, as
    torch's in-place ops do, and no other tensor does: autograd then sees the write."""
    for op, args in _written_tensor_cases(device):
        written = [isinstance(a, torch.Tensor) and arg.alias_info is not None and
                   arg.alias_info.is_write for a, arg in zip(args, op._schema.arguments)]
        assert any(written), op
        # A tensor given twice (an input and the tensor written) counts as written.
        written_ids = {id(a) for a, w in zip(args, written) if w}
        before = [a._version if isinstance(a, torch.Tensor) else None for a in args]
        op(*args)
        for a, v, arg in zip(args, before, op._schema.arguments):
            if not isinstance(a, torch.Tensor):
                continue
            if id(a) in written_ids:
                assert a._version > v, f"{op}: {arg.name} written, version unchanged"
            elif not any(a._base is b or b._base is a for b in args
                         if isinstance(b, torch.Tensor) and id(b) in written_ids):
                assert a._version == v, f"{op}: {arg.name} read only, version changed"


def test_autograd_sees_the_ops_writes():
    """A tensor saved for backward and then rotated in place by rotary_embedding: backward raises
    autograd's in-place error instead of computing gradients from the rotated values."""
    a = torch.randn(4, 2, 64, requires_grad=True)
    q = a * 1.0
    y = (q * q).sum()
    OPS.rotary_embedding(torch.arange(4), q, None, 64, mlakv.rope_cos_sin_cache(64, 8), False,
                         None)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e5m2", "fp8_ds_mla"])
def test_opcheck_gathers(fmt, device):
    x = make_mla_inputs(TP8, fmt, T=4, device=device)
    scale = x.kv_cache_scale if fmt.startswith("fp8_e") else None
    mlakv.concat_and_cache_mla(x.kv_c, x.k_pe, x.kv_cache, x.slot_mapping, cache_format=fmt,
                               kv_cache_scale=scale)
    width = TP8.L + TP8.R
    _opcheck(OPS.gather_cache_slots.default,
             (x.kv_cache, fmt, scale, None, x.slot_mapping, TP8.L, torch.bfloat16))
    _opcheck(OPS.gather_cache_slots_out.default,
             (torch.empty(4, width, device=device), x.kv_cache, fmt, scale, None, x.slot_mapping,
              TP8.L, mlakv.new_error_counts(device)))
    block_table = torch.tensor([[1, 0], [3, 2]], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32, device=device)
    _opcheck(OPS.gather_cache_sequences.default,
             (x.kv_cache, fmt, scale, None, block_table, cu, 8, TP8.L, torch.float32))
    _opcheck(OPS.gather_cache_sequences_out.default,
             (torch.zeros(8, width, dtype=torch.bfloat16, device=device), x.kv_cache, fmt, scale,
              None, block_table, cu, TP8.L, mlakv.new_error_counts(device)))


def test_torch_compile_fullgraph(device):
    """A decode step around the fused op compiles into one graph (fullgraph=True: a graph break
    would raise) and gives the eager result."""
    cfg = TP8

    def step(positions, slot_mapping, table, kv_c, k_pe, kv_cache, q_pe, ql_nope, w):
        T = slot_mapping.shape[0]
        q_out = torch.empty(T, cfg.H, cfg.L + cfg.R, dtype=kv_c.dtype, device=kv_c.device)
        mlakv.mla_rope_cache(positions, slot_mapping, table, kv_c * 1.5, k_pe, kv_cache,
                             cache_format="bf16", kv_norm_weight=w, q_pe=q_pe, ql_nope=ql_nope,
                             q_out=q_out, num_decode_tokens=T)
        kv = mlakv.gather_cache_slots(kv_cache, slot_mapping, kv_lora_rank=cfg.L,
                                      cache_format="bf16")
        return q_out.float().sum(-1), kv

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    x = make_mla_inputs(cfg, "bf16", T=4, Td=4, device=device)
    fill_padding_slot(x)  # no padding: gather reads every row back
    y = x.clone()
    args = lambda v: (v.positions, v.slot_mapping, v.cos_sin_cache, v.kv_c, v.k_pe, v.kv_cache,
                      v.q_pe, v.ql_nope, v.kv_norm_weight)
    got = compiled(*args(x))
    want = step(*args(y))
    assert_bytes_equal(x.kv_cache, y.kv_cache)
    torch.testing.assert_close(got[0], want[0])  # the compiled sum may add in another order
    assert_bytes_equal(got[1], want[1])


# ---- torch.compile with outputs that alias inputs ----------------------------------------------
# The ops take outputs that may be their read-only inputs (k_pe_out = k_pe, kv_c_out = kv_c, q_pe
# as q_out's rope part, rms_norm's out = input, rmsnorm_quant's normed_out = input). Compiled with
# fullgraph=True such calls must give the eager bytes, and a read of the aliased tensor after the
# op must see the op's write. aot_eager runs the functionalized graph as traced (the op writes
# into copies of its mutable arguments, which are copied back); inductor re-inplaces it and hands
# the op the aliased tensors themselves, as eager does.
COMPILE_BACKENDS = ["aot_eager", "inductor"]


def _compiled(fn, backend):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)


def _mla_in_place(positions, slot_mapping, table, kv_c, k_pe, kv_cache, w, ql_nope, q_out):
    """The fused op with k_pe_out = k_pe, kv_c_out = kv_c and q_pe = q_out's rope part."""
    T = slot_mapping.shape[0]
    mlakv.mla_rope_cache(positions, slot_mapping, table, kv_c, k_pe, kv_cache, cache_format="bf16",
                         kv_norm_weight=w, k_pe_out=k_pe, kv_c_out=kv_c,
                         q_pe=q_out[:, :, TP8.L:], ql_nope=ql_nope, q_out=q_out,
                         num_decode_tokens=T)


def _mla_in_place_inputs(seed, device):
    x = make_mla_inputs(TP8, "bf16", T=5, Td=5, device=device, seed=seed)
    x.q_out[:, :, TP8.L:] = x.q_pe  # the rope part holds q_pe (rotated in place)
    return x


def _mla_in_place_args(x):
    return (x.positions, x.slot_mapping, x.cos_sin_cache, x.kv_c, x.k_pe, x.kv_cache,
            x.kv_norm_weight, x.ql_nope, x.q_out)


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_torch_compile_mla_outputs_alias_inputs(backend, device):
    """k_pe_out = k_pe, kv_c_out = kv_c (with kv_norm_weight) and q_pe in q_out, compiled: the
    eager bytes in k_pe, kv_c, the cache and q_out."""
    x = _mla_in_place_inputs(30, device)
    y = x.clone()
    _compiled(_mla_in_place, backend)(*_mla_in_place_args(x))
    _mla_in_place(*_mla_in_place_args(y))
    fresh = _mla_in_place_inputs(30, device)
    for name in ("k_pe", "kv_c", "kv_cache", "q_out"):
        assert_bytes_equal(getattr(x, name), getattr(y, name))
        assert not torch.equal(getattr(x, name), getattr(fresh, name)), f"{name} not written"


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_torch_compile_reads_aliased_input_after_the_op(backend, device):
    """Inside the compiled function kv_c is read before the op, and k_pe, kv_c and q_out's rope
    part after it wrote them in place: the reads must be ordered around the mutation."""
    def step(positions, slot_mapping, table, kv_c, k_pe, kv_cache, w, ql_nope, q_out):
        before = kv_c.float().sum(-1)
        _mla_in_place(positions, slot_mapping, table, kv_c, k_pe, kv_cache, w, ql_nope, q_out)
        return before, k_pe.clone(), kv_c * 2, q_out[:, :, TP8.L:].clone()

    x = _mla_in_place_inputs(31, device)
    y = x.clone()
    got = _compiled(step, backend)(*_mla_in_place_args(x))
    want = step(*_mla_in_place_args(y))
    torch.testing.assert_close(got[0], want[0])  # the compiled sum may add in another order
    for g, w in zip(got[1:], want[1:]):
        assert_bytes_equal(g, w)
    for name in ("k_pe", "kv_c", "kv_cache", "q_out"):
        assert_bytes_equal(getattr(x, name), getattr(y, name))


def _prefill_step(positions, slot_mapping, table, kv_c, k_pe, kv_cache, q, q_prefill_out):
    """A prefill batch's fused op with the rotated q in q_prefill_out; q is read after it."""
    mlakv.mla_rope_cache(positions, slot_mapping, table, kv_c, k_pe, kv_cache, cache_format="bf16",
                         q=q, q_prefill_out=q_prefill_out)
    return q * 2


def _prefill_step_in_place(positions, slot_mapping, table, kv_c, k_pe, kv_cache, q, unused):
    """_prefill_step with q rotated in place (q_prefill_out absent)."""
    return _prefill_step(positions, slot_mapping, table, kv_c, k_pe, kv_cache, q, None)


def _prefill_step_args(x, q_prefill_out):
    return (x.positions, x.slot_mapping, x.cos_sin_cache, x.kv_c, x.k_pe, x.kv_cache, x.q,
            q_prefill_out)


def _functionalized_mla_call(step, args):
    """The op and keyword arguments of the auto_functionalized_v2 node that stands for step's one
    mlakv op in its functionalized graph (a read-only argument is passed as itself; a written one
    as an index into _all_bases, the tensors the graph treats as written)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm
    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, dynamic=False,
                  backend=aot_autograd(fw_compiler=keep))(*args)
    (node,) = [n for n in graphs[0].graph.nodes
               if n.target is torch.ops.higher_order.auto_functionalized_v2]
    return node.args[0], node.kwargs


def test_separate_q_prefill_out_leaves_q_read_only(device):
    """With a q_prefill_out other than q, mlakv.mla_rope_cache calls the overload whose schema
    leaves q read only: the functionalized graph passes q to the op as a plain input, so nothing
    copies q or writes it back. In place (q_prefill_out absent), q is written (the default
    overload), and the graph treats it so."""
    schema = OPS.mla_rope_cache.q_prefill_out._schema
    args = {a.name: a for a in schema.arguments}
    assert args["q"].alias_info is None
    assert args["q_prefill_out"].alias_info.is_write
    assert OPS.mla_rope_cache.default._schema.arguments[18].alias_info.is_write

    x = make_mla_inputs(TP8, "bf16", T=6, Td=0, device=device, seed=33)
    op, kwargs = _functionalized_mla_call(_prefill_step,
                                          _prefill_step_args(x, torch.zeros_like(x.q)))
    assert op is OPS.mla_rope_cache.q_prefill_out
    assert "q" in kwargs and "_q_base_index" not in kwargs, "q handed to the op as written"
    assert kwargs["q"] not in kwargs["_all_bases"]
    assert kwargs["_q_prefill_out_base_index"] is not None

    op, kwargs = _functionalized_mla_call(_prefill_step_in_place,
                                          _prefill_step_args(x, torch.zeros_like(x.q)))
    assert op is OPS.mla_rope_cache.default
    assert "q" not in kwargs and kwargs["_q_base_index"] is not None


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_torch_compile_separate_q_prefill_out(backend, device):
    """Compiled with a separate q_prefill_out: q keeps its bytes (and the value read after the op
    is the old q), q_prefill_out and the cache get eager's bytes."""
    x = make_mla_inputs(TP8, "bf16", T=6, Td=0, device=device, seed=34)
    y = x.clone()
    q_before = x.q.clone()
    out_x, out_y = torch.zeros_like(x.q), torch.zeros_like(y.q)
    got = _compiled(_prefill_step, backend)(*_prefill_step_args(x, out_x))
    want = _prefill_step(*_prefill_step_args(y, out_y))
    assert_bytes_equal(x.q, q_before)
    assert_bytes_equal(got, want)
    assert_bytes_equal(got, q_before * 2)
    assert_bytes_equal(out_x, out_y)
    assert_bytes_equal(x.kv_cache, y.kv_cache)
    assert not torch.equal(out_x, torch.zeros_like(out_x)), "q_prefill_out not written"


@pytest.mark.parametrize("backend", [None] + COMPILE_BACKENDS)
def test_q_prefill_out_a_view_of_q(backend, device):
    """q_prefill_out = q[:] (another tensor at q's address: the in-place form) through the wrapper,
    which then calls the q_prefill_out overload: q is rotated in place as with q_prefill_out
    absent, and a read of q after the op sees it, eager and compiled (a write through an argument
    that aliases q is a write to q for torch, whatever q's own annotation)."""
    def view_step(positions, slot_mapping, table, kv_c, k_pe, kv_cache, q, unused):
        return _prefill_step(positions, slot_mapping, table, kv_c, k_pe, kv_cache, q, q[:])

    x = make_mla_inputs(TP8, "bf16", T=6, Td=0, device=device, seed=35)
    y = x.clone()
    q_before = x.q.clone()
    step = view_step if backend is None else _compiled(view_step, backend)
    got = step(*_prefill_step_args(x, None))
    want = _prefill_step_in_place(*_prefill_step_args(y, None))
    assert not torch.equal(x.q, q_before), "q not rotated"
    assert_bytes_equal(x.q, y.q)
    assert_bytes_equal(got, want)
    assert_bytes_equal(x.kv_cache, y.kv_cache)


def _check_norm_in_place(step, seed, T, N, backend, device):
    """step(x, w) normalizes a bf16 [T, N] x in place: compiled and eager (on a clone) return the
    same bytes, and x ends as a separate rms_norm output would be."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, N, generator=g) * 3).to(torch.bfloat16).to(device)
    w = (1.0 + 0.25 * torch.randn(N, generator=g)).to(torch.bfloat16).to(device)
    y = x.clone()
    separate = mlakv.rms_norm(x.clone(), w, 1e-6)
    got = _compiled(step, backend)(x, w)
    want = step(y, w)
    for a, b in zip(got, want):
        assert_bytes_equal(a, b)
    assert_bytes_equal(x, separate)
    assert_bytes_equal(y, separate)


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_torch_compile_rms_norm_in_place(backend, device):
    """rms_norm with out = input compiled, the input read again after the op; in place equals a
    separate output."""
    def step(x, w):
        before = x.clone()
        mlakv.rms_norm(x, w, 1e-6, out=x)
        return before, x.clone(), x * 2

    _check_norm_in_place(step, 32, 9, 1536, backend, device)


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_torch_compile_rmsnorm_quant_normed_in_place(backend, device):
    """rmsnorm_quant with normed_out = input compiled, the input read again after the op."""
    T, N = 9, 1536

    def step(x, w):
        out = torch.empty(T, N, dtype=torch.float8_e4m3fn, device=x.device)
        scales = torch.empty(T, N // 128, dtype=torch.float32, device=x.device)
        OPS.rmsnorm_quant(x, w, 1e-6, out, scales, normed_out=x)
        return out, scales, x.clone()

    _check_norm_in_place(step, 33, T, N, backend, device)


def test_fake_kernels_shapes():
    """The gather ops' fake kernels give the real shapes and dtypes (FakeTensor mode)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    cfg = TP8
    cache = mlakv.allocate_cache(4, 4, cfg.L, cfg.R, "fp8_ds_mla")
    slots = torch.arange(6)
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = mlakv.gather_cache_slots(cache, slots, kv_lora_rank=cfg.L,
                                       cache_format="fp8_ds_mla", out_dtype=torch.bfloat16)
        assert out.shape == (6, cfg.L + cfg.R) and out.dtype == torch.bfloat16
        seq = mlakv.gather_cache_sequences(cache, torch.zeros(2, 2, dtype=torch.int32),
                                           torch.tensor([0, 3, 7], dtype=torch.int32), 7,
                                           kv_lora_rank=cfg.L, cache_format="fp8_ds_mla")
        assert seq.shape == (7, cfg.L + cfg.R) and seq.dtype == torch.float32


def test_fake_kernels_reject_what_the_gathers_reject():
    """The functional gathers' fake kernels raise the real ops' RuntimeError for an out_dtype they
    do not produce, a byte cache without a format and a negative row count, so a compiled graph
    fails where eager does."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    cfg = TP8
    cache = mlakv.allocate_cache(4, 4, cfg.L, cfg.R, "fp8_ds_mla")
    slots = torch.arange(6)
    table = torch.zeros(2, 2, dtype=torch.int32)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    for mode in (None, FakeTensorMode(allow_non_fake_inputs=True)):
        with mode if mode is not None else contextlib.nullcontext():
            with pytest.raises(RuntimeError, match="out_dtype: expected float32 or bfloat16"):
                torch.ops.mlakv.gather_cache_slots(cache, "fp8_ds_mla", None, None, slots, cfg.L,
                                                   torch.float16)
            with pytest.raises(RuntimeError, match="out_dtype: expected float32 or bfloat16"):
                torch.ops.mlakv.gather_cache_sequences(cache, "fp8_ds_mla", None, None, table, cu,
                                                       7, cfg.L, torch.float16)
            with pytest.raises(RuntimeError, match="auto"):
                torch.ops.mlakv.gather_cache_slots(cache, "auto", None, None, slots, cfg.L,
                                                   torch.float32)
            with pytest.raises(RuntimeError, match="num_out_rows: expected >= 0, got -1"):
                torch.ops.mlakv.gather_cache_sequences(cache, "fp8_ds_mla", None, None, table,
                                                       cu, -1, cfg.L, torch.float32)


def test_fake_kernels_reject_the_layouts_the_gathers_reject():
    """Index tensors of the wrong rank or dtype, a cache that does not fit its format or L (R = 0,
    byte entries of no whole values, a strided entry, a split fp8_ds_mla cache, fp8_ds_mla entries
    of other than 656 bytes, a rope part of other blocks), and a scale on a format that takes none
    or that is not one float32: the functional gathers' fake kernels raise a RuntimeError naming
    the same argument as the real op (eager), each case checked against eager first. A typed fp8
    cache under "auto" with a scale is accepted by both."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    cfg = TP8
    ds = mlakv.allocate_cache(4, 4, 512, 64, "fp8_ds_mla")
    bf16 = mlakv.allocate_cache(4, 4, cfg.L, cfg.R, "bf16", typed=True)
    slots = torch.arange(6)
    table = torch.zeros(2, 2, dtype=torch.int32)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    scale = torch.ones(1)
    odd_bytes = torch.zeros(4, 4, 2 * (cfg.L + cfg.R) + 1, dtype=torch.uint8)
    strided = torch.zeros(4, cfg.L + cfg.R, 4, dtype=torch.bfloat16).transpose(1, 2)
    ds_rope = torch.zeros(4, 4, 128, dtype=torch.uint8)
    ds_short = torch.zeros(4, 4, 600, dtype=torch.uint8)
    latent = torch.zeros(4, 4, cfg.L, dtype=torch.bfloat16)
    rope_3_blocks = torch.zeros(3, 4, cfg.R, dtype=torch.bfloat16)
    fp8 = mlakv.allocate_cache(4, 4, cfg.L, cfg.R, "fp8_e4m3", typed=True)
    slot_cases = [  # (cache, format, scale, rope part, slots, L, what the message names)
        (ds, "fp8_ds_mla", None, None, slots.view(2, 3), 512, "slots"),
        (ds, "fp8_ds_mla", None, None, slots.float(), 512, "slots"),
        (ds, "fp8_ds_mla", None, None, slots, 448,
         r"^mlakv: kv_cache: fp8_ds_mla needs L = 512 and R = 64, got L = 448, R = 64 \(L from "
         r"kv_lora_rank\)"),
        (ds, "fp8_ds_mla", None, ds_rope, slots, 512, "kv_cache_rope"),
        (bf16, "fp16", None, None, slots, cfg.L, "kv_cache"),
        (bf16, "bf16", None, None, slots, cfg.L + cfg.R + 1, "kv_lora_rank"),
        (bf16, "bf16", None, None, slots, cfg.L + cfg.R, "kv_cache"),  # R = 0
        (odd_bytes, "bf16", None, None, slots, cfg.L, "kv_cache"),
        (strided, "bf16", None, None, slots, cfg.L, "kv_cache"),
        (bf16, "bf16", scale, None, slots, cfg.L, "scale"),
        (ds_short, "fp8_ds_mla", None, None, slots, 512, "kv_cache"),
        (latent, "bf16", None, rope_3_blocks, slots, cfg.L, "kv_cache_rope"),
        (fp8, "fp8_e4m3", scale.half(), None, slots, cfg.L, "kv_cache_scale"),
        (fp8, "auto", scale[:0], None, slots, cfg.L, "kv_cache_scale"),
    ]
    seq_cases = [  # (block_table, cu_seq_lens, what the message names)
        (table[0], cu, "block_table"),
        (table.long(), cu, "block_table"),
        (table, cu.view(1, 3), "cu_seq_lens"),
        (table, cu[:0], "cu_seq_lens"),
    ]
    for mode in (None, FakeTensorMode(allow_non_fake_inputs=True)):
        with mode if mode is not None else contextlib.nullcontext():
            for cache, fmt, sc, rope, sl, L, name in slot_cases:
                with pytest.raises(RuntimeError, match=name):
                    torch.ops.mlakv.gather_cache_slots(cache, fmt, sc, rope, sl, L,
                                                       torch.float32)
            for bt, cs, name in seq_cases:
                with pytest.raises(RuntimeError, match=name):
                    torch.ops.mlakv.gather_cache_sequences(ds, "fp8_ds_mla", None, None, bt, cs,
                                                           7, 512, torch.float32)
        # The fakes accept what the real ops accept: the shapes of a valid call.
        with mode if mode is not None else contextlib.nullcontext():
            rows = torch.ops.mlakv.gather_cache_slots(bf16, "bf16", None, None, slots.int(),
                                                      cfg.L, torch.bfloat16)
            seqs = torch.ops.mlakv.gather_cache_sequences(ds, "fp8_ds_mla", None, None, table,
                                                          cu, 7, 512, torch.float32)
            auto = torch.ops.mlakv.gather_cache_slots(fp8, "auto", scale, None, slots, cfg.L,
                                                      torch.float32)
            auto_seqs = torch.ops.mlakv.gather_cache_sequences(fp8, "auto", scale, None, table,
                                                               cu, 7, cfg.L, torch.float32)
        assert (tuple(rows.shape), rows.dtype) == ((6, cfg.L + cfg.R), torch.bfloat16)
        assert (tuple(seqs.shape), seqs.dtype) == ((7, 576), torch.float32)
        assert (tuple(auto.shape), auto.dtype) == ((6, cfg.L + cfg.R), torch.float32)
        assert (tuple(auto_seqs.shape), auto_seqs.dtype) == ((7, cfg.L + cfg.R), torch.float32)


@requires_cuda
def test_cuda_graph_capture_and_replay():
    """The fused op with a device Td in a CUDA graph: replays with new inputs (new positions,
    slots, values and a different decode/prefill split) equal eager runs."""
    cfg = TP8
    T = 8
    x = make_mla_inputs(cfg, "fp8_e4m3", T=T, Td=T, device="cuda", seed=20)
    td = torch.tensor([3], dtype=torch.int32, device="cuda")
    kw = mla_kwargs(x, "fp8_e4m3", num_decode_tokens=0, num_decode_tokens_device=td)
    run = lambda: mlakv.mla_rope_cache(x.positions, x.slot_mapping, x.cos_sin_cache, x.kv_c,
                                       x.k_pe, x.kv_cache, **kw)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for seed, split in ((21, 5), (22, 0), (23, T)):
        new = make_mla_inputs(cfg, "fp8_e4m3", T=T, Td=split, device="cuda", seed=seed)
        for name in ("positions", "slot_mapping", "kv_c", "k_pe", "kv_norm_weight", "q_pe",
                     "ql_nope", "q", "kv_cache", "q_out", "k_pe_out", "kv_c_out"):
            getattr(x, name).copy_(getattr(new, name))
        td.fill_(split)
        graph.replay()
        torch.cuda.synchronize()
        call_mla(mlakv.mla_rope_cache, new, "fp8_e4m3")
        for name in ("kv_cache", "q_out", "q", "k_pe_out", "kv_c_out"):
            assert_bytes_equal(getattr(x, name), getattr(new, name))


def _run_on_a_stalled_stream(run, outputs):
    """Runs `run` on a side stream made busy first (a ~0.1 s sleep kernel), reads `outputs` on
    the default stream while it sleeps, then waits for it. An op launched on any stream but the
    current one would have written by then; returns whether the early read saw no write and
    whether the op wrote after all. The op runs once first, its outputs then put back: the first
    launch of a kernel loads its module (lazy loading), which can wait for the running work."""
    saved = [o.clone() for o in outputs]
    run()
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    for o, s in zip(outputs, saved):
        o.copy_(s)
    before = [s.cpu().view(torch.uint8) for s in saved]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the inputs are ready
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        run()
    early = [o.cpu().view(torch.uint8) for o in outputs]  # the default stream, not synchronized
    side.synchronize()
    late = [o.cpu().view(torch.uint8) for o in outputs]
    untouched = all(torch.equal(a, b) for a, b in zip(early, before))
    written = any(not torch.equal(a, b) for a, b in zip(late, before))
    return untouched, written


@requires_cuda
def test_cuda_matches_cpu_and_uses_current_stream():
    cfg = TP8
    x = make_mla_inputs(cfg, "fp8_ds_mla", T=16, Td=6, device="cpu", seed=24)
    y = x.clone()
    for name, v in vars(y).items():
        if isinstance(v, torch.Tensor):
            setattr(y, name, v.cuda())
    call_mla(mlakv.mla_rope_cache, x, "fp8_ds_mla")
    outs = ("kv_cache", "q_out", "q", "k_pe_out", "kv_c_out")
    untouched, written = _run_on_a_stalled_stream(
        lambda: call_mla(mlakv.mla_rope_cache, y, "fp8_ds_mla"), [getattr(y, n) for n in outs])
    assert untouched and written
    # kv_c_out too: both backends sum RMSNorm's squares in the one documented order.
    for name in outs:
        assert_bytes_equal(getattr(y, name), getattr(x, name))


def _stream_cases():
    """(name, make) pairs: make() returns (run, outputs) for one op's call on CUDA tensors."""
    cfg = TP8

    def inputs():
        return make_mla_inputs(cfg, "bf16", T=8, Td=3, device="cuda", seed=27)

    def concat():
        x = inputs()
        return (lambda: mlakv.concat_and_cache_mla(x.kv_c, x.k_pe, x.kv_cache, x.slot_mapping,
                                                   cache_format="bf16"), [x.kv_cache])

    def rotary():
        x = inputs()
        return (lambda: mlakv.rotary_embedding(x.positions, x.q_pe, x.k_pe, x.cos_sin_cache),
                [x.q_pe, x.k_pe])

    def decode_q():
        x = inputs()
        return lambda: mlakv.decode_q_concat(x.ql_nope, x.q_pe, x.q_out), [x.q_out]

    def norm():
        x = inputs()
        out = torch.zeros_like(x.kv_c)
        return lambda: mlakv.rms_norm(x.kv_c, x.kv_norm_weight, out=out), [out]

    def gathers(sequences):
        x = inputs()
        call_mla(mlakv.mla_rope_cache, x, "bf16")
        torch.cuda.synchronize()
        out = torch.zeros(8, cfg.L + cfg.R, device="cuda")
        if not sequences:
            return (lambda: mlakv.gather_cache_slots(x.kv_cache, x.slot_mapping, kv_lora_rank=cfg.L,
                                                     cache_format="bf16", out=out), [out])
        table = torch.arange(x.kv_cache.shape[0], dtype=torch.int32, device="cuda").view(1, -1)
        cu = torch.tensor([0, 8], dtype=torch.int32, device="cuda")
        return (lambda: mlakv.gather_cache_sequences(x.kv_cache, table, cu, 8, kv_lora_rank=cfg.L,
                                                     cache_format="bf16", out=out), [out])

    def quant(op):
        g = torch.Generator().manual_seed(28)
        q_c = torch.randn(8, 1536, generator=g).bfloat16().cuda()
        kv_c = torch.randn(8, 512, generator=g).bfloat16().cuda()
        w = (torch.rand(1536, generator=g) + 0.5).bfloat16().cuda()
        values = torch.zeros(8, 1536, dtype=torch.float8_e4m3fn, device="cuda")
        scales = torch.zeros(8, 12, device="cuda")
        kv_out = torch.zeros_like(kv_c)
        if op == "rmsnorm_quant":
            return lambda: mlakv.rmsnorm_quant(q_c, w, out=values, scales=scales), [values, scales]
        if op == "per_token_group_quant_fp8":
            return (lambda: mlakv.per_token_group_quant_fp8(q_c, out=values, scales=scales),
                    [values, scales])
        return (lambda: mlakv.mla_rmsnorm_quant(q_c, w, kv_c, w[:512], q_out=values,
                                                q_scales=scales, kv_c_out=kv_out),
                [values, scales, kv_out])

    return [("concat_and_cache_mla", concat), ("rotary_embedding", rotary),
            ("decode_q_concat", decode_q), ("rms_norm", norm),
            ("gather_cache_slots", lambda: gathers(False)),
            ("gather_cache_sequences", lambda: gathers(True)),
            ("rmsnorm_quant", lambda: quant("rmsnorm_quant")),
            ("per_token_group_quant_fp8", lambda: quant("per_token_group_quant_fp8")),
            ("mla_rmsnorm_quant", lambda: quant("mla_rmsnorm_quant"))]


@requires_cuda
@pytest.mark.parametrize("name,make", _stream_cases(), ids=lambda v: v if isinstance(v, str)
                         else "")
def test_cuda_ops_run_on_the_current_stream(name, make):
    """Every op launches on torch's current stream: with that stream stalled, nothing is written
    yet when the default stream reads the outputs; after it, the op has written."""
    run, outputs = make()
    untouched, written = _run_on_a_stalled_stream(run, outputs)
    assert untouched, f"{name} wrote before its stream ran: launched on another stream"
    assert written, f"{name} wrote nothing"


@requires_cuda
def test_cuda_device_mismatch_is_an_error():
    cfg = TP8
    x = make_mla_inputs(cfg, "bf16", device="cuda")
    with pytest.raises(RuntimeError):
        mlakv.mla_rope_cache(x.positions.cpu(), x.slot_mapping, x.cos_sin_cache, x.kv_c, x.k_pe,
                             x.kv_cache, cache_format="bf16")


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("is_neox", [False, True])
def test_reference_matches_plain_torch_decode_path(fmt, is_neox):
    """The plain PyTorch decode path used by the benchmark agrees with the reference to fp32
    rounding (it uses no fma), in both RoPE styles."""
    cfg = TP8
    x = make_mla_inputs(cfg, fmt, T=5, Td=5, device="cpu", seed=25)
    fill_padding_slot(x)
    y = x.clone()
    scale = x.kv_cache_scale if fmt == "fp8_e4m3" else None
    typed = x.kv_cache.view(mlakv.cache_latent_dtype(fmt))
    ref.torch_mla_rope_cache_decode(x.positions, x.slot_mapping, x.cos_sin_cache, x.kv_c, x.k_pe,
                                    typed, x.q_pe, x.q_out, is_neox=is_neox, kv_cache_scale=scale)
    call_mla(ref.mla_rope_cache, y, fmt, norm=False, prefill=False, ql_nope=None, is_neox=is_neox)
    tol = 1e-2 if fmt == "bf16" else 0.15
    torch.testing.assert_close(typed.float(), y.kv_cache.view(typed.dtype).float(), rtol=tol,
                               atol=tol)
    torch.testing.assert_close(x.q_out.float(), y.q_out.float(), rtol=1e-2, atol=1e-2)


def test_core_is_torch_free():
    """STYLE habit 1: nothing under include/ or src/ includes a torch header."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[2]
    pattern = re.compile(r'#\s*include\s*[<"](torch|ATen|c10|pybind11)/')
    offenders = [str(p.relative_to(root)) for folder in ("include", "src")
                 for p in (root / folder).rglob("*")
                 if p.suffix in (".h", ".cpp", ".cu", ".cuh") and pattern.search(p.read_text())]
    assert not offenders, f"torch headers in the core: {offenders}"


# ---- host counts under torch.compile -------------------------------------------------------------
class _GraphCounter:
    """A torch.compile backend that counts the graphs it is given and runs them as they are."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def test_torch_compile_host_td_is_symbolic(device):
    """A mixed batch with a host Td, compiled with fullgraph=True: the Td values after the first
    share one graph (the schema takes a SymInt; an int would compile a graph per value and fail
    at dynamo's recompile limit), and each call gives the eager bytes."""
    cfg = TP8
    counter = _GraphCounter()

    def step(positions, slot_mapping, table, kv_c, k_pe, kv_cache, q_pe, ql_nope, q_out, q, td):
        mlakv.mla_rope_cache(positions, slot_mapping, table, kv_c, k_pe, kv_cache,
                             cache_format="bf16", q_pe=q_pe, ql_nope=ql_nope, q_out=q_out, q=q,
                             num_decode_tokens=td)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for td in range(1, 11):  # more values than dynamo's default recompile limit (8)
        x = make_mla_inputs(cfg, "bf16", T=12, Td=td, device=device, seed=td)
        y = x.clone()
        args = lambda v: (v.positions, v.slot_mapping, v.cos_sin_cache, v.kv_c, v.k_pe,
                          v.kv_cache, v.q_pe, v.ql_nope, v.q_out, v.q, td)
        compiled(*args(x))
        step(*args(y))
        for name in ("kv_cache", "q_out", "q"):
            assert_bytes_equal(getattr(x, name), getattr(y, name))
    assert counter.graphs <= 2, f"{counter.graphs} graphs for 10 values of Td"


def test_torch_compile_row_counts_are_symbolic(device):
    """gather_cache_sequences' num_out_rows and rmsnorm_quant's num_tokens stay symbolic too. The
    cache holds random entries, and the compiled gathers equal the reference's."""
    cfg = TP8
    cache = mlakv.allocate_cache(4, 4, cfg.L, cfg.R, "bf16", device=device)
    g = torch.Generator().manual_seed(5)
    mlakv.concat_and_cache_mla(torch.randn(16, cfg.L, generator=g).bfloat16().to(device),
                               torch.randn(16, cfg.R, generator=g).bfloat16().to(device), cache,
                               torch.arange(16, device=device), cache_format="bf16")
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32, device=device)
    counter = _GraphCounter()

    def gather(cache, block_table, cu, rows):
        return mlakv.gather_cache_sequences(cache, block_table, cu, rows, kv_lora_rank=cfg.L,
                                            cache_format="bf16")

    torch._dynamo.reset()
    compiled = torch.compile(gather, backend=counter, fullgraph=True)
    for rows in range(1, 11):
        assert_bytes_equal(compiled(cache, block_table, cu, rows),
                           ref.gather_cache_sequences(cache, block_table, cu, rows,
                                                      kv_lora_rank=cfg.L, cache_format="bf16"))
    assert counter.graphs <= 2, f"{counter.graphs} graphs for 10 values of num_out_rows"

    counter = _GraphCounter()
    x = torch.randn(12, 256, device=device).to(torch.bfloat16)
    w = torch.ones(256, dtype=torch.bfloat16, device=device)

    def quant(x, w, t):
        return mlakv.rmsnorm_quant(x, w, num_tokens=t)

    torch._dynamo.reset()
    compiled = torch.compile(quant, backend=counter, fullgraph=True)
    for t in range(1, 11):
        got, want = compiled(x, w, t), quant(x, w, t)
        assert got[0].shape == (t, 256)
        assert_bytes_equal(got[0], want[0])
        assert_bytes_equal(got[1], want[1])
    assert counter.graphs <= 2, f"{counter.graphs} graphs for 10 values of num_tokens"


def test_fake_kernels_reject_mixed_devices():
    """A meta tensor among CPU ones dispatches to the fake kernels: they raise, as the real
    kernels would for tensors on two devices, instead of returning with nothing written."""
    x = make_mla_inputs(TP8, "bf16", T=4)
    with pytest.raises(RuntimeError, match="one device"):
        mlakv.concat_and_cache_mla(x.kv_c.to("meta"), x.k_pe, x.kv_cache, x.slot_mapping,
                                   cache_format="bf16")
    with pytest.raises(RuntimeError, match="one device"):
        mlakv.rmsnorm_quant(torch.empty(4, 256, dtype=torch.bfloat16, device="meta"),
                            torch.ones(256, dtype=torch.bfloat16))
    # All on one device: no error (shapes only).
    mlakv.concat_and_cache_mla(x.kv_c.to("meta"), x.k_pe.to("meta"), x.kv_cache.to("meta"),
                               x.slot_mapping.to("meta"), cache_format="bf16")


def test_fake_kernels_of_every_writing_op_reject_mixed_devices():
    """Every op that writes its arguments has a fake kernel that raises the one-device error when
    one of its outputs is a meta tensor among CPU ones (without one, torch raises an unrelated
    NotImplementedError)."""
    cfg = TP8
    x = make_mla_inputs(cfg, "bf16", T=4)
    T = x.slot_mapping.shape[0]
    meta = lambda t: torch.empty_like(t, device="meta")
    cache = mlakv.allocate_cache(4, 4, cfg.L, cfg.R, "bf16")
    out = torch.empty(T, cfg.L + cfg.R)
    table = torch.zeros(1, 1, dtype=torch.int32)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    rows = torch.randn(T, 256).to(torch.bfloat16)
    w = torch.ones(256, dtype=torch.bfloat16)
    q8 = torch.empty(T, 256, dtype=torch.float8_e4m3fn)
    scales = torch.empty(T, 2)
    mla = list(_mla_args(x, "bf16"))
    mla[6] = meta(x.kv_cache)
    calls = {
        "mla_rope_cache": tuple(mla),
        "rotary_embedding": (x.positions, meta(x.q_pe), None, cfg.R, x.cos_sin_cache, False,
                             None),
        "concat_and_cache_mla": (x.kv_c, x.k_pe, meta(x.kv_cache), x.slot_mapping, "bf16", None,
                                 None, None, False),
        "decode_q_concat": (x.ql_nope[:T], x.q_pe[:T], meta(x.q_out[:T]), None),
        "rms_norm": (meta(x.kv_c), x.kv_c, x.kv_norm_weight, 1e-6),
        "gather_cache_slots_out": (meta(out), cache, "bf16", None, None, x.slot_mapping, cfg.L,
                                   None),
        "gather_cache_sequences_out": (meta(out), cache, "bf16", None, None, table, cu, cfg.L,
                                       None),
        "rmsnorm_quant": (rows, w, 1e-6, meta(q8), scales),
        "mla_rmsnorm_quant": (rows, w, 1e-6, meta(q8), scales, rows, w, 1e-6, rows.clone()),
        "per_token_group_quant_fp8": (rows, meta(q8), scales),
    }
    for name, args in calls.items():
        with pytest.raises(RuntimeError, match=f"mlakv: {name}: expected every tensor on one "
                                               "device"):
            getattr(OPS, name)(*args)
    mla[19] = torch.zeros_like(x.q)
    with pytest.raises(RuntimeError, match="mlakv: mla_rope_cache: expected every tensor on one "
                                           "device"):
        OPS.mla_rope_cache.q_prefill_out(*mla)


@requires_cuda
def test_cuda_op_with_its_device_tensor_on_the_cpu():
    """The CUDA kernel is chosen when any argument is on CUDA; the tensor the op takes its device
    from is then named in the error (not torch's device guard's message), nothing written."""
    x = make_mla_inputs(TP8, "bf16", device="cuda")
    before = x.kv_cache.clone()
    with pytest.raises(RuntimeError, match="kv_c: expected a tensor on cuda"):
        mlakv.concat_and_cache_mla(x.kv_c.cpu(), x.k_pe, x.kv_cache, x.slot_mapping,
                                   cache_format="bf16")
    with pytest.raises(RuntimeError, match="input: expected a tensor on cuda"):
        mlakv.rmsnorm_quant(torch.ones(4, 256, dtype=torch.bfloat16),
                            torch.ones(256, dtype=torch.bfloat16, device="cuda"))
    assert torch.equal(x.kv_cache, before)


def test_make_fx_symbolic_keeps_the_host_td_symbolic():
    """Traced with symbolic shapes outside dynamo (make_fx, as non-strict export does), the Td of
    mla_rope_cache_decode (slot_mapping's length) stays a SymInt: the graph replayed with another
    T gives the eager bytes (int() of the SymInt would bake the traced T into the graph)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    cfg = TP8
    names = ("positions", "slot_mapping", "cos_sin_cache", "kv_c", "k_pe", "kv_cache", "q_pe",
             "ql_nope", "q_out")

    def step(positions, slot_mapping, table, kv_c, k_pe, kv_cache, q_pe, ql_nope, q_out):
        mlakv.mla_rope_cache_decode(positions, slot_mapping, table, kv_c, k_pe, kv_cache,
                                    cache_format="bf16", q_pe=q_pe, ql_nope=ql_nope, q_out=q_out)

    x = make_mla_inputs(cfg, "bf16", T=4, Td=4)
    traced = make_fx(step, tracing_mode="symbolic")(*[getattr(x, n) for n in names])
    x = make_mla_inputs(cfg, "bf16", T=6, Td=6, seed=3)
    y = x.clone()
    traced(*[getattr(x, n) for n in names])
    step(*[getattr(y, n) for n in names])
    assert_bytes_equal(x.q_out, y.q_out)
    assert_bytes_equal(x.kv_cache, y.kv_cache)


def test_bench_timings_rotate_whole_sets(monkeypatch):
    """The Python bench's CUDA timing captures whole rotations over a row's sets (at least
    --inner calls) and refuses a call that cannot be captured, unless told to time it eagerly
    (the compile baseline). graph_call_times is replaced, so this runs without a GPU."""
    from mlakv import bench
    captured = []

    def fake_graph_call_times(calls, replays, lead=1):
        captured.append(list(calls))
        return [2e-6] * replays

    monkeypatch.setattr(bench, "graph_call_times", fake_graph_call_times)
    fns = [lambda: None for _ in range(7)]
    med, spread, eager = bench._timeit(fns, "cuda", inner=20, repeats=3)
    assert (med, spread, eager) == (2.0, 0.0, False)
    assert captured[-1] == fns * 3
    bench._timeit(fns[:1], "cuda", inner=20, repeats=3)
    assert len(captured[-1]) == 20

    def failing_capture(calls, replays, lead=1):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(bench, "graph_call_times", failing_capture)
    with pytest.raises(RuntimeError, match="capturing"):
        bench._timeit(fns, "cuda", inner=20, repeats=3)
    # Sets: enough to exceed ROTATION_BYTES, at most MAX_SETS, one on the CPU.
    assert bench.num_sets(297_230, "cuda") == -(-bench.ROTATION_BYTES // 297_230)
    assert bench.num_sets(100, "cuda") == bench.MAX_SETS
    assert bench.num_sets(1 << 30, "cuda") == 1
    assert bench.num_sets(297_230, "cpu") == 1


def test_bench_device_argument():
    """The Python bench's --device takes cpu, cuda or cuda:N and refuses anything else by name."""
    from mlakv import bench
    for bad in ("gpu", "meta"):
        with pytest.raises(SystemExit):
            bench.main(["--device", bad, "--plot", ""])
    result = bench.main(["--device", "cpu", "--tokens", "1", "--inner", "1", "--repeats", "1",
                         "--peak-bytes", "65536", "--plot", "", "--no-compile"])
    assert result["device"].startswith("cpu") and [r["T"] for r in result["rows"]] == [1]


def test_bench_refuses_bad_options(capsys):
    """The Python bench refuses, by the option's name and before it runs anything, what would
    otherwise fail half way with a traceback."""
    from mlakv import bench
    cases = [(["--cache-format", "fp8_ds_mla", "--config", "minicpm3"], "--config minicpm3"),
             (["--cache-format", "fp8_ds_mla", "--dtype", "float16"], "--dtype bfloat16"),
             (["--cache-format", "bogus"], "--cache-format: invalid choice"),
             (["--tokens", "1,x"], "--tokens"), (["--tokens", "0"], "--tokens"),
             (["--inner", "0"], "--inner"), (["--repeats", "-1"], "--repeats")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            bench.main(argv + ["--device", "cpu", "--plot", ""])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, argv


def _gather_rows_from_item_case(device, seed):
    """The inputs of the .item() gather tests: a cache of random entries, a block table of two
    sequences, and a step that gathers ``cu[-1].item()`` rows into ``out``."""
    x = make_mla_inputs(TP8, "bf16", T=6, device=device, seed=seed)
    table = torch.tensor([[1, 0], [3, 2]], dtype=torch.int32, device=device)

    def step(kv_cache, block_table, cu, out):
        return mlakv.gather_cache_sequences(kv_cache, block_table, cu, cu[-1].item(), out=out,
                                            kv_lora_rank=TP8.L, cache_format="bf16")

    return x, table, step


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_torch_compile_gather_sequences_rows_from_item(backend, device):
    """An engine's row count read with .item() (a data-dependent SymInt) beside out=: the wrapper
    must not guard on it (under compile its check of num_out_rows against out is a runtime
    assert), so the step compiles into one graph and gives the eager bytes."""
    cfg = TP8
    x, table, step = _gather_rows_from_item_case(device, 74)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(step, fullgraph=True, backend=backend)
        for last in (8, 6):
            cu = torch.tensor([0, 5, last], dtype=torch.int32, device=device)
            got = torch.full((last, cfg.L + cfg.R), 5.0, device=device)
            want = got.clone()
            compiled(x.kv_cache, table, cu, got)
            step(x.kv_cache, table, cu, want)
            assert_bytes_equal(got, want)
            assert not bool(got.eq(5).all()), "nothing gathered"


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_torch_compile_gather_sequences_rows_other_than_out_refused(backend, device):
    """Under torch.compile a num_out_rows other than out.shape[0] is refused (eager mode refuses it
    by name): a data-dependent count (.item()) by a runtime assert, a host count that changes
    between calls when the new graph is traced; out keeps its bytes."""
    cfg = TP8
    x, table, from_item = _gather_rows_from_item_case(device, 75)

    def from_host(kv_cache, block_table, cu, rows, out):
        return mlakv.gather_cache_sequences(kv_cache, block_table, cu, rows, out=out,
                                            kv_lora_rank=cfg.L, cache_format="bf16")

    cu = torch.tensor([0, 5, 8], dtype=torch.int32, device=device)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(from_item, fullgraph=True, backend=backend)
        compiled(x.kv_cache, table, cu, torch.zeros(8, cfg.L + cfg.R, device=device))
        out = torch.full((9, cfg.L + cfg.R), 5.0, device=device)
        # (the runtime assert names its expression, one of the two bounds, not the message)
        with pytest.raises(RuntimeError, match="[<>]="):
            compiled(x.kv_cache, table, cu, out)
        assert bool(out.eq(5).all()), "written although refused"

    torch._dynamo.reset()
    compiled = torch.compile(from_host, fullgraph=True, backend=backend)
    compiled(x.kv_cache, table, cu, 8, torch.zeros(8, cfg.L + cfg.R, device=device))
    for rows, out_rows in ((8, 9), (7, 8), (9, 8)):
        out = torch.full((out_rows, cfg.L + cfg.R), 5.0, device=device)
        with pytest.raises(RuntimeError, match=r"mlakv: num_out_rows: expected out.shape\[0\]"):
            compiled(x.kv_cache, table, cu, rows, out)
        assert bool(out.eq(5).all()), "written although refused"
