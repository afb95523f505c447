"""linear_cross_entropy against the fp64 PyTorch oracle: values and every gradient."""

import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import fused_ce
from fused_ce import _dispatch, ops, reference
from tests.oracle import assert_close, assert_grads_rounded_once, cross_entropy64, rel_err


def _case(draw_or_params, seed):
    p = draw_or_params
    g = torch.Generator().manual_seed(seed)
    shape = p["shape"]
    H, V = p["H"], p["V"]
    dtype = p["dtype"]
    x = torch.randn(*shape, H, generator=g, dtype=dtype)
    W = torch.randn(V, H, generator=g, dtype=dtype) / math.sqrt(H) * p["w_scale"]
    b = torch.randn(V, generator=g, dtype=dtype) * p["bias_scale"] if p["bias"] else None
    t = torch.randint(0, V, shape, generator=g)
    ignore = torch.rand(shape, generator=g) < p["ignore_frac"]
    t[ignore] = p["ignore_index"]
    cw = torch.rand(V, generator=g, dtype=dtype) + 0.1 if p["class_weight"] else None
    return x, W, b, t, cw


params = st.fixed_dictionaries({
    "shape": st.sampled_from([(0,), (1,), (7,), (33,), (3, 5), (2, 3, 4)]),
    "H": st.sampled_from([1, 5, 16, 67]),
    "V": st.sampled_from([2, 3, 31, 97, 128]),
    "dtype": st.sampled_from([torch.float32, torch.float64]),
    "w_scale": st.sampled_from([1.0, 8.0]),
    "bias": st.booleans(),
    "bias_scale": st.sampled_from([1.0, 30.0]),
    "ignore_frac": st.sampled_from([0.0, 0.3, 1.0]),
    "ignore_index": st.sampled_from([-100, 0]),
    "class_weight": st.booleans(),
    "reduction": st.sampled_from(["mean", "sum", "none"]),
    "label_smoothing": st.sampled_from([0.0, 0.1, 1.0]),
    "z_loss": st.sampled_from([0.0, 1e-3]),
    "softcap": st.sampled_from([None, 3.0, 30.0]),
    "grads": st.sampled_from(["all", "x", "head", "weight_only", "none"]),
    "target_dtype": st.sampled_from([torch.int64, torch.int32]),
    # (rows per block, vocabulary columns per tile) forced on the PyTorch path: None keeps its
    # own choice (whole rows); columns < V: the two-pass vocabulary tiles of low_memory
    "blocks": st.sampled_from([None, (1, 1), (2, 3), (5, 40), (64, 2), (3, 1000)]),
})


def _tol(dtype):
    return 2e-5 if dtype == torch.float32 else 1e-10


@settings(max_examples=150, deadline=None)
@given(p=params, seed=st.integers(0, 2**31 - 1))
def test_matches_fp64_oracle(p, seed):
    if p["blocks"] is None:
        _check_against_oracle(p, seed)
        return
    with mock.patch.object(reference, "block_shape", lambda *args: p["blocks"]):
        _check_against_oracle(p, seed)


