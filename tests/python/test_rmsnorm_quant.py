"""torch.ops.mlakv.rmsnorm_quant / mla_rmsnorm_quant / per_token_group_quant_fp8 against a
pure-PyTorch reference (the RMSNorm of mlakv.reference, the group quantization written here).

The reference sums the squares in the library's documented order (the pairwise fp32 tree over the
element index, the row padded with zeros to a power of two), so every byte must match on the CPU
and on CUDA: e4m3 values, fp32 scales, normalized outputs and the residual write-back.
"""

import pytest
import torch

import mlakv
from mlakv import reference as ref
from conftest import requires_cuda  # the `device` fixture comes from conftest too

_ops = torch.ops.mlakv
E4M3_MAX = 448.0

# ---- reference ---------------------------------------------------------------------------------
def ref_rms_norm(x, weight, eps, residual=None):
    """Returns (y rounded to the model dtype, residual sum or None), all on the CPU."""
    y, s = ref.rms_norm_rows(x, weight, eps, residual)
    return y, (None if residual is None else s)


def ref_group_quant(y, group_size, scale_floor=None, pow2=False):
    """e4m3 values [T, N] and fp32 scales [T, N / G] of y (model dtype), on the CPU."""
    return ref.group_quant_values(y, group_size, scale_floor, pow2)


# ---- helpers -----------------------------------------------------------------------------------
def rand_rows(T, N, dtype, device, seed, pad_rows=2):
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(-6, 7, (T + pad_rows, N), generator=g).float()
    x = torch.randn(T + pad_rows, N, generator=g) * torch.exp2(e)
    return x.to(dtype).to(device)