def _check_against_oracle(p, seed):
    x, W, b, t, cw = _case(p, seed)
    req = {"all": (1, 1, 1), "x": (1, 0, 0), "head": (0, 1, 1), "weight_only": (0, 1, 0),
           "none": (0, 0, 0)}[p["grads"]]
    for tensor, r in zip((x, W, b), req):
        if tensor is not None:
            tensor.requires_grad_(bool(r))
    opts = dict(reduction=p["reduction"], ignore_index=p["ignore_index"],
                label_smoothing=p["label_smoothing"], z_loss=p["z_loss"], softcap=p["softcap"])
    got = fused_ce.linear_cross_entropy(x, W, t.to(p["target_dtype"]), linear_bias=b, weight=cw,
                                        **opts)
    want = cross_entropy64(x, W, t, bias=b, class_weight=cw, **opts)
    eager = cross_entropy64(x, W, t, bias=b, class_weight=cw, dtype=x.dtype, **opts)
    assert got.shape == want.shape
    assert got.dtype == torch.promote_types(x.dtype, torch.float32)
    tol = _tol(p["dtype"])
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert_close(got[ok], want[ok], eager[ok], tol)

    inputs = [t_ for t_ in (x, W, b) if t_ is not None and t_.requires_grad]
    if not inputs or not got.requires_grad:
        assert not inputs
        return
    upstream = torch.randn(want.shape, dtype=torch.float64) * 3
    want_grads = torch.autograd.grad(want, inputs, upstream, retain_graph=True)
    eager_grads = torch.autograd.grad(eager, inputs, upstream.to(eager.dtype))
    got_grads = torch.autograd.grad(got, inputs, upstream.to(got.dtype))
    magnitudes = _gradient_term_magnitudes(x, W, b, t, cw, opts, upstream)
    for inp, gg, wg, eg in zip(inputs, got_grads, want_grads, eager_grads):
        assert gg.dtype == p["dtype"] and gg.shape == wg.shape
        if torch.isnan(wg).any():  # mean over nothing: torch's grads are nan or 0 -- match either
            assert torch.isnan(gg).any() or torch.count_nonzero(gg) == 0
            continue
        # A gradient that cancels (dx = dz @ W summing terms of both signs to far less than
        # their size) is accurate to its terms' size, not its own: tol relative to that.
        # fp64 inputs: "eager" is the oracle itself, so rounding in a cancellation (p - 1 with
        # p = 1 - 1e-7) has nothing to hide behind; allow it at a few hundred fp64 ulps.
        atol = tol * magnitudes[id(inp)].norm().item() + 1e-30
        if p["dtype"] == torch.float64 and upstream.numel():
            atol += 1e-13 * upstream.abs().max().item()
        assert_close(gg, wg, eg, tol, atol)


def _gradient_term_magnitudes(x, W, b, t, cw, opts, upstream):
    """{id(input): the magnitudes its gradient sums}: |dz| @ |W| for x, |dz|^T |x| for W,
    sum |dz| for b, with dz the fp64 gradient of the loss (times ``upstream``) with respect to
    the linear output z = x W^T + b."""
    x64 = x.detach().double().reshape(-1, x.shape[-1])
    W64 = W.detach().double()
    z = torch.nn.functional.linear(x64, W64, None if b is None else b.detach().double())
    z.requires_grad_(True)
    eye = torch.eye(W.shape[0], dtype=torch.float64)  # the loss of the logits z themselves
    loss = cross_entropy64(z.reshape(*x.shape[:-1], W.shape[0]), eye, t, class_weight=cw, **opts)
    (dz,) = torch.autograd.grad(loss, z, upstream)
    dz = dz.nan_to_num().abs()
    out = {id(x): dz @ W64.abs(), id(W): dz.t() @ x64.abs()}
    if b is not None:
        out[id(b)] = dz.sum(0)
    return out


@pytest.mark.parametrize("low_memory", [False, True])
def test_many_chunks_match_one_chunk(monkeypatch, low_memory):
    """Block boundaries (tiny budgets: whole rows, 3 per chunk; low_memory: vocabulary tiles
    of 5 rows by 20 columns) do not change the result."""
    monkeypatch.setattr(reference, "DEFAULT_CHUNK_BYTES", 3 * 97 * 8 * 2)
    monkeypatch.setattr(reference, "MIN_CHUNK_ROWS", 3)
    monkeypatch.setattr(reference, "LOW_MEMORY_CHUNK_BYTES", 5 * 40 * 8)
    monkeypatch.setattr(reference, "MIN_TILE_COLS", 8)
    assert reference.block_shape(25, 97, 40, torch.float64, 2, low_memory) == (
        (5, 20) if low_memory else (3, 97))
    p = dict(shape=(41,), H=40, V=97, dtype=torch.float64, w_scale=4.0, bias=True,
             bias_scale=5.0, ignore_frac=0.4, ignore_index=-100, class_weight=True)
    x, W, b, t, cw = _case(p, torch.seed() % 2**31)
    for r in (x, W, b):
        r.requires_grad_(True)
    opts = dict(label_smoothing=0.2, z_loss=1e-2, softcap=20.0)
    got = fused_ce.linear_cross_entropy(x, W, t, linear_bias=b, weight=cw, low_memory=low_memory, **opts)
    want = cross_entropy64(x, W, t, bias=b, class_weight=cw, **opts)
    assert rel_err(got, want) < 1e-12
    for gg, wg in zip(torch.autograd.grad(got, (x, W, b)), torch.autograd.grad(want, (x, W, b))):
        assert rel_err(gg, wg) < 1e-11


@pytest.mark.parametrize("rows,vocab,hidden,low_memory,want", [
    (1024, 30522, 1024, False, (274, 30522)),   # whole rows: the 32 MiB budget holds 274
    (10, 128256, 4096, False, (65, 128256)),    # ... or every row
    (512, 128256, 4096, False, (512, 16384)),   # tiles: 32 MiB of logits
    (512, 128256, 4096, True, (256, 4096)),     # 4 MiB of logits, 4 MiB of inputs
    (1024, 30522, 1024, True, (1024, 1024)),
    (20, 30522, 1024, True, (34, 30522)),       # the budget holds every row: whole rows
    (300, 30522, 16384, True, (64, 16384)),  # inputs of 64 rows fill the budget
])
def test_block_shape(rows, vocab, hidden, low_memory, want):
    assert reference.block_shape(rows, vocab, hidden, torch.float32, 1, low_memory) == want


@pytest.mark.parametrize("rows,vocab,hidden,low_memory,want", [
    (512, 128256, 4096, False, (512, 128256)),   # dW / 8 = 250.5 MiB: 512 whole rows
    (2048, 128256, 4096, False, (512, 128256)),  # ... per block
    (1024, 30522, 1024, False, (274, 30522)),    # dW / 8 under 32 MiB: the 32 MiB budget
    (512, 128256, 4096, True, (256, 4096)),      # low_memory keeps its 4 MiB
])
def test_block_shape_with_dw(rows, vocab, hidden, low_memory, want):
    """Where dW is computed in the weight's dtype the budget grows to an eighth of its size."""
    dw_bytes = vocab * hidden * 4
    assert reference.block_shape(rows, vocab, hidden, torch.float32, 1, low_memory,
                                 dw_bytes) == want


@pytest.mark.parametrize("dtype,w_grad,x_grad,want", [
    (torch.float32, True, True, True),
    (torch.float32, False, True, False),   # no dW: the 32 MiB budget
    (torch.bfloat16, True, True, False),   # whole rows would up-cast the weight: 32 MiB
    (torch.float64, True, False, True),
])
def test_budget_grows_with_dw_only_in_the_weights_dtype(monkeypatch, dtype, w_grad, x_grad,
                                                        want):
    seen = []
    real = reference.block_shape

    def spy(*args):
        seen.append(args[-1])
        return real(*args)

    monkeypatch.setattr(reference, "block_shape", spy)
    n, h, v = 9, 16, 53
    x = torch.randn(n, h, dtype=dtype).requires_grad_(x_grad)
    W = torch.randn(v, h, dtype=dtype).requires_grad_(w_grad)
    t = torch.randint(0, v, (n,))
    params = [p for p in (x, W) if p.requires_grad]
    loss, want_loss = fused_ce.linear_cross_entropy(x, W, t), cross_entropy64(x, W, t)
    got_grads = torch.autograd.grad(loss, params)
    want_grads = torch.autograd.grad(want_loss, params)
    acc = reference.accumulation_dtype(dtype)
    dw_bytes = v * h * torch.finfo(acc).bits // 8 if want else 0
    assert seen and seen[0] == dw_bytes, seen
    tol = 1e-12 if dtype == torch.float64 else (1e-5 if dtype == torch.float32 else 2**-7)
    assert rel_err(loss, want_loss) < tol
    for g, w in zip(got_grads, want_grads):
        assert rel_err(g, w) < tol