def rand_weight(N, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return (0.05 + 2.4 * torch.rand(N, generator=g)).to(dtype).to(device)


def scales_buffer(rows, groups, column_major, device, pad=0):
    """Poisoned fp32 scales [rows, groups]: contiguous, or column-major with stride rows + pad."""
    if column_major:
        return torch.full((groups, rows + pad), -7.0, dtype=torch.float32, device=device).t()[:rows]
    return torch.full((rows, groups), -7.0, dtype=torch.float32, device=device)


def bytes_of(t):
    return t.cpu().contiguous().view(torch.uint8)


def assert_bytes_equal(actual, expected):
    a, e = bytes_of(actual), bytes_of(expected)
    if not torch.equal(a, e):
        bad = (a != e).nonzero()
        raise AssertionError(f"{bad.shape[0]} bytes differ, first at {bad[0].tolist()}")


# ---- tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N", [512, 1536, 7168])
@pytest.mark.parametrize("T", [1, 7, 300])
def test_rmsnorm_quant_matches_reference(dtype, N, T, device):
    x = rand_rows(T, N, dtype, device, seed=N + T)
    w = rand_weight(N, dtype, device, seed=N)
    x_before = x.clone()
    out = torch.full((T + 2, N), 3.0, device=device).to(torch.float8_e4m3fn)
    scales = scales_buffer(T + 2, N // 128, False, device)
    scales_before = scales.clone()
    _ops.rmsnorm_quant(x, w, 1e-6, out, scales, num_tokens=T)

    # rms_norm sums in the same order as the reference (the pairwise tree): the same bytes.
    y, _ = ref_rms_norm(x[:T], w, 1e-6)
    y_lib = torch.empty(T, N, dtype=dtype, device=device)
    _ops.rms_norm(y_lib, x[:T], w, 1e-6)
    assert_bytes_equal(y_lib, y)
    q, s = ref_group_quant(y, 128)
    assert_bytes_equal(out[:T], q)
    assert_bytes_equal(scales[:T], s)
    assert_bytes_equal(out[T:], torch.full((2, N), 3.0).to(torch.float8_e4m3fn))  # padding rows
    assert_bytes_equal(scales[T:], scales_before[T:])
    assert_bytes_equal(x, x_before)


@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("pow2", [False, True])
def test_rmsnorm_quant_options(column_major, pow2, device):
    """Residual add (written back), normalized output, column-major padded scales, pow2 scales."""
    T, N, G = 13, 1536, 128
    dtype = torch.bfloat16
    x = rand_rows(T, N, dtype, device, seed=1)
    residual = rand_rows(T, N, dtype, device, seed=2)
    w = rand_weight(N, dtype, device, seed=3)
    residual_in = residual.clone()
    normed = torch.full((T + 2, N), -1.0, dtype=dtype, device=device)
    out = torch.zeros(T + 2, N, dtype=torch.float8_e4m3fn, device=device)
    scales = scales_buffer(T, N // G, column_major, device, pad=3)
    _ops.rmsnorm_quant(x, w, 1e-5, out, scales, group_size=G, pow2_scale=pow2, residual=residual,
                       normed_out=normed, num_tokens=T)

    y, new_res = ref_rms_norm(x[:T], w, 1e-5, residual_in[:T])
    q, s = ref_group_quant(y, G, pow2=pow2)
    assert_bytes_equal(residual[:T], new_res)
    assert_bytes_equal(residual[T:], residual_in[T:])
    assert_bytes_equal(normed[:T], y)
    assert_bytes_equal(out[:T], q)
    assert_bytes_equal(scales, s)
    if column_major:  # the padding columns of the [G', T + 3] buffer keep their poison
        base = scales.t()
        assert torch.all(base.as_strided((N // G, 3), (T + 3, 1), T) == -7.0)


@pytest.mark.parametrize("N", [336, 1536, 7168])
def test_float32_rows_follow_the_sum_order(N, device):
    """fp32 rows with magnitudes over 2^-20 .. 2^20: the fp32 normalized values show the last bit
    of the sum of squares, so only the library's order matches them (16-bit outputs rarely do)."""
    T, G = 32, 16
    g = torch.Generator().manual_seed(N + 23)
    e = torch.randint(-20, 21, (T, N), generator=g).float()
    x = (torch.randn(T, N, generator=g) * torch.exp2(e)).to(device)
    w = rand_weight(N, torch.float32, device, seed=N + 24)
    out = torch.zeros(T, N, dtype=torch.float8_e4m3fn, device=device)
    scales = scales_buffer(T, N // G, False, device)
    normed = torch.full((T, N), -1.0, dtype=torch.float32, device=device)
    _ops.rmsnorm_quant(x, w, 1e-6, out, scales, group_size=G, normed_out=normed)

    y, _ = ref_rms_norm(x, w, 1e-6)
    q, s = ref_group_quant(y, G)
    assert_bytes_equal(normed, y)
    assert_bytes_equal(out, q)
    assert_bytes_equal(scales, s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mla_rmsnorm_quant_dual(dtype, device):
    """q_c [T, 1536] -> normalized + quantized, kv_c [T, 512] -> normalized in place, one launch;
    q_c and kv_c are strided views of one [T, 2112] buffer as vLLM's fused_qkv_a_proj gives."""
    T = 37
    qkv = rand_rows(T, 1536 + 576, dtype, device, seed=5)
    q_c, kv_c = qkv[:, :1536], qkv[:, 1536:1536 + 512]
    qw = rand_weight(1536, dtype, device, seed=6)
    kvw = rand_weight(512, dtype, device, seed=7)
    kv_c_in = kv_c.clone()
    q_out = torch.zeros(T + 2, 1536, dtype=torch.float8_e4m3fn, device=device)
    q_scales = scales_buffer(T + 2, 12, True, device)
    _ops.mla_rmsnorm_quant(q_c, qw, 1e-6, q_out, q_scales, kv_c, kvw, 1e-5, kv_c, num_tokens=T)

    y, _ = ref_rms_norm(q_c[:T], qw, 1e-6)
    q, s = ref_group_quant(y, 128)
    kv_y, _ = ref_rms_norm(kv_c_in[:T], kvw, 1e-5)
    assert_bytes_equal(q_out[:T], q)
    assert_bytes_equal(q_scales[:T], s)
    assert_bytes_equal(kv_c[:T], kv_y)
    assert_bytes_equal(kv_c[T:], kv_c_in[T:])
    # The kv part equals the library's rms_norm.
    ref_kv = mlakv.rms_norm(kv_c_in[:T].contiguous(), kvw, 1e-5)
    assert_bytes_equal(kv_c[:T], ref_kv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mla_rmsnorm_quant_q_residual(dtype, device):
    """The dual form's q half takes rmsnorm_quant's residual (q_residual: q_c + q_residual is
    normalized and written back) and normed_out (q_normed_out); the kv half is unchanged by it."""
    T = 19
    q_c = rand_rows(T, 1536, dtype, device, seed=41)
    q_res = rand_rows(T, 1536, dtype, device, seed=42)
    kv_c = rand_rows(T, 512, dtype, device, seed=43)
    qw = rand_weight(1536, dtype, device, seed=44)
    kvw = rand_weight(512, dtype, device, seed=45)
    q_res_in = q_res.clone()
    normed = torch.zeros_like(q_c)
    q_out, q_scales, kv_out = mlakv.mla_rmsnorm_quant(q_c, qw, kv_c, kvw, q_eps=1e-5,
                                                      q_residual=q_res, q_normed_out=normed,
                                                      num_tokens=T)
    y, new_res = ref_rms_norm(q_c[:T], qw, 1e-5, q_res_in[:T])
    q, s = ref_group_quant(y, 128)
    assert_bytes_equal(q_out, q)
    assert_bytes_equal(q_scales, s)
    assert_bytes_equal(normed[:T], y)
    assert_bytes_equal(q_res[:T], new_res)
    assert_bytes_equal(q_res[T:], q_res_in[T:])
    assert_bytes_equal(kv_out, ref_rms_norm(kv_c[:T], kvw, 1e-6)[0])
    # The same bytes as rmsnorm_quant with the residual.
    res2 = q_res_in.clone()
    out2, scales2 = mlakv.rmsnorm_quant(q_c, qw, 1e-5, residual=res2, num_tokens=T)
    assert_bytes_equal(q_out, out2)
    assert_bytes_equal(q_scales, scales2)
    assert_bytes_equal(q_res, res2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_per_token_group_quant_fp8(dtype, device):
    T, N = 21, 7168
    x = rand_rows(T, N, dtype, device, seed=9, pad_rows=0)
    x[3, 128:256] = 0.0  # an all-zero group: scale = floor, bytes 0
    out = torch.empty(T, N, dtype=torch.float8_e4m3fn, device=device)
    scales = scales_buffer(T, N // 128, False, device)
    _ops.per_token_group_quant_fp8(x, out, scales)
    q, s = ref_group_quant(x, 128)
    assert_bytes_equal(out, q)
    assert_bytes_equal(scales, s)


@pytest.mark.parametrize("column_major", [False, True])
def test_python_wrappers(column_major, device):
    """mlakv.rmsnorm_quant / mla_rmsnorm_quant / per_token_group_quant_fp8 allocate what is not
    given (scales in the layout asked for) and return the reference's bytes; given outputs are
    written and returned."""
    T, N = 7, 1536
    x = rand_rows(T, N, torch.bfloat16, device, seed=21)  # 2 padding rows past T
    w = rand_weight(N, torch.bfloat16, device, seed=22)
    q, s = ref_group_quant(ref_rms_norm(x[:T], w, 1e-5)[0], 64, pow2=True)

    out, scales = mlakv.rmsnorm_quant(x, w, 1e-5, group_size=64, pow2_scale=True,
                                      column_major_scales=column_major, num_tokens=T)
    assert out.shape == (T, N) and out.dtype == torch.float8_e4m3fn
    assert scales.shape == (T, N // 64) and scales.dtype == torch.float32
    assert scales.stride() == ((1, T) if column_major else (N // 64, 1))
    assert_bytes_equal(out, q)
    assert_bytes_equal(scales, s)

    given = (torch.empty(T, N, dtype=torch.float8_e4m3fn, device=device),
             scales_buffer(T, N // 64, column_major, device, pad=2))
    got = mlakv.rmsnorm_quant(x, w, 1e-5, out=given[0], scales=given[1], group_size=64,
                              pow2_scale=True, num_tokens=T)
    assert got[0] is given[0] and got[1] is given[1]
    assert_bytes_equal(given[0], q)
    assert_bytes_equal(given[1], s)

    out, scales = mlakv.per_token_group_quant_fp8(x[:T], 128,
                                                  column_major_scales=column_major)
    q, s = ref_group_quant(x[:T], 128)
    assert_bytes_equal(out, q)
    assert_bytes_equal(scales, s)

    kv_c = rand_rows(T, 512, torch.bfloat16, device, seed=23, pad_rows=0)
    kvw = rand_weight(512, torch.bfloat16, device, seed=24)
    q_out, q_scales, kv_out = mlakv.mla_rmsnorm_quant(x[:T], w, kv_c, kvw, q_eps=1e-5,
                                                      kv_eps=1e-4,
                                                      column_major_scales=column_major)
    q, s = ref_group_quant(ref_rms_norm(x[:T], w, 1e-5)[0], 128)
    assert_bytes_equal(q_out, q)
    assert_bytes_equal(q_scales, s)
    assert_bytes_equal(kv_out, ref_rms_norm(kv_c, kvw, 1e-4)[0])


@pytest.mark.parametrize("column_major", [False, True])
def test_reference_ops_take_the_wrappers_arguments(column_major, device):
    """mlakv.reference's rmsnorm_quant, mla_rmsnorm_quant and per_token_group_quant_fp8 take the
    wrappers' arguments and write the library's bytes: the residual sum, normed_out, the scales'
    layout and floor, pow2 scales, and NaN inputs (the group amax ignores NaN; a NaN value is
    e4m3 0x7f) all included."""
    T, N = 9, 1536
    x = rand_rows(T, N, torch.bfloat16, device, seed=31)
    x[2, 5] = float("nan")  # one NaN in group 0 of row 2
    x[4, 256:384] = 0.0  # an all-zero group: the floor
    residual = rand_rows(T, N, torch.bfloat16, device, seed=32)
    w = rand_weight(N, torch.bfloat16, device, seed=33)
    kv_c = rand_rows(T, 512, torch.bfloat16, device, seed=34)
    kvw = rand_weight(512, torch.bfloat16, device, seed=35)

    def run(impl):
        res, normed = residual.clone(), torch.zeros_like(x)
        out = impl.rmsnorm_quant(x, w, 1e-5, residual=res, normed_out=normed, group_size=64,
                                 scale_floor=1e-3, pow2_scale=True,
                                 column_major_scales=column_major, num_tokens=T)
        dual_res = residual.clone()
        dual = impl.mla_rmsnorm_quant(x, w, kv_c, kvw, q_eps=1e-5, kv_eps=1e-4,
                                      q_residual=dual_res, column_major_scales=column_major,
                                      num_tokens=T)
        plain = impl.per_token_group_quant_fp8(x, 128, column_major_scales=column_major,
                                               num_tokens=T)
        return [*out, res, normed, *dual, dual_res, *plain]

    got, want = run(mlakv), run(ref)
    assert [t.shape for t in got] == [t.shape for t in want]
    assert [t.stride() for t in got] == [t.stride() for t in want]
    for g, e in zip(got, want):
        assert_bytes_equal(g, e)
    # The NaN makes row 2's norm NaN; quantized alone, it leaves its group's other values finite.
    assert torch.isnan(got[3][2].float()).all() and (bytes_of(got[0])[2] == 0x7F).all()
    plain = bytes_of(got[-2])[2]
    assert plain[5] == 0x7F and not (plain[:5] == 0x7F).any() and not (plain[6:128] == 0x7F).any()


def test_dual_form_rows_of_each_tensor_and_a_negative_count(device):
    """Without num_tokens each half of mla_rmsnorm_quant takes its own tensor's rows (the op, the
    wrapper and the reference alike); a negative num_tokens is refused by name before any output
    is allocated."""
    q_c = rand_rows(4, 1536, torch.bfloat16, device, seed=41, pad_rows=0)
    w = rand_weight(1536, torch.bfloat16, device, seed=42)
    kvw = rand_weight(512, torch.bfloat16, device, seed=43)
    for kv_rows in (6, 3):
        kv_c = rand_rows(kv_rows, 512, torch.bfloat16, device, seed=44, pad_rows=0)
        got = mlakv.mla_rmsnorm_quant(q_c, w, kv_c, kvw)
        want = ref.mla_rmsnorm_quant(q_c, w, kv_c, kvw)
        assert got[2].shape == (kv_rows, 512)
        for g, e in zip(got, want):
            assert g.shape == e.shape
            assert_bytes_equal(g, e)
    for call in (lambda: mlakv.rmsnorm_quant(q_c, w, num_tokens=-1),
                 lambda: mlakv.per_token_group_quant_fp8(q_c, num_tokens=-1),
                 lambda: mlakv.mla_rmsnorm_quant(q_c, w, kv_c, kvw, num_tokens=-1)):
        with pytest.raises(RuntimeError, match="num_tokens: expected >= 0, got -1"):
            call()


def test_bad_arguments_raise_and_write_nothing(device):
    T, N = 4, 1536
    x = rand_rows(T, N, torch.bfloat16, device, seed=11)
    w = rand_weight(N, torch.bfloat16, device, seed=12)
    out = torch.zeros(T + 2, N, dtype=torch.float8_e4m3fn, device=device)
    scales = scales_buffer(T + 2, 12, False, device)
    with pytest.raises(RuntimeError, match="group_size"):
        _ops.rmsnorm_quant(x, w, 1e-6, out, scales, group_size=100)
    with pytest.raises(RuntimeError, match="scales"):
        _ops.rmsnorm_quant(x, w, 1e-6, out, scales[:, :6], group_size=128)
    with pytest.raises(RuntimeError, match="weight"):
        _ops.rmsnorm_quant(x, w.half(), 1e-6, out, scales)
    with pytest.raises(RuntimeError, match="rmsnorm_quant: out: "):
        _ops.rmsnorm_quant(x, w, 1e-6, out.view(torch.uint8), scales)
    assert torch.all(out.view(torch.uint8) == 0)
    assert torch.all(scales == -7.0)


def test_opcheck(device):
    """Schemas, fake kernels and the dispatcher contract (torch.library.opcheck)."""
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("torch.library.opcheck needs torch >= 2.4")
    T, N = 5, 1536
    x = rand_rows(T, N, torch.bfloat16, device, seed=13, pad_rows=0)
    w = rand_weight(N, torch.bfloat16, device, seed=14)
    out = torch.empty(T, N, dtype=torch.float8_e4m3fn, device=device)
    scales = torch.empty(T, N // 128, dtype=torch.float32, device=device)
    kv_c = rand_rows(T, 512, torch.bfloat16, device, seed=15, pad_rows=0)
    kvw = rand_weight(512, torch.bfloat16, device, seed=16)
    kv_out = torch.empty_like(kv_c)
    # test_schema compares float8 outputs with arithmetic torch does not implement for float8
    # ("mul_cpu_reduced_float"); the mutation annotations it would check are also exercised by
    # test_faketensor and test_aot_dispatch_dynamic, which run here.
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(_ops.rmsnorm_quant.default, (x, w, 1e-6, out, scales), test_utils=utils)
    torch.library.opcheck(_ops.per_token_group_quant_fp8.default, (x, out, scales),
                          test_utils=utils)
    torch.library.opcheck(_ops.mla_rmsnorm_quant.default,
                          (x, w, 1e-6, out, scales, kv_c, kvw, 1e-6, kv_out), test_utils=utils)
    q_res = rand_rows(T, N, torch.bfloat16, device, seed=19, pad_rows=0)
    torch.library.opcheck(_ops.mla_rmsnorm_quant.default,
                          (x, w, 1e-6, out, scales, kv_c, kvw, 1e-6, kv_out),
                          {"q_residual": q_res}, test_utils=utils)


def test_torch_compile_fullgraph(device):
    T, N = 9, 1536
    x = rand_rows(T, N, torch.bfloat16, device, seed=17, pad_rows=0)
    w = rand_weight(N, torch.bfloat16, device, seed=18)

    def f(x, w):
        out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        scales = torch.empty(x.shape[0], x.shape[1] // 128, dtype=torch.float32, device=x.device)
        _ops.rmsnorm_quant(x, w, 1e-6, out, scales)
        return out, scales

    out, scales = torch.compile(f, fullgraph=True)(x, w)
    q, s = ref_group_quant(ref_rms_norm(x, w, 1e-6)[0], 128)
    assert_bytes_equal(out, q)
    assert_bytes_equal(scales, s)


@requires_cuda
def test_cuda_graph_capture():
    T, N = 64, 1536
    x = rand_rows(T, N, torch.bfloat16, "cuda", seed=19, pad_rows=0)
    w = rand_weight(N, torch.bfloat16, "cuda", seed=20)
    out = torch.empty(T, N, dtype=torch.float8_e4m3fn, device="cuda")
    scales = scales_buffer(T, N // 128, True, "cuda", pad=(-T) % 4)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _ops.rmsnorm_quant(x, w, 1e-6, out, scales)
    x.copy_(rand_rows(T, N, torch.bfloat16, "cuda", seed=21, pad_rows=0))
    graph.replay()
    torch.cuda.synchronize()
    q, s = ref_group_quant(ref_rms_norm(x, w, 1e-6)[0], 128)
    assert_bytes_equal(out, q)
    assert_bytes_equal(scales, s)


def test_wrappers_pass_eps_group_size_and_q_normed_out(device):
    """A non-default eps (of the order of the rows' mean square, so that it shows in the bytes),
    a group size other than 128 in per_token_group_quant_fp8, and mla_rmsnorm_quant's
    q_normed_out all reach the ops."""
    T, N = 6, 1536
    g = torch.Generator().manual_seed(41)
    x = (torch.randn(T, N, generator=g) * 0.1).to(torch.bfloat16).to(device)
    w = rand_weight(N, torch.bfloat16, device, seed=42)
    kv_c = rand_rows(T, 512, torch.bfloat16, device, seed=43, pad_rows=0)
    kvw = rand_weight(512, torch.bfloat16, device, seed=44)
    y, _ = ref_rms_norm(x, w, 1e-2)
    assert not torch.equal(y, ref_rms_norm(x, w, 1e-6)[0])
    out, scales = mlakv.rmsnorm_quant(x, w, 1e-2)
    q, s = ref_group_quant(y, 128)
    assert_bytes_equal(out, q)
    assert_bytes_equal(scales, s)

    out, scales = mlakv.per_token_group_quant_fp8(x, 64)
    q, s = ref_group_quant(x, 64)
    assert scales.shape == (T, N // 64)
    assert_bytes_equal(out, q)
    assert_bytes_equal(scales, s)

    normed = torch.full_like(x, 3.0)
    q_out, q_scales, _ = mlakv.mla_rmsnorm_quant(x, w, kv_c, kvw, q_eps=1e-2, kv_eps=1e-4,
                                                 q_normed_out=normed)
    q, s = ref_group_quant(y, 128)
    assert_bytes_equal(normed, y)
    assert_bytes_equal(q_out, q)
    assert_bytes_equal(q_scales, s)


def test_wrappers_defaults_and_options_reach_the_ops(device):
    """The wrappers' defaults (eps 1e-6, group size 128), on rows whose mean square (~1e-6) makes
    another eps show in the bytes; and mla_rmsnorm_quant's and per_token_group_quant_fp8's
    group_size, scale_floor and pow2_scale, with an all-zero group (its scale is the floor)."""
    T = 5
    g = torch.Generator().manual_seed(45)
    x = (torch.randn(T, 1536, generator=g) * 1e-3).to(torch.bfloat16).to(device)
    w = rand_weight(1536, torch.bfloat16, device, seed=46)
    kv_c = (torch.randn(T, 512, generator=g) * 1e-3).to(torch.bfloat16).to(device)
    kvw = rand_weight(512, torch.bfloat16, device, seed=47)
    y, _ = ref_rms_norm(x, w, 1e-6)
    assert not torch.equal(y, ref_rms_norm(x, w, 1e-5)[0])
    for got, want in zip(mlakv.rmsnorm_quant(x, w), ref_group_quant(y, 128)):
        assert_bytes_equal(got, want)
    got = mlakv.mla_rmsnorm_quant(x, w, kv_c, kvw)
    q, s = ref_group_quant(y, 128)
    assert_bytes_equal(got[0], q)
    assert_bytes_equal(got[1], s)
    assert_bytes_equal(got[2], ref_rms_norm(kv_c, kvw, 1e-6)[0])
    out, scales = mlakv.per_token_group_quant_fp8(x)
    assert scales.shape == (T, 1536 // 128)
    for a, b in zip((out, scales), ref_group_quant(x, 128)):
        assert_bytes_equal(a, b)

    x[1, :64] = 0
    y, _ = ref_rms_norm(x, w, 1e-6)
    kw = dict(group_size=64, scale_floor=1e-3, pow2_scale=True)
    got = mlakv.mla_rmsnorm_quant(x, w, kv_c, kvw, **kw)
    for a, b in zip(got[:2], ref_group_quant(y, 64, 1e-3, True)):
        assert_bytes_equal(a, b)
    assert got[1].shape == (T, 1536 // 64)
    for a, b in zip(mlakv.per_token_group_quant_fp8(x, **kw), ref_group_quant(x, 64, 1e-3, True)):
        assert_bytes_equal(a, b)