@pytest.mark.parametrize("low_memory", [False, True])
def test_tiles_upcast_a_16bit_weight_one_tile_at_a_time(monkeypatch, low_memory):
    """With vocabulary tiles a bf16 weight is up-cast one tile at a time: the workspace holds no
    V x H fp32 copy of it (low_memory stays O(rows) for 16-bit models on CPU). The result equals
    the whole-rows one up to fp32 summation order, and fp64's up to the gradients' rounding."""
    kept, tiles = [], []
    init, weight_tile = reference._Chunker.__init__, reference._Chunker.weight_tile

    def spy_init(self, *args):
        init(self, *args)
        kept.append(self.weight)

    def spy_tile(self, cols):
        out = weight_tile(self, cols)
        tiles.append((tuple(out.shape), out.dtype))
        return out

    torch.manual_seed(torch.seed() % 2**31)
    n, h, v = 33, 40, 301
    x = torch.randn(n, h).bfloat16().requires_grad_()
    W = (torch.randn(v, h) / 4).bfloat16().requires_grad_()
    b = torch.randn(v).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,))
    t[:5] = -100
    opts = dict(linear_bias=b, label_smoothing=0.1, low_memory=low_memory)
    whole = fused_ce.linear_cross_entropy(x, W, t, **opts)
    g_whole = torch.autograd.grad(whole, (x, W, b))
    monkeypatch.setattr(reference, "block_shape", lambda *args: (7, 50))
    monkeypatch.setattr(reference._Chunker, "__init__", spy_init)
    monkeypatch.setattr(reference._Chunker, "weight_tile", spy_tile)
    tiled = fused_ce.linear_cross_entropy(x, W, t, **opts)
    g_tiled = torch.autograd.grad(tiled, (x, W, b))
    # the chunker kept the bf16 weight itself and up-cast tiles of at most 50 rows
    assert kept and all(k.data_ptr() == W.data_ptr() and k.dtype == W.dtype for k in kept)
    assert tiles and all(s[0] <= 50 and dt == torch.float32 for s, dt in tiles), tiles
    want = cross_entropy64(x, W, t, bias=b, label_smoothing=0.1)
    g_want = torch.autograd.grad(want, (x, W, b))
    assert rel_err(tiled, whole) < 1e-6 and rel_err(tiled, want) < 1e-5
    for gt, gw, g64 in zip(g_tiled, g_whole, g_want):
        assert rel_err(gt, gw) < 2**-7 and rel_err(gt, g64) < 2**-7


def test_module_and_nn_linear_forms_agree():
    torch.manual_seed(torch.seed() % 2**31)
    head = torch.nn.Linear(24, 37)
    x = torch.randn(2, 9, 24, requires_grad=True)
    t = torch.randint(0, 37, (2, 9))
    t[0, :4] = -100
    cw = torch.rand(37) + 0.5
    crit = fused_ce.FusedCrossEntropy(weight=cw, label_smoothing=0.1)
    a = crit(x, head.weight, t, head.bias)
    b = fused_ce.linear_cross_entropy(x, head, t, weight=cw, label_smoothing=0.1)
    want = cross_entropy64(x, head.weight, t, bias=head.bias, class_weight=cw, label_smoothing=0.1)
    assert rel_err(a, want) < 2e-6 and torch.equal(a, b)
    a.backward()
    gx = x.grad.clone()
    x.grad = None
    want.backward()
    assert rel_err(gx, x.grad) < 1e-5


def test_large_bias_and_logits_are_stable():
    """Logits of magnitude 1e4 (large bias): fp32 lse must not overflow."""
    torch.manual_seed(torch.seed() % 2**31)
    x = torch.randn(16, 40)
    W = torch.randn(61, 40)
    b = torch.randn(61) * 1e4
    t = torch.randint(0, 61, (16,))
    got = fused_ce.linear_cross_entropy(x, W, t, linear_bias=b, reduction="none")
    want = cross_entropy64(x, W, t, bias=b, reduction="none")
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max() + 1e-2


def test_nan_and_inf_propagate():
    x = torch.randn(5, 8)
    W = torch.randn(11, 8)
    t = torch.randint(0, 11, (5,))
    x[2, 3] = float("nan")
    rows = fused_ce.linear_cross_entropy(x, W, t, reduction="none")
    assert torch.isnan(rows[2]) and torch.isfinite(rows[[0, 1, 3, 4]]).all()
    assert torch.isnan(fused_ce.linear_cross_entropy(x, W, t))
    W2 = torch.randn(11, 8)
    W2[4, 0] = float("inf")
    # x[:, 0] > 0: logit 4 is +inf in every row, so every lse is; with x[:, 0] < 0 it is -inf,
    # which a row whose target is another column survives, as in torch (this test once drew
    # such an x at random and failed ~2 % of the time)
    x2 = torch.randn(5, 8)
    x2[:, 0] = x2[:, 0].abs() + 0.1
    assert not torch.isfinite(fused_ce.linear_cross_entropy(x2, W2, t))
    x2[:, 0] = -x2[:, 0]
    t2 = torch.where(t == 4, 5, t)
    got = fused_ce.linear_cross_entropy(x2, W2, t2, reduction="none")
    want = torch.nn.functional.cross_entropy(x2.double() @ W2.double().t(), t2,
                                             reduction="none")
    assert torch.isfinite(got).all() and torch.allclose(got.double(), want, rtol=1e-5)


def test_upstream_gradient_scales_and_repeated_backward_of_graph():
    x = torch.randn(13, 10, requires_grad=True)
    W = torch.randn(29, 10, requires_grad=True)
    t = torch.randint(0, 29, (13,))
    loss = fused_ce.linear_cross_entropy(x, W, t)
    (3.5 * loss).backward()
    want = cross_entropy64(x, W, t)
    gx, gw = torch.autograd.grad(3.5 * want, (x, W))
    assert rel_err(x.grad, gx) < 1e-5 and rel_err(W.grad, gw) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("low_memory", [False, True])
def test_gradients_are_rounded_once_for_any_upstream_gradient(monkeypatch, dtype, low_memory):
    """With a non-unit upstream gradient the gradients are rounded once: computed in the
    forward and kept unrounded (fp32) until the backward scales them, or with ``low_memory``
    computed in the backward with the upstream gradient in their coefficients."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.randn(37, 70, generator=gen).to(dtype)
    w = (torch.randn(89, 70, generator=gen) / 8).to(dtype)
    b = (torch.randn(89, generator=gen) * 4).to(dtype)
    t = torch.randint(0, 89, (37,), generator=gen)
    t[::5] = -100
    k = float(torch.rand((), generator=gen)) * 3 + 0.1  # not a power of two
    dtypes = assert_grads_rounded_once(reference, monkeypatch, x, w, b, t, k, low_memory)
    assert dtypes == [dtype if low_memory else torch.float32] * 3


def test_double_backward_is_a_clear_error():
    x = torch.randn(4, 6, requires_grad=True)
    W = torch.randn(9, 6, requires_grad=True)
    t = torch.randint(0, 9, (4,))
    for reduction in ("mean", "none"):
        loss = fused_ce.linear_cross_entropy(x, W, t, reduction=reduction).sum()
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(loss, x, create_graph=True)


def test_no_grad_returns_plain_loss():
    x = torch.randn(6, 5, requires_grad=True)
    W = torch.randn(7, 5, requires_grad=True)
    t = torch.randint(0, 7, (6,))
    with torch.no_grad():
        loss = fused_ce.linear_cross_entropy(x, W, t)
    assert not loss.requires_grad
    assert rel_err(loss, cross_entropy64(x, W, t)) < 2e-6


def test_autocast_computes_in_autocast_dtype():
    x = torch.randn(12, 32)
    W = torch.randn(45, 32)
    b = torch.randn(45)
    t = torch.randint(0, 45, (12,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_ce.linear_cross_entropy(x, W, t, linear_bias=b)
        want = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, W, b), t)
    # the oracle of the autocast computation: fp64 math on the bf16-rounded operands
    oracle = cross_entropy64(x.bfloat16(), W.bfloat16(), t, bias=b.bfloat16())
    assert got.dtype == torch.float32 == want.dtype
    assert rel_err(got, oracle) < 1e-5


def test_autocast_leaves_float64_as_torch_does():
    """Autocast casts float32/16-bit operands only: all-float64 operands compute in float64
    (F.linear's behaviour), loss and log-probabilities included; a float64 input with a float32
    weight (cast to bf16) is a dtype error, as in F.linear."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    x = torch.randn(9, 16, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(13, 16, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 13, (9,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_ce.linear_cross_entropy(x, W, t)
        logp = fused_ce.linear_log_softmax(x, W)
        with pytest.raises(TypeError, match="under torch.autocast.*input is torch.float64, "
                                            "linear_weight is torch.bfloat16"):
            fused_ce.linear_cross_entropy(x, W.detach().float(), t)
    want = F.cross_entropy(F.linear(x, W), t)
    assert got.dtype == torch.float64 and logp.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logp, F.log_softmax(F.linear(x, W), -1), rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, (x, W)), torch.autograd.grad(want, (x, W))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("low_memory", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_zero_hidden_size_matches_torch(reduction, low_memory, bias):
    """H = 0: the logits are the bias alone (zeros without one); loss, log-probabilities and
    the bias's gradient as torch's, empty input and weight gradients. The kernels hand H = 0 to
    the PyTorch path (kernels._use_reference)."""
    kernels = _dispatch._kernels()
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    x = torch.randn(4, 0, dtype=torch.float64, requires_grad=True)
    W = torch.randn(7, 0, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, generator=g, dtype=torch.float64).mul(5).requires_grad_() if bias else None
    t = torch.tensor([0, -100, 6, 3])
    got = fused_ce.linear_cross_entropy(x, W, t, linear_bias=b, reduction=reduction,
                                        low_memory=low_memory, label_smoothing=0.1)
    want = F.cross_entropy(F.linear(x, W, b), t, reduction=reduction, label_smoothing=0.1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    params = [p for p in (x, W, b) if p is not None]
    up = torch.rand(want.shape, generator=g, dtype=torch.float64)
    for a, e in zip(torch.autograd.grad(got, params, up), torch.autograd.grad(want, params, up)):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused_ce.linear_log_softmax(x, W, b),
                               F.log_softmax(F.linear(x, W, b), -1), rtol=1e-12, atol=1e-12)
    if kernels is not None:
        assert kernels._use_reference(x.float(), W.float())


def test_empty_input_matches_torch():
    x = torch.randn(0, 4, requires_grad=True)
    W = torch.randn(5, 4, requires_grad=True)
    t = torch.zeros(0, dtype=torch.long)
    assert torch.isnan(fused_ce.linear_cross_entropy(x, W, t))
    s = fused_ce.linear_cross_entropy(x, W, t, reduction="sum")
    assert s.item() == 0
    s.backward()
    assert x.grad.shape == (0, 4) and torch.count_nonzero(W.grad) == 0
    assert fused_ce.linear_cross_entropy(x, W, t, reduction="none").shape == (0,)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("low_memory", [False, True])
@pytest.mark.parametrize("label_smoothing,z_loss", [(0.0, 0.0), (0.1, 0.01)])
def test_class_weights_summing_to_zero_match_torch(reduction, low_memory, label_smoothing,
                                                   z_loss):
    """Class weights that are 0 on every valid target: 'mean' is 0/0 in torch, nan for the loss
    and for the valid rows' gradients (the ignored rows' stay 0); 'sum' and 'none' are finite.
    The same nans, in the same places, and the same numbers elsewhere."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(11, 6, generator=g, dtype=torch.float64, requires_grad=True)
    b = (torch.randn(11, generator=g, dtype=torch.float64) * 30).requires_grad_()
    t = torch.tensor([0, 3, -100, 3, 5, -100, 0, 5, 3])
    cw = torch.rand(11, generator=g, dtype=torch.float64)
    cw[[0, 3, 5]] = 0
    opts = dict(weight=cw, reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss)
    got = fused_ce.linear_cross_entropy(x, W, t, linear_bias=b, low_memory=low_memory, **opts)
    want = cross_entropy64(x, W, t, bias=b, class_weight=cw, **{
        k: v for k, v in opts.items() if k != "weight"})
    upstream = torch.rand(got.shape, generator=g, dtype=torch.float64) + 0.5
    grads = torch.autograd.grad(got, (x, W, b), upstream)
    wants = torch.autograd.grad(want, (x, W, b), upstream)
    for name, ours, theirs in zip(("loss", "dx", "dW", "db"), (got,) + grads, (want,) + wants):
        assert torch.equal(ours.isnan(), theirs.isnan()), name
        assert torch.allclose(ours.nan_to_num(), theirs.nan_to_num(), rtol=1e-10, atol=1e-12), name
    assert got.isnan().all() == (reduction == "mean")


def test_z_loss_statistic_of_a_mean_over_no_token_is_nan_as_the_loss():
    x, W = torch.randn(3, 8), torch.randn(5, 8)
    t = torch.full((3,), -100)
    s = fused_ce.linear_cross_entropy(x, W, t, z_loss=0.1, return_stats=True)
    assert s.loss.isnan() and s.z_loss.isnan()
    s = fused_ce.linear_cross_entropy(x, W, t, z_loss=0.1, return_stats=True, reduction="sum")
    assert s.loss.item() == 0 and s.z_loss.item() == 0


def test_second_backward_through_same_graph_is_refused():
    x = torch.randn(5, 6, requires_grad=True)
    W = torch.randn(8, 6, requires_grad=True)
    t = torch.randint(0, 8, (5,))
    loss = fused_ce.linear_cross_entropy(x, W, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_confident_targets_keep_their_digits(reduction):
    """Targets that hold nearly all the probability (p = 1 - O(1e-7), the loss ~1e-7): the loss
    and the gradients are as close to fp64 as eager fp32 gets, not the ~20 % that an fp32 lse
    (rounded to ~5e-7 at |lse| ~ 5) minus the target logit leaves. Fresh inputs each run."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    n, h, v = 33, 5, 3
    x = torch.randn(n, h, generator=g)
    W = torch.randn(v, h, generator=g) * 0.1
    b = torch.tensor([-5.0, -21.0, -22.0]) + 0.3 * torch.rand(v, generator=g)
    t = torch.zeros(n, dtype=torch.long)  # the confident class
    t[::5] = -100
    for r in (x, W, b):
        r.requires_grad_(True)
    got = fused_ce.linear_cross_entropy(x, W, t, linear_bias=b, reduction=reduction)
    want = cross_entropy64(x, W, t, bias=b, reduction=reduction)
    eager = cross_entropy64(x, W, t, bias=b, reduction=reduction, dtype=torch.float32)
    assert want.abs().max() < 1e-5  # the regime of the test: tiny losses
    assert_close(got, want, eager, 2e-5)
    up = torch.rand(want.shape, dtype=torch.float64) + 0.5
    for gg, wg, eg in zip(torch.autograd.grad(got, (x, W, b), up.float()),
                          torch.autograd.grad(want, (x, W, b), up, retain_graph=True),
                          torch.autograd.grad(eager, (x, W, b), up.float())):
        assert_close(gg, wg, eg, 2e-5)


@pytest.mark.parametrize("class_weights, z_loss, low_memory",
                         [(False, 0.0, False), (False, 1e-3, False), (True, 0.0, False),
                          (True, 1e-3, False), (False, 0.0, True), (True, 1e-3, True)])
def test_mean_is_the_sum_divided_after_the_op(monkeypatch, class_weights, z_loss, low_memory):
    """'mean' hands the op (the sum's, or with ``low_memory`` the rows') the coefficients of
    'sum' (1 per valid row, or w[t_i], not divided by their sum) and divides its loss
    afterwards; loss and gradients match fp64, with class weights, a z-loss (its coefficient
    times that divisor) and label smoothing."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.randn(41, 24, generator=gen, dtype=torch.float64)
    w = torch.randn(53, 24, generator=gen, dtype=torch.float64) / 4
    t = torch.randint(0, 53, (41,), generator=gen)
    t[::3] = -100
    cw = torch.rand(53, generator=gen, dtype=torch.float64) + 0.5 if class_weights else None
    seen = []  # the coefficients handed to the op: its arguments 5 to 8
    for name in ("loss_sum", "loss_rows"):
        op = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, op=op, **k: seen.append(a[5:9]) or op(*a, **k))
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fused_ce.linear_cross_entropy(xs, ws, t, weight=cw, z_loss=z_loss,
                                         label_smoothing=0.1, low_memory=low_memory)
    loss.backward()
    valid = t != -100
    w_t = cw[t.clamp(min=0)] if class_weights else torch.ones(41, dtype=torch.float64)
    want = 0.9 * w_t * valid
    assert len(seen) == 1 and torch.allclose(seen[0][0], want, rtol=1e-12, atol=0)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    z = xr @ wr.t()
    ref = F.cross_entropy(z, t, weight=cw, label_smoothing=0.1)
    if z_loss:
        ref = ref + z_loss * (torch.logsumexp(z, 1)[valid] ** 2).mean()
    ref.backward()
    assert rel_err(loss, ref) < 1e-12
    assert rel_err(xs.grad, xr.grad) < 1e-10 and rel_err(ws.grad, wr.grad) < 1e-10
