"""Cases for tests/test_kernels_interpret.py: every entry point of ``fused_ce.kernels`` against
the fp64 reference, run under the Triton interpreter (TRITON_INTERPRET=1, set by the launcher
before anything imports triton). Not collected on its own (no ``test_`` prefix)."""

import itertools
import os

import pytest
import torch
import triton

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_kernels_interpret.py"

from fused_ce import kernels, reference  # noqa: E402
from fused_ce.kernels import config, row_chunks  # noqa: E402
from fused_ce.reference import GradCoefs  # noqa: E402
from tests._tanh_check import check_tanh  # noqa: E402

IGNORE = -100
# tolerances against the fp64 oracle on the same (rounded) inputs
TOL = {torch.float32: dict(stats=1e-5, grads=1e-5), torch.float16: dict(stats=1e-5, grads=4e-3)}


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch):
    """Every torch.empty / empty_like made while a case runs is filled with NaN (or a huge
    integer), so an element a kernel forgets to write shows up in the result."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).max // 2)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
    yield


@pytest.fixture
def small_chunks(monkeypatch):
    """Workspaces a few tiles wide: multi-chunk sweeps and several dX row blocks."""
    monkeypatch.setattr(config, "CHUNK_OVERRIDE", {"vc": 32, "row_block": 16, "row_vc": 64})


def _gen():
    g = torch.Generator()
    g.manual_seed(int.from_bytes(os.urandom(4), "little"))
    return g


def _inputs(n, h, v, dtype, *, bias=True, ignored=0.25, out_of_shard=True, class_weight=False,
            g=None):
    g = g or _gen()
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) / h ** 0.5).to(dtype)
    b = (torch.randn(v, generator=g) * 1.0).to(dtype) if bias else None  # bias of scale ~1
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignored] = IGNORE
    if out_of_shard and n > 2:
        t[1] = v + 3   # a column of another vocabulary shard
        t[2] = -7      # negative, not ignore_index
    cw = torch.rand(v, generator=g) + 0.5 if class_weight else None
    return x, w, b, t, cw


def _coefs(n, g):
    return GradCoefs(torch.rand(n, generator=g), torch.rand(n, generator=g) * 0.1,
                     torch.rand(n, generator=g) + 0.5, torch.rand(n, generator=g) * 0.01)


def _d(t):
    return None if t is None else t.double()


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _logits64(x, w, b, softcap):
    """The fp64 logits of the given inputs, softcapped like the kernels."""
    z = _d(x) @ _d(w).t()
    if b is not None:
        z = z + _d(b)
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def _weighted_sum_scale(z64, t, cw):
    """The condition scale of weighted_sum_i = sum_j w_j z_ij, i.e. sum_j |w_j z_ij| (fp64 logits
    z64), as a norm over the valid rows. A sum's rounding error is bounded by u times this, not
    by |sum_j w_j z_ij|, which cancels to near 0 on some rows (N = 1)."""
    cw = torch.ones(z64.shape[1], dtype=torch.float64) if cw is None else _d(cw)
    return (z64.abs() @ cw)[t != IGNORE].norm().item()


def _recorded(monkeypatch, owner, name):
    """The results of every call of ``owner.name`` made while the case runs, in a list."""
    results = []
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a: results.append(real(*a)) or results[-1])
    return results


def _recorded_instances(monkeypatch, cls):
    """Every instance of ``cls`` made while the case runs, in a list."""
    made = []
    real = cls.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        made.append(self)
    monkeypatch.setattr(cls, "__init__", init)
    return made


def _epilogue_split(monkeypatch, split):
    """The interpreter's epilogue GEMM on its whole tile (1) or on column halves (2)."""
    monkeypatch.setitem(config.INTERPRETER, "logits_tiles",
                        {**config.INTERPRETER["logits_tiles"], "split": split})


def _check_stats(ours, ref, t, tol, inputs, softcap):
    """inputs: (x, w, b, t, cw) as the kernels got them; softcap as passed."""
    x, w, b, _, cw = inputs
    z64 = _logits64(x, w, b, softcap)
    ws_scale = _weighted_sum_scale(z64, t, cw)
    valid = t != IGNORE
    for name in ("lse", "target_logit", "weighted_sum", "max_logit", "nll"):
        got, exp = getattr(ours, name), getattr(ref, name)
        assert got.dtype == torch.float32 and not got.isnan().any(), name
        assert (got[~valid] == 0).all(), name
        # relative to the norm, with a floor: one O(1) logit per row (a statistic that happens
        # to be near 0, e.g. N = 1 and a target logit of 0.006, is a cancellation, not a larger
        # error); for the weighted sum its condition scale sum_j |w_j z_ij|
        err = (got.double() - exp.double()).norm().item()
        floor = ws_scale if name == "weighted_sum" else valid.sum().item() ** 0.5
        assert err <= tol * max(exp.double().norm().item(), floor), (name, _rel(got, exp))
    _check_argmax(ours.argmax, ref.argmax, inputs, z64, valid)


def _check_argmax(got, exp, inputs, z64, valid):
    """Equal to the fp64 argmax, except on a near-tie: where the kernels (fp32 logits) pick another
    column, its fp64 logit must be within the fp32 dot product's worst-case rounding of the row's
    max, (H + 4) u sum_k |x_ik w_jk| + |b_j| (times 2: two logits; a softcap's tanh does not widen
    it), plus a few roundings of the capped logit itself (tanh and the scaling). Random inputs
    make such ties, most often under a softcap, which flattens large logits."""
    x, w, b, _, _ = inputs
    assert torch.equal(got[~valid], exp[~valid])
    rows = (got != exp).nonzero().flatten()
    if rows.numel():
        scale = _d(x[rows]).abs() @ _d(w).abs().t()
        if b is not None:
            scale = scale + _d(b).abs()
        u = torch.finfo(torch.float32).eps
        slack = u * (2 * (x.shape[1] + 4) * scale.amax(1) + 8 * z64[rows].abs().amax(1))
        gap = z64[rows, exp[rows]] - z64[rows, got[rows]]
        assert (gap <= slack).all(), (rows, gap, slack)


def _check_grads(ours, ref, x, w, b, tol, need):
    for name, like, wanted in zip(("dx", "dw", "db"), (x, w, b if b is not None else w), need):
        got, exp = getattr(ours, name) if hasattr(ours, name) else ours[name], ref[name]
        if not wanted:
            assert got is None, name
            continue
        assert got.dtype == like.dtype and got.shape == exp.shape, name
        assert not got.isnan().any(), name
        assert _rel(got, exp) <= tol, (name, _rel(got, exp))


SHAPES = [(1, 70, 37), (29, 70, 101), (40, 48, 67)]  # N=1; H > every block and not a multiple
                                                    # of BLOCK_K (70) or a multiple (48); V prime


@pytest.mark.parametrize("n,h,v", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("tiles", [False, True])
def test_forward_stats(n, h, v, dtype, softcap, tiles, monkeypatch):
    """The statistics without gradients: row_stats.py, or (``tiles``) the epilogue GEMM of
    stats_pass.py where it applies (rows of a multiple of 16 bytes: H = 48 here)."""
    monkeypatch.setattr(config, "STATS_EPILOGUE", tiles)
    g = _gen()
    x, w, b, t, cw = _inputs(n, h, v, dtype, class_weight=True, g=g)
    ours = kernels.forward(x, w, b, t, IGNORE, softcap, cw, with_weighted_sum=True)
    ref = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, softcap, _d(cw),
                            with_weighted_sum=True)
    _check_stats(ours, ref, t, TOL[dtype]["stats"], (x, w, b, t, cw), softcap)
    assert ours.dx is None and ours.dw is None and ours.db is None


@pytest.mark.parametrize("need", [c for c in itertools.product([False, True], repeat=3) if any(c)])
@pytest.mark.parametrize("low_memory,row_count", [(False, "device"), (False, "host"),
                                                  (True, "device"), (True, "host"),
                                                  (True, "host_tight"), (False, "host_all"),
                                                  (True, "host_all")])
def test_forward_grads_every_combination(need, low_memory, row_count, small_chunks, grad_path,
                                         monkeypatch):
    """row_count: "device" (no target check: the kernels read the valid count on the device,
    cuBLAS products span every row), "host" (the target check's read brings the count: products
    over the valid rows, x's rows gathered), "host_tight" (a low-memory budget too small for
    the gathered rows: the dW sweep spans every row again), "host_all" (no row ignored: the
    compacted positions are the rows, so the products slice x and dX instead of gathering)."""
    if row_count == "host_tight":
        monkeypatch.setattr(config, "D_BYTES_LOW_MEMORY", 8192)
    g = _gen()
    # (out-of-shard targets only without the check, which would raise on them)
    x, w, b, t, cw = _inputs(37, 70, 89, torch.float32, class_weight=True,
                             ignored=0.0 if row_count == "host_all" else 0.25,
                             out_of_shard=row_count == "device", g=g)
    co = _coefs(37, g)
    kw = dict(with_weighted_sum=True, coefs=co, need_dx=need[0], need_dw=need[1],
              need_db=need[2], low_memory=low_memory)
    ours = kernels.forward(x, w, b, t, IGNORE, 2.5, cw, check_targets=row_count != "device",
                           **kw)
    ref = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, 2.5, _d(cw),
                            **{**kw, "coefs": GradCoefs(*map(_d, co))})
    _check_stats(ours, ref, t, 1e-5, (x, w, b, t, cw), 2.5)
    _check_grads(ours, ref._asdict(), x, w, b, 1e-5, need)
    if need[0]:
        assert (ours.dx[t == IGNORE] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("low_memory", [False, True])
@pytest.mark.parametrize("bias,softcap,class_weight", [(True, None, False), (False, 4.0, True)])
def test_backward_given_lse(dtype, low_memory, bias, softcap, class_weight, small_chunks,
                            grad_path):
    g = _gen()
    # fp16: W's rows are 16-byte aligned, so they are read through its descriptor; H % 16 != 0
    n, h, v = 25, 56, 67
    x, w, b, t, cw = _inputs(n, h, v, dtype, bias=bias, class_weight=class_weight, g=g)
    co = _coefs(n, g)
    # an lse from elsewhere (vocab-parallel: the global one), here the reference's plus noise
    lse = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, softcap, _d(cw)).lse.float()
    lse = lse + 0.1 * torch.rand(n, generator=g)
    ours = kernels.backward(x, w, b, t, IGNORE, softcap, cw, lse, co, need_dx=True,
                            need_dw=True, need_db=True, low_memory=low_memory)
    ref = reference.backward(_d(x), _d(w), _d(b), t, IGNORE, softcap, _d(cw), lse.double(),
                             GradCoefs(*map(_d, co)), need_dx=True, need_dw=True, need_db=True)
    like_b = b if b is not None else w
    _check_grads(dict(zip(("dx", "dw", "db"), ours)), dict(zip(("dx", "dw", "db"), ref)),
                 x, w, like_b, TOL[dtype]["grads"], (True, True, True))


@pytest.mark.parametrize("path", ["row_chunks", "sweeps", "sweeps_low_memory"])
def test_backward_divides_coefficients_by_the_largest(monkeypatch, path):
    """The backward hands its pass the coefficients divided by their largest magnitude m and
    multiplies m back into the fp32 gradients as it rounds them (kernels._unit_coefs): on the
    row-chunk path in the backward's scaling, on the sweeps' fp16 (Triton) products by dividing
    their sums by D's scale over m. With one coefficient k on every valid row (an upstream
    gradient k per row, as a mean taken after reduction='none' gives) D then holds dz, not
    k * dz rounded: k here is 2^-9 (1 + 0.96 * 2^-11), nearly halfway between two fp16
    numbers, and with the logits spread so that p_t is small, every row's target entry
    (p_t - 1) k would carry k's rounding, a relative ~2^-11 in every row. dX, dW, db then within
    1.4x (db 1.55x) of fp64's gradients rounded once to fp16 (~1.15x; with k left in D ~2x). Ignored
    rows and out-of-shard targets, H and V not multiples of the tiles."""
    seen = []
    if path == "row_chunks":
        monkeypatch.setattr(config, "ROW_CHUNKS_ON_CPU", True)
        real = row_chunks.forward_with_grads
        monkeypatch.setattr(row_chunks, "forward_with_grads",
                            lambda p, cf, *a, **kw: seen.append(cf) or real(p, cf, *a, **kw))
    else:
        real_g = kernels.gradients
        monkeypatch.setattr(kernels, "gradients",
                            lambda p, lse, co, **kw: seen.append(co) or real_g(p, lse, co, **kw))
    g = _gen()
    x, w, b, t, _ = _inputs(97, 72, 203, torch.float16, ignored=0.2, g=g)
    w = (w.float() * 72 ** 0.5 / 2).half()  # logits of spread ~4: most p_t far below 1
    valid = (t != IGNORE).float()
    k = 2.0**-9 * (1 + 0.96 * 2.0**-11)
    zero = torch.zeros(97)
    co = GradCoefs(valid * k, zero, valid * k, zero)
    lse = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, None, None).lse
    ours = kernels.backward(x, w, b, t, IGNORE, None, None, lse.float(), co, need_dx=True,
                            need_dw=True, need_db=True, low_memory=path == "sweeps_low_memory")
    ref = reference.backward(_d(x), _d(w), _d(b), t, IGNORE, None, None, lse,
                             GradCoefs(*map(_d, co)), need_dx=True, need_dw=True, need_db=True)
    assert len(seen) == 1 and torch.equal(seen[0][0], valid) and torch.equal(seen[0][2], valid)
    # (db has V = 203 entries, so its ratio spreads more: 1.15x on average, 1.40x the largest
    # of 150 fresh inputs, against 1.74x the smallest with k left in D; dX and dW 1.22 / 1.84)
    for got, exp, bound in zip(ours, ref, (1.4, 1.4, 1.55)):
        assert got.dtype == torch.float16
        assert _rel(got, exp) <= bound * _rel(exp.half(), exp)


@pytest.mark.parametrize("low_memory", [False, True])
@pytest.mark.parametrize("can_sync", [True, False])
def test_sweep_backward_multiplies_the_largest_coefficient_back(monkeypatch, low_memory,
                                                                  can_sync):
    """The vocabulary sweeps' backward with cuBLAS products (CPU GEMMs here): the coefficients
    divided by their largest magnitude m, and m, a device tensor, multiplied into dX, dW and db
    as they are finished (kernels._unit_coefs, gradients.gradients), also where nothing may
    wait on the host (CUDA-graph capture, here ``_cannot_sync`` patched): the valid count is
    then not read and the products span every row. One coefficient k per valid row: the
    sweeps get exactly 1 there and m = k; dX, dW, db as the fp64 oracle's."""
    monkeypatch.setattr(config, "LIBRARY_PRODUCTS_ON_CPU", True)
    monkeypatch.setattr(config, "CHUNK_OVERRIDE", {"vc": 32, "row_block": 16, "row_vc": 64})
    monkeypatch.setattr(kernels, "_cannot_sync", lambda: not can_sync)
    seen = []
    real = kernels.gradients
    monkeypatch.setattr(kernels, "gradients",
                        lambda p, lse, co, **kw: seen.append((co, kw["factor"], p.n_valid_host))
                        or real(p, lse, co, **kw))
    g = _gen()
    x, w, b, t, _ = _inputs(45, 70, 101, torch.float32, out_of_shard=False, g=g)
    valid = (t != IGNORE).float()
    k = float(torch.rand((), generator=g)) / 45 + 1e-3
    zero = torch.zeros(45)
    co = GradCoefs(valid * k, zero, valid * k, zero)
    lse = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, None, None).lse
    ours = kernels.backward(x, w, b, t, IGNORE, None, None, lse.float(), co, need_dx=True,
                            need_dw=True, need_db=True, low_memory=low_memory)
    ref = reference.backward(_d(x), _d(w), _d(b), t, IGNORE, None, None, lse,
                             GradCoefs(*map(_d, co)), need_dx=True, need_dw=True, need_db=True)
    (unit, factor, n_valid), = seen
    assert torch.equal(unit.target, valid) and torch.equal(unit.prob, valid)
    assert torch.equal(factor, torch.tensor([k], dtype=torch.float32))
    assert n_valid == (int(valid.sum()) if can_sync else None)
    _check_grads(dict(zip(("dx", "dw", "db"), ours)), dict(zip(("dx", "dw", "db"), ref)),
                 x, w, b, 1e-5, (True, True, True))


def test_low_memory_dx_blocks(monkeypatch):
    """The memory-minimal dX sweeps' layout (gradients._low_memory_dx_blocks): within the own
    budgets without dW's buffer (or with one no larger than both), else the fewest launches
    (within 25 %) from dW's buffer, tallest blocks first; accumulator plus D always fit it."""
    import types
    from fused_ce.kernels.gradients import _low_memory_dx_blocks
    monkeypatch.setattr(config, "DX_ACC_BYTES_LOW_MEMORY", 32 * 48 * 4)
    monkeypatch.setattr(config, "D_BYTES_LOW_MEMORY", 32 * 64 * 4)
    p = types.SimpleNamespace(x=torch.empty(1), cfg=config.INTERPRETER, H=48, V=1000)
    assert _low_memory_dx_blocks(p, 100, 0) == (32, 64)
    assert _low_memory_dx_blocks(p, 100, 32 * 48 * 4 + 32 * 64 * 4) == (32, 64)
    for scratch in (40000, 100000, 400000):
        rb, vc = _low_memory_dx_blocks(p, 100, scratch)
        assert rb % 16 == 0 and vc % 32 == 0
        assert rb * 48 * 4 + rb * vc * 4 + 32 <= scratch
    # 400000 bytes: one block of all 100 rows (112: whole 16-row tiles; 21504 bytes of
    # accumulator) leaves D 832 columns: 2 chunks, as few as any split
    assert _low_memory_dx_blocks(p, 100, 400000) == (112, 832)
    # 40000 bytes: one block leaves D 32 columns (32 launches), 2 blocks of 64 rows 96 (22),
    # 7 blocks of 16 rows 576 (14, the fewest); the tallest within 25 % of 14: 4 blocks of 32
    # rows, 4 chunks of 256 (16)
    assert _low_memory_dx_blocks(p, 100, 40000) == (32, 256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("row_count", ["device", "host"])
def test_low_memory_dw_tail(dtype, row_count, grad_path, monkeypatch):
    """The memory-minimal dW sweep's first chunks keep D in dW's rows past them (still
    unwritten; gradients._tail_widths), then its own buffers: 37 rows, V = 400 with D's budget
    at one 32-column chunk, so chunks of 256, 64, then 32; ignored rows (with the count left on
    the device, D spans every row and must start at zero in each chunk's new place)."""
    import sys
    mod = sys.modules["fused_ce.kernels.gradients"]
    widths = []
    real = mod._tail_widths
    monkeypatch.setattr(mod, "_tail_widths", lambda *a: widths.append(real(*a)) or widths[-1])
    monkeypatch.setattr(config, "D_BYTES_LOW_MEMORY", 37 * 32 * dtype.itemsize + 64)
    g = _gen()
    x, w, b, t, _ = _inputs(37, 72, 400, dtype, out_of_shard=False, g=g)
    co = _coefs(37, g)
    kw = dict(coefs=co, need_dx=True, need_dw=True, need_db=True, low_memory=True)
    ours = kernels.forward(x, w, b, t, IGNORE, None, None, check_targets=row_count == "host",
                           **kw)
    ref = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, None, None,
                            **{**kw, "coefs": GradCoefs(*map(_d, co))})
    assert any(len(ws) >= 2 for ws in widths), widths
    _check_grads(ours, ref._asdict(), x, w, b, TOL[dtype]["grads"], (True, True, True))


@pytest.mark.parametrize("budget,known,want", [
    (1400, True, (False, 4, 32)),  # gathered rows (768 bytes) over half the budget: still
                                   # as wide as D over all 40 rows, so gathered
    (1400, False, (True, 40, 32)),  # count not read: D over every row
    (1000, True, (True, 40, 32)),  # the gathered rows leave D less than one block
    (2**16, True, (False, 4, 4032)),  # (2**16 - 768) // 4 // 4 rows, in whole blocks
])
def test_low_memory_dw_layout(budget, known, want, monkeypatch):
    """The memory-minimal dW sweep's layout (gradients._low_memory_dw_chunks): 4 valid rows of
    40, H = 48, fp32, blocks of 32 columns: (by_row, rows, chunk width)."""
    from fused_ce.kernels.gradients import _low_memory_dw_chunks
    from fused_ce.kernels.problem import Problem
    monkeypatch.setattr(config, "D_BYTES_LOW_MEMORY", budget)
    t = torch.full((40,), IGNORE)
    t[[3, 11, 20, 39]] = torch.tensor([5, 0, 99, 7])
    p = Problem(torch.randn(40, 48), torch.randn(1000, 48), None, t, IGNORE, None, None)
    assert _low_memory_dw_chunks(p, 4 if known else 40, known, True, True) == want
    assert _low_memory_dw_chunks(p, 4, known, False, False)[:2] == (False, 4)  # Triton products


def _gradients_module():
    import sys
    return sys.modules["fused_ce.kernels.gradients"]  # (kernels.gradients is the function)


@pytest.mark.parametrize("dtype,entry", [(torch.float32, "forward"), (torch.bfloat16, "forward"),
                                         (torch.bfloat16, "backward")])
def test_low_memory_one_sweep(dtype, entry, monkeypatch):
    """The memory-minimal gradients in one sweep where every row is valid (gradients.
    _low_memory_one_sweep): dX's fp32 accumulator in dW's last rows (bf16; fp32 dX is its own
    accumulator), the first part's chunks with D in dW's rows past them, the rest of the
    columns twice (dX's products with D in dX's buffer, then the dW sweep). N = 37 < V = 1000
    with D's budget at one 32-column block, large biases, a softcap, class weights, label
    smoothing and z-loss terms; the backward with one coefficient multiplied back. Against
    the fp64 oracle and against the row blocks' scheme (from the same D values)."""
    mod = _gradients_module()
    monkeypatch.setattr(config, "LOW_MEMORY_ONE_SWEEP", True)
    monkeypatch.setattr(config, "LIBRARY_PRODUCTS_ON_CPU", True)
    monkeypatch.setattr(config, "STATS_EPILOGUE", True)
    monkeypatch.setattr(mod, "_FIRST_ROWS_BYTES", 3 * 4 * 72)  # (dX's in-place finish in passes)
    monkeypatch.setattr(config, "D_BYTES_LOW_MEMORY", 37 * 32 * dtype.itemsize + 64)
    took = []
    real = mod._low_memory_one_sweep
    monkeypatch.setattr(mod, "_low_memory_one_sweep",
                        lambda *a, **k: took.append(a[5]) or real(*a, **k))
    g = _gen()
    x, w, b, t, cw = _inputs(37, 72, 1000, dtype, ignored=0.0, out_of_shard=False,
                             class_weight=True, g=g)
    b = (b.float() * 8).to(dtype)
    co = _coefs(37, g)
    need = dict(need_dx=True, need_dw=True, need_db=True, low_memory=True)

    def run():
        if entry == "forward":
            r = kernels.forward(x, w, b, t, IGNORE, 20.0, cw, coefs=co, check_targets=True,
                                **need)
            return dict(dx=r.dx, dw=r.dw, db=r.db)
        k = GradCoefs(*(c * 0.001 for c in co))
        return dict(zip(("dx", "dw", "db"), kernels.backward(
            x, w, b, t, IGNORE, 20.0, cw, lse.float(), k, **need)))

    lse = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, 20.0, _d(cw)).lse
    ours = run()
    v_acc, n_top, widths = took[0]
    # (bf16: dX's buffer holds 18 of the accumulator's 37 rows, dW's last 40 rows the rest)
    assert (v_acc, n_top) == ((1000, 37) if dtype == torch.float32 else (960, 18))
    assert len(widths) >= 2 and 750 <= sum(widths) < 1000  # (so all three parts ran)
    monkeypatch.setattr(config, "LOW_MEMORY_ONE_SWEEP", False)
    blocks = run()
    assert len(took) == 1
    scale = 1.0 if entry == "forward" else 0.001
    ref = reference.backward(_d(x), _d(w), _d(b), t, IGNORE, 20.0, _d(cw), lse,
                             GradCoefs(*(_d(c) * scale for c in co)), need_dx=True,
                             need_dw=True, need_db=True)
    for name, exp in zip(("dx", "dw", "db"), ref):
        got = ours[name]
        assert got.dtype == dtype and not got.isnan().any(), name
        if dtype == torch.float32:
            assert _rel(got, exp) <= 1e-5, (name, _rel(got, exp))
        else:  # (D itself is bf16: the error of both schemes; their fp32 sums over other
            # column chunks may round a rare element the other way)
            assert _rel(got, blocks[name]) <= 1e-3, name
            assert _rel(got, exp) <= 6e-3, (name, _rel(got, exp))


@pytest.mark.parametrize("ignored", [0.0, 0.3])
def test_dw_products_take_the_host_factor(ignored, monkeypatch):
    """The sweeps' cuBLAS dW products with the factor read on the host (``factor_host``, which
    kernels.backward reads with the valid count): dW's chunks written straight in bf16 by
    row_chunks.gemm_into, the factor as the product's scalar, instead of through fp32 chunks
    and a rounding pass; against the device-factor scheme and the fp64 oracle, every row
    valid (the one sweep) and 30 % ignored (the row blocks). N 37, H 72, V 1000, factor 0.37
    times the coefficients, large biases."""
    from fused_ce.kernels.problem import Problem
    mod = _gradients_module()
    monkeypatch.setattr(config, "LIBRARY_PRODUCTS_ON_CPU", True)
    monkeypatch.setattr(config, "D_BYTES_LOW_MEMORY", 37 * 32 * 2 + 64)
    direct = []
    real = mod.gemm_into
    monkeypatch.setattr(mod, "gemm_into", lambda a, b, out, alpha: direct.append(
        (out.dtype, alpha)) or real(a, b, out, alpha=alpha))
    g = _gen()
    x, w, b, t, _ = _inputs(37, 72, 1000, torch.bfloat16, ignored=ignored, out_of_shard=False,
                            g=g)
    b = (b.float() * 8).bfloat16()
    co = _coefs(37, g)
    lse = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, None, None).lse
    m = max(co.target.abs().max(), co.prob.abs().max()).reshape(1) * 0.37
    unit = GradCoefs(*(c * 0.37 / m for c in co))

    def run(host):
        p = Problem(x, w, b, t, IGNORE, None, None)
        p.n_valid_host = int((t != IGNORE).sum())
        return mod.gradients(p, lse.float(), unit, need_dx=True, need_dw=True, need_db=True,
                             low_memory=True, factor=m, factor_host=float(m) if host else None)

    ours = run(True)
    assert direct and all(d == (torch.bfloat16, float(m)) for d in direct)
    n_direct = len(direct)
    device = run(False)
    assert len(direct) == n_direct  # (the device factor: fp32 chunks)
    ref = reference.backward(_d(x), _d(w), _d(b), t, IGNORE, None, None, lse,
                             GradCoefs(*(_d(c) * 0.37 for c in co)), need_dx=True,
                             need_dw=True, need_db=True)
    for name, a, d, e in zip(("dx", "dw", "db"), ours, device, ref):
        assert a.dtype == torch.bfloat16 and _rel(a, d) <= 1e-3, name
        assert _rel(a, e) <= 6e-3, (name, _rel(a, e))


def test_exact_16bit_reductions_restores_the_setting():
    """row_chunks.exact_16bit_reductions: torch's bf16 reduced-precision reductions off inside,
    the setting as it was after (on, or off), also when the block raises."""
    from fused_ce.kernels.row_chunks import exact_16bit_reductions
    m = torch.backends.cuda.matmul
    before = m.allow_bf16_reduced_precision_reduction
    try:
        for setting in (True, False):
            m.allow_bf16_reduced_precision_reduction = setting
            with pytest.raises(RuntimeError):
                with exact_16bit_reductions(torch.bfloat16):
                    assert m.allow_bf16_reduced_precision_reduction is False
                    raise RuntimeError
            assert m.allow_bf16_reduced_precision_reduction is setting
    finally:
        m.allow_bf16_reduced_precision_reduction = before


@pytest.mark.parametrize("split,group_m,persistent", [(1, 0, False), (2, 3, False),
                                                    (1, 0, True), (2, 3, True)])
@pytest.mark.parametrize("rows", ["all_valid", "ignored_known", "ignored_unknown"])
@pytest.mark.parametrize("low_memory", [False, True])
def test_grad_logits_orders_and_stores(split, group_m, persistent, rows, low_memory,
                                       monkeypatch):
    """grad_logits_kernel in both tile orders (every row tile of a column tile in turn; groups
    of 3 row tiles), one program per tile or 2 programs taking them in turn, with its epilogue
    whole or on column halves, reading x and writing D through descriptors
    where the rows allow (every row valid: x's own; the count read and cuBLAS products: the
    gathered rows) and through pointers where not (D by the tokens' rows: count unknown):
    the gradients of every sweep layout against fp64. N = 45 (three row tiles less one row),
    H = 40 (past the K tile), V = 203, chunks of a few tiles, large biases."""
    from fused_ce.kernels.problem import Problem
    mod = _gradients_module()
    monkeypatch.setitem(config.INTERPRETER, "grad_logits",
                        dict(SPLIT=split, GROUP_M=group_m, PERSISTENT=persistent, FLATTEN=False,
                             programs=2))
    monkeypatch.setattr(config, "LIBRARY_PRODUCTS_ON_CPU", True)
    monkeypatch.setattr(config, "CHUNK_OVERRIDE", {"vc": 64, "row_block": 16, "row_vc": 48})
    launches = []
    real = mod.grad_logits_kernel

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((kw["X_DESC"], kw["D_DESC"], kw["D_BY_ROW"], kw["STORE_D"]))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(mod, "grad_logits_kernel", Recorded())
    g = _gen()
    x, w, b, t, _ = _inputs(45, 40, 203, torch.float32, ignored=0.0 if rows == "all_valid"
                            else 0.4, out_of_shard=False, g=g)
    b = b * 8
    co = _coefs(45, g)
    p = Problem(x, w, b, t, IGNORE, None, None)
    if rows != "ignored_unknown":
        p.n_valid_host = int((t != IGNORE).sum())
    lse = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, None, None).lse
    got = mod.gradients(p, lse.float(), co, need_dx=True, need_dw=True, need_db=True,
                        low_memory=low_memory)
    ref = reference.backward(_d(x), _d(w), _d(b), t, IGNORE, None, None, lse,
                             GradCoefs(*(_d(c) for c in co)), need_dx=True, need_dw=True,
                             need_db=True)
    for name, a, e in zip(("dx", "dw", "db"), got, ref):
        assert _rel(a, e) <= 1e-5, (name, _rel(a, e))
    assert launches
    for x_desc, d_desc, by_row, store_d in launches:
        assert d_desc == (store_d and not by_row)
        if rows == "all_valid":
            assert x_desc
    if rows == "ignored_known":  # (the dW sweep's products take the gathered rows)
        assert any(x_desc for x_desc, *_ in launches)
    if rows == "ignored_unknown":
        assert not any(x_desc for x_desc, *_ in launches)


@pytest.mark.parametrize("n,first_rows", [(1, 1), (2, 1), (37, 2), (37, 3), (64, 5), (37, 99)])
@pytest.mark.parametrize("factor", [None, 0.37])
def test_finish_top_rows_in_place(n, first_rows, factor, monkeypatch):
    """gradients._finish_top_rows: dX's buffer (n x 24 bf16) holding the accumulator's first
    n // 2 rows in fp32 becomes those rows of dX, times the factor and rounded once, bitwise,
    in place: the first rows through a copy (``first_rows`` of them), then doubling ranges;
    the bytes past them are left alone."""
    mod = _gradients_module()
    h = 24
    monkeypatch.setattr(mod, "_FIRST_ROWS_BYTES", first_rows * 4 * h)
    n_top = n // 2
    dx = torch.full((n, h), 7.0, dtype=torch.bfloat16)
    acc = mod.top_rows_accumulator(dx, n_top)
    acc.copy_(torch.randn(n_top, h, generator=_gen()) * 100)
    want = acc.clone() * (1.0 if factor is None else factor)
    tail = dx.view(-1)[2 * n_top * h:].clone()  # (past the accumulator's bytes)
    mod._finish_top_rows(dx, n_top, None if factor is None else torch.tensor([factor]))
    assert torch.equal(dx[:n_top], want.bfloat16())
    assert torch.equal(dx.view(-1)[2 * n_top * h:], tail)


@pytest.mark.parametrize("case", ["ok", "ignored", "count_unknown", "no_dx", "narrow_h",
                                  "few_columns", "switched_off"])
def test_one_sweep_layout_where_it_applies(case, monkeypatch):
    """gradients._one_sweep_layout: switched on (config.LOW_MEMORY_ONE_SWEEP), every row valid
    with the count read, dX and dW asked for, the first part at least three quarters of the
    columns (with H 8 dW's rows are too narrow for that)."""
    from fused_ce.kernels.problem import Problem
    mod = _gradients_module()
    monkeypatch.setattr(config, "LOW_MEMORY_ONE_SWEEP", case != "switched_off")
    monkeypatch.setattr(config, "LIBRARY_PRODUCTS_ON_CPU", True)
    n, h, v = 37, 8 if case == "narrow_h" else 72, 120 if case == "few_columns" else 1000
    t = torch.randint(0, v, (n,))
    if case == "ignored":
        t[5] = IGNORE
    x, w = torch.randn(n, h), torch.randn(v, h)
    p = Problem(x, w, None, t, IGNORE, None, None)
    if case != "count_unknown":
        p.n_valid_host = int((t != IGNORE).sum())
    dx = None if case == "no_dx" else torch.empty(n, h, dtype=torch.bfloat16)
    dw = torch.empty(v, h, dtype=torch.bfloat16)
    layout = mod._one_sweep_layout(p, dx, dw, 32, alpha=1.0)  # (the factor on the host)
    if case == "ok":
        assert layout[:2] == (960, 18) and sum(layout[2]) >= 750
    else:
        assert layout is None


def test_w_descriptor_same_results_as_pointers(small_chunks, monkeypatch):
    """The sweeps read a 16-bit W through a TMA descriptor where its rows are 16-byte aligned
    (zeros past V and H from the descriptor), else through pointers: the same logits bit for
    bit, so the same statistics, gradients and log-probabilities. fp32 takes the pointers."""
    dtype = torch.float16
    from fused_ce.kernels.problem import Problem
    g = _gen()
    n, h, v = 29, 56, 67
    x, w, b, t, cw = _inputs(n, h, v, dtype, class_weight=True, out_of_shard=False, g=g)
    co = _coefs(n, g)
    runs = {}
    for desc in (True, False):
        monkeypatch.setattr(config, "W_DESCRIPTOR", desc)
        assert Problem(x, w, b, t, IGNORE, None, cw).flags["W_DESC"] is desc
        out = kernels.forward(x, w, b, t, IGNORE, 3.0, cw, with_weighted_sum=True, coefs=co,
                              need_dx=True, need_dw=True, need_db=True)
        runs[desc] = [*out, kernels.log_softmax(x, w, b)]
    for name, a, c in zip([*out._fields, "log_probs"], runs[True], runs[False]):
        assert (a is None and c is None) or torch.equal(a, c), name
    assert all(runs[True][i] is not None for i in range(8))  # statistics, dx, dw, db
    # rows that a descriptor cannot address: an odd H, or a base off a 16-byte boundary
    monkeypatch.setattr(config, "W_DESCRIPTOR", True)
    assert not Problem(x[:, :55], w[:, :55].contiguous(), b, t, IGNORE, None, cw).flags["W_DESC"]
    w_off = torch.empty(v * h + 1, dtype=dtype)[1:].view(v, h)
    assert not Problem(x, w_off, b, t, IGNORE, None, cw).flags["W_DESC"]
    assert not Problem(x.float(), w.float(), b, t, IGNORE, None, cw).flags["W_DESC"]


def test_out_of_range_target_raises(grad_path):
    """check_targets: a target outside [0, V) that is not ignore_index raises (the row-chunk
    path reads the count with its one host sync); without it the row is out of shard."""
    g = _gen()
    x, w, b, t, _ = _inputs(12, 48, 53, torch.float32, out_of_shard=False, g=g)
    t[5] = 53
    co = _coefs(12, g)
    with pytest.raises(ValueError, match="target"):
        kernels.forward(x, w, b, t, IGNORE, None, None, coefs=co, need_dx=True,
                        check_targets=True)
    out = kernels.forward(x, w, b, t, IGNORE, None, None, coefs=co, need_dx=True)
    assert out.target_logit[5] == 0


@pytest.mark.parametrize("bad", [-3, 53])
def test_statistics_queued_before_the_target_check_waits(monkeypatch, bad):
    """Without gradients (evaluation; the forward of reduction='none' and low_memory) the
    target check's host read is waited for only once the statistics pass is queued, so that
    the GPU is not idle while the host waits: that pass takes any target (here with class
    weights and a softcap), and the call still raises, naming the target."""
    order = []
    real_stats, real_wait = kernels._row_stats, kernels.CountRead.wait
    monkeypatch.setattr(kernels, "_row_stats",
                        lambda *a: order.append("statistics") or real_stats(*a))
    monkeypatch.setattr(kernels.CountRead, "wait",
                        lambda self, *a, **kw: order.append("wait") or real_wait(self, *a, **kw))
    g = _gen()
    x, w, b, t, cw = _inputs(12, 48, 53, torch.float32, class_weight=True, out_of_shard=False,
                             g=g)
    t[5] = bad
    with pytest.raises(ValueError, match=f"target: expected .* got {bad} at flat position 5"):
        kernels.forward(x, w, b, t, IGNORE, 3.0, cw, with_weighted_sum=True,
                        check_targets=True)
    assert order == ["statistics", "wait"]


def test_default_budget_single_chunk():
    """Without the test override: the real workspace sizing (one chunk at these sizes)."""
    g = _gen()
    x, w, b, t, cw = _inputs(20, 40, 53, torch.float32, g=g)
    co = _coefs(20, g)
    for low in (False, True):
        ours = kernels.forward(x, w, b, t, IGNORE, None, None, coefs=co, need_dx=True,
                               need_dw=True, need_db=True, low_memory=low)
        ref = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, None, None,
                                coefs=GradCoefs(*map(_d, co)), need_dx=True, need_dw=True,
                                need_db=True)
        _check_grads(ours, ref._asdict(), x, w, b, 1e-5, (True, True, True))


def test_all_rows_ignored(grad_path):
    g = _gen()
    x, w, b, t, _ = _inputs(9, 70, 41, torch.float32, g=g)
    t[:] = IGNORE
    co = _coefs(9, g)
    out = kernels.forward(x, w, b, t, IGNORE, None, None, with_weighted_sum=True, coefs=co,
                          need_dx=True, need_dw=True, need_db=True)
    for name in ("lse", "target_logit", "weighted_sum", "max_logit", "dx", "dw", "db"):
        assert (getattr(out, name) == 0).all(), name
    assert (out.argmax == IGNORE).all()


@pytest.mark.parametrize("low_memory", [False, True])
def test_class_weights_summing_to_zero_give_torchs_nans(grad_path, low_memory):
    """'mean' with class weights that sum to 0 over the valid targets: torch's loss is 0/0 and
    so are the valid rows' gradients (nan); the ignored rows' dx stays 0 (the public API: the
    nan comes in through the coefficients)."""
    import fused_ce

    g = _gen()
    x, w, b, t, _ = _inputs(13, 70, 41, torch.float32, out_of_shard=False, g=g)
    cw = torch.ones(41)
    cw[t[t != IGNORE]] = 0
    for p in (x, w, b):
        p.requires_grad_(True)
    loss = fused_ce.linear_cross_entropy(x, w, t, linear_bias=b, weight=cw, z_loss=1e-3,
                                         label_smoothing=0.1, low_memory=low_memory)
    loss.backward()
    valid = t != IGNORE
    assert loss.isnan() and 0 < valid.sum() < 13
    assert x.grad[valid].isnan().all() and (x.grad[~valid] == 0).all()
    assert w.grad.isnan().all() and b.grad.isnan().all()


def test_argmax_ties_take_first_column(grad_path):
    """Small-integer inputs make every logit exact in any summation order, so ties are real
    ties (many of them, within a tile and across tiles and vocabulary splits): the first column
    attaining the max must win, as torch.argmax's rule."""
    g = _gen()
    n, h, v = 24, 48, 150
    x = torch.randint(-2, 3, (n, h), generator=g).float()
    w = torch.randint(-2, 3, (v, h), generator=g).float()
    b = torch.randint(-2, 3, (v,), generator=g).float()
    w[100] = w[140] = w[5]  # guaranteed ties across tiles (and splits)
    b[100] = b[140] = b[5]
    t = torch.randint(0, v, (n,), generator=g)
    # with gradients asked for, so that the row-chunk path computes the statistics too
    out = kernels.forward(x, w, b, t, IGNORE, None, None, coefs=_coefs(n, g), need_dx=True)
    exact = x.double() @ w.double().t() + b.double()
    assert torch.equal(out.argmax, exact.argmax(1))
    assert torch.equal(out.max_logit.double(), exact.max(1).values)


@pytest.mark.parametrize("epilogue", [False, True])
def test_confident_targets_keep_their_digits(grad_path, epilogue, monkeypatch):
    """nll = lse - z_t for targets holding nearly all the probability (nll ~1e-7): within twice
    eager fp32's own error of the fp64 value, on both paths (the row chunks with
    finish_rows_kernel, or with ``epilogue`` logits_tiles.py). (An fp32 lse minus z_t is off by
    ~100 % here: lse's rounding at |lse| ~ 5 is ~5e-7; eager's error is ~25 %.)"""
    from tests.oracle import near_oracle

    g = _gen()
    monkeypatch.setattr(config, "LOGITS_EPILOGUE", epilogue)
    n, h, v = 33, 8, 3
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) * 0.1
    b = torch.tensor([-5.0, -21.0, -22.0]) + 0.3 * torch.rand(v, generator=g)
    t = torch.zeros(n, dtype=torch.long)  # the confident class
    t[::5] = IGNORE
    out = kernels.forward(x, w, b, t, IGNORE, None, None, coefs=_coefs(n, g), need_dx=True)
    valid = t != IGNORE
    z64 = x.double() @ w.double().t() + b.double()
    want = torch.nn.functional.cross_entropy(z64[valid], t[valid], reduction="none")
    eager = torch.nn.functional.cross_entropy((x @ w.t() + b)[valid], t[valid], reduction="none")
    assert want.max() < 1e-5  # the regime of the test: tiny losses
    assert (out.nll[~valid] == 0).all()
    _, err, eager_err, _ = near_oracle(out.nll[valid], want, eager, 0)
    assert err <= 2 * eager_err, (err, eager_err, want.norm().item())


@pytest.mark.parametrize("n,h,v", [(1, 70, 37), (23, 48, 101)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_log_softmax(n, h, v, dtype):
    g = _gen()
    x, w, b, _, _ = _inputs(n, h, v, dtype, g=g)
    ours = kernels.log_softmax(x, w, b)
    ref = torch.log_softmax(x.double() @ w.double().t() + b.double(), -1)
    assert ours.dtype == dtype and not ours.isnan().any()
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert _rel(ours, ref) <= tol


def test_nonfinite_input_propagates(grad_path):
    g = _gen()
    x, w, b, t, _ = _inputs(10, 48, 53, torch.float32, ignored=0.0, out_of_shard=False, g=g)
    x[4, 7] = float("nan")
    x[6, 0] = float("inf")
    co = _coefs(10, g)
    out = kernels.forward(x, w, b, t, IGNORE, None, None, coefs=co, need_dx=True, need_dw=True,
                          need_db=True)
    assert not torch.isfinite(out.lse[4]) and not torch.isfinite(out.lse[6])
    assert torch.isfinite(out.lse[[0, 1, 2, 3, 5, 7, 8, 9]]).all()
    assert not torch.isfinite(out.dw).all() and not torch.isfinite(out.db).all()


def test_supports_under_interpreter():
    assert kernels.supports(torch.zeros(1))


@pytest.fixture(params=["vocab_sweep", "vocab_sweep_library", "row_chunks", "row_chunks_tiles"])
def grad_path(request, monkeypatch):
    """Both paths of forward-with-gradients: the vocabulary sweep with its Triton products or
    (``_library``) with the products by torch.mm (CPU GEMMs stand in for cuBLAS; fp16 keeps
    the Triton products), and the row-chunk path (row_chunks.py) with a Z budget of a few rows,
    so that dW is accumulated over several chunks; ``_tiles``: its logits by the epilogue GEMM
    (logits_tiles.py) wherever that applies (fp32 here, no softcap). The sweep with library
    products also takes its statistics (the lse) from stats_pass.py where that applies."""
    if request.param == "vocab_sweep_library":
        monkeypatch.setattr(config, "LIBRARY_PRODUCTS_ON_CPU", True)
        monkeypatch.setattr(config, "STATS_EPILOGUE", True)
    if request.param.startswith("row_chunks"):
        monkeypatch.setattr(config, "ROW_CHUNKS_ON_CPU", True)
        monkeypatch.setattr(config, "ROW_CHUNK_BYTES", 7 * 128 * 4)  # 7 rows of Z at V <= 128
        monkeypatch.setattr(config, "ROW_CHUNKS_FEW", 1000)  # (no lower bound from the rows)
    if request.param == "row_chunks_tiles":
        monkeypatch.setattr(config, "LOGITS_EPILOGUE", True)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("softcap,class_weight,budget", [(None, False, 7 * 128 * 4),
                                                         (3.0, True, 7 * 128 * 4),
                                                         (None, True, 2**20)])
def test_row_chunk_path(dtype, softcap, class_weight, budget, monkeypatch):
    """The row-chunk path through kernels.forward: several chunks (fp32 dW accumulator) or one
    chunk (dW from a single product); fp16 writes D over Z's rows. Ignored rows, out-of-shard
    targets, mean-sized coefficients (fp16 gradient scaling)."""
    monkeypatch.setattr(config, "ROW_CHUNKS_ON_CPU", True)
    monkeypatch.setattr(config, "ROW_CHUNK_BYTES", budget)
    monkeypatch.setattr(config, "ROW_CHUNKS_FEW", 1000)
    g = _gen()
    n, h, v = 90, 48, 71
    x, w, b, t, cw = _inputs(n, h, v, dtype, class_weight=class_weight, g=g)
    co = GradCoefs(*(c / n for c in _coefs(n, g)))
    kw = dict(with_weighted_sum=True, coefs=co, need_dx=True, need_dw=True, need_db=True)
    ours = kernels.forward(x, w, b, t, IGNORE, softcap, cw, **kw)
    ref = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, softcap, _d(cw),
                            **{**kw, "coefs": GradCoefs(*map(_d, co))})
    _check_stats(ours, ref, t, 1e-5, (x, w, b, t, cw), softcap)
    _check_grads(ours, ref._asdict(), x, w, b, TOL[dtype]["grads"], (True, True, True))
    assert (ours.dx[t == IGNORE] == 0).all()


def _epilogue_path_used(monkeypatch) -> list:
    """Appends to the returned list whenever the epilogue GEMM (TileStats.logits) runs."""
    from fused_ce.kernels import logits_tiles

    used = []
    real = logits_tiles.TileStats.logits
    monkeypatch.setattr(logits_tiles.TileStats, "logits",
                        lambda self, *a, **k: used.append(1) or real(self, *a, **k))
    return used


@pytest.mark.parametrize("n,h,v", [(1, 52, 37), (45, 52, 101), (90, 48, 71)])
@pytest.mark.parametrize("bias,class_weight,budget,split,softcap", [
    (True, False, 7 * 128 * 4, 2, None), (False, True, 7 * 128 * 4, 2, None),
    (True, True, 2**20, 2, None), (True, True, 7 * 128 * 4, 1, None),
    (True, True, 7 * 128 * 4, 2, 2.0), (False, False, 2**20, 1, 2.0)])
def test_logits_tiles_path(n, h, v, bias, class_weight, budget, split, softcap, monkeypatch):
    """The row-chunk path with the softmax's first pass in the logits GEMM's epilogue
    (logits_tiles.py; here with fp32 E): H not a multiple of the K tile (52; the descriptors
    read zeros past it), N = 1, V prime, several chunks or one, with and without bias and class
    weights (the weighted sum per tile), ignored rows and out-of-shard targets; the epilogue on
    the whole GEMM tile or on its two column halves (``split``; at each V here the last tile's
    second half lies past V). With a softcap (2.0: most logits well into the cap's bend; E then
    holds E f, the cap's derivative) without label smoothing: no weighted sums, and the
    smoothing coefficients 0 (as the API passes them), a z-loss's and class weights'
    coefficients kept."""
    _epilogue_split(monkeypatch, split)
    used = _epilogue_path_used(monkeypatch)
    monkeypatch.setattr(config, "LOGITS_EPILOGUE", True)
    monkeypatch.setattr(config, "ROW_CHUNKS_ON_CPU", True)
    monkeypatch.setattr(config, "ROW_CHUNK_BYTES", budget)
    monkeypatch.setattr(config, "ROW_CHUNKS_FEW", 1000)
    g = _gen()
    # (the one row of N = 1 is not ignored: the path must run)
    x, w, b, t, cw = _inputs(n, h, v, torch.float32, bias=bias, class_weight=class_weight,
                             ignored=0.25 if n > 1 else 0.0, g=g)
    co = GradCoefs(*(c / n for c in _coefs(n, g)))
    if softcap is not None:
        co = co._replace(smooth=torch.zeros(n), prob=co.target)
    kw = dict(with_weighted_sum=softcap is None, coefs=co, need_dx=True, need_dw=True,
              need_db=True)
    ours = kernels.forward(x, w, b, t, IGNORE, softcap, cw, **kw)
    ref = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, softcap, _d(cw),
                            **{**kw, "coefs": GradCoefs(*map(_d, co))})
    assert used, "the epilogue path did not run"
    _check_stats(ours, ref, t, 1e-5, (x, w, b, t, cw), softcap)
    _check_grads(ours, ref._asdict(), x, w, b, 1e-5, (True, True, True))
    assert (ours.dx[t == IGNORE] == 0).all()


def test_tanh_keeps_its_relative_precision():
    """The kernels' tanh (the softcap's) within a few fp32 ulps of its own value everywhere
    (tests/_tanh_check.py), under the interpreter."""
    check_tanh("cpu", ulps=4)


def test_softcap_with_label_smoothing_takes_the_fp32_logits_path(monkeypatch):
    """A softcap with label smoothing: D's smoothing term would need the cap's derivative of
    every logit, which the epilogue's E f does not give apart (logits_tiles.py), so the
    row-chunk path takes cuBLAS-style fp32 logits there (no epilogue GEMM), and agrees with
    fp64."""
    used = _epilogue_path_used(monkeypatch)
    monkeypatch.setattr(config, "LOGITS_EPILOGUE", True)
    monkeypatch.setattr(config, "ROW_CHUNKS_ON_CPU", True)
    g = _gen()
    n, h, v = 45, 40, 67
    x, w, b, t, cw = _inputs(n, h, v, torch.float32, class_weight=True, g=g)
    co = GradCoefs(*(c / n for c in _coefs(n, g)))
    kw = dict(with_weighted_sum=True, coefs=co, need_dx=True, need_dw=True, need_db=True)
    ours = kernels.forward(x, w, b, t, IGNORE, 2.0, cw, **kw)
    ref = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, 2.0, _d(cw),
                            **{**kw, "coefs": GradCoefs(*map(_d, co))})
    assert not used
    _check_stats(ours, ref, t, 1e-5, (x, w, b, t, cw), 2.0)
    _check_grads(ours, ref._asdict(), x, w, b, 1e-5, (True, True, True))


@pytest.mark.parametrize("n,h,v", [(1, 56, 37), (45, 56, 101), (90, 48, 71)])
@pytest.mark.parametrize("dtype,bias,class_weight,softcap,chunk_bytes,split", [
    (torch.float32, True, False, None, 2**20, 2), (torch.float32, False, True, None, 2**20, 1),
    (torch.float32, True, True, 2.0, 1, 2), (torch.float16, True, True, None, 1, 2),
    (torch.float16, False, False, 3.0, 2**20, 1)])
def test_stats_pass(n, h, v, dtype, bias, class_weight, softcap, chunk_bytes, split,
                    monkeypatch):
    """stats_pass.py, the statistics by the epilogue GEMM without E: one chunk or chunks of one
    row tile each (``chunk_bytes`` 1: the chunk after the valid rows then has nothing to do),
    the epilogue on the whole tile or on column halves, N = 1, V prime, H not a multiple of
    the K tile, ignored rows and out-of-shard targets, the weighted sum with and without class
    weights, with and without a softcap (2.0: most logits well into the cap's bend); rows past
    the valid count and ignored ones are zero (the allocations are poisoned)."""
    from fused_ce.kernels import stats_pass

    _epilogue_split(monkeypatch, split)
    monkeypatch.setattr(config, "STATS_EPILOGUE", True)
    monkeypatch.setattr(config, "STATS_TILE_BYTES", chunk_bytes)
    chunks = _recorded(monkeypatch, stats_pass, "chunk_rows")
    g = _gen()
    x, w, b, t, cw = _inputs(n, h, v, dtype, bias=bias, class_weight=class_weight,
                             ignored=0.4 if n > 1 else 0.0, g=g)
    ours = kernels.forward(x, w, b, t, IGNORE, softcap, cw, with_weighted_sum=True)
    ref = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, softcap, _d(cw),
                            with_weighted_sum=True)
    bm = config.INTERPRETER["logits_tiles"]["BM"]
    assert chunks == [min(n, bm) if chunk_bytes == 1 else n]
    _check_stats(ours, ref, t, TOL[dtype]["stats"], (x, w, b, t, cw), softcap)


@pytest.mark.parametrize("with_ws,class_weight", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("chunk_bytes", [1, 2**20])
def test_stats_pass_row_losses(with_ws, class_weight, chunk_bytes, monkeypatch):
    """Given coefficients but no gradient to compute, stats_pass.py's finish kernel also writes
    the row losses (ops._row_loss of the fp64 reference's statistics, with and without the
    weighted sum and class weights), 0 on ignored rows and on positions past the valid count
    (allocations poisoned); the row-stats path (row_stats.py) leaves them to the caller."""
    from fused_ce import ops
    monkeypatch.setattr(config, "STATS_TILE_BYTES", chunk_bytes)
    g = _gen()
    x, w, b, t, cw = _inputs(45, 48, 89, torch.float32, class_weight=class_weight, g=g)
    co = _coefs(45, g)
    co = co._replace(target=co.target * (t != IGNORE))  # (the API's: 0 on ignored rows)
    ref = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, None, _d(cw),
                            with_weighted_sum=with_ws)
    want = ops._row_loss(ref, GradCoefs(*map(_d, co)), with_ws)
    for tiles in (True, False):
        monkeypatch.setattr(config, "STATS_EPILOGUE", tiles)
        ours = kernels.forward(x, w, b, t, IGNORE, None, cw, with_weighted_sum=with_ws,
                               coefs=co)
        assert ours.dx is None and ours.dw is None and ours.db is None
        if not tiles:
            assert ours.row_loss is None
            continue
        assert _rel(ours.row_loss, want) < 1e-5
        assert (ours.row_loss[t == IGNORE] == 0).all()


@pytest.mark.parametrize("what", ["all_ignored", "nonfinite", "capped_inf", "ties",
                                  "low_memory_grads"])
def test_stats_pass_cases(what, small_chunks, monkeypatch):
    """stats_pass.py on every row ignored (nothing computed, zeros and ignore_index), on NaN and
    inf in x (they reach the row's lse, no other row's; with a softcap every logit of an inf row
    is finite, and so is its lse and weighted sum, also at V not a multiple of the tile, whose
    zero-padded columns see inf * 0), on exact ties across vocabulary tiles (the first column
    wins) and as the start of the memory-minimal gradient sweeps (with the row losses from its
    finish kernel)."""
    from fused_ce import ops
    from fused_ce.kernels import stats_pass

    monkeypatch.setattr(config, "STATS_EPILOGUE", True)
    used = _recorded(monkeypatch, stats_pass, "row_stats")
    g = _gen()
    x, w, b, t, cw = _inputs(37, 48, 89, torch.float32, ignored=0.0 if what == "nonfinite"
                             else 0.25, out_of_shard=what != "nonfinite", g=g)
    if what == "all_ignored":
        t[:] = IGNORE
        out = kernels.forward(x, w, b, t, IGNORE, None, None, with_weighted_sum=True)
        for name in ("lse", "target_logit", "weighted_sum", "max_logit", "nll"):
            assert (getattr(out, name) == 0).all(), name
        assert (out.argmax == IGNORE).all()
    elif what == "nonfinite":
        x[4, 7] = float("nan")
        x[6, 0] = float("inf")
        out = kernels.forward(x, w, b, t, IGNORE, None, None)
        assert not torch.isfinite(out.lse[4]) and not torch.isfinite(out.lse[6])
        assert torch.isfinite(out.lse[[i for i in range(37) if i not in (4, 6)]]).all()
    elif what == "capped_inf":
        x[4, 7] = float("-inf")
        x[6, 0] = float("inf")
        out = kernels.forward(x, w, b, t, IGNORE, 2.0, cw, with_weighted_sum=True)
        ref = reference.forward(*map(_d, (x, w, b)), t, IGNORE, 2.0, _d(cw),
                                with_weighted_sum=True)
        _check_stats(out, ref, t, 1e-5, (x, w, b, t, cw), 2.0)
        assert torch.isfinite(out.weighted_sum).all() and torch.isfinite(out.lse).all()
    elif what == "ties":
        x = torch.randint(-2, 3, x.shape, generator=g).float()
        w = torch.randint(-2, 3, w.shape, generator=g).float()
        w[60] = w[80] = w[5]  # the same logit in three tiles
        out = kernels.forward(x, w, None, t, IGNORE, None, None)
        exact = x.double() @ w.double().t()
        valid = t != IGNORE
        assert torch.equal(out.argmax[valid], exact.argmax(1)[valid])
        assert torch.equal(out.max_logit.double()[valid], exact.max(1).values[valid])
    else:
        co = _coefs(37, g)
        kw = dict(with_weighted_sum=True, coefs=co, need_dx=True, need_dw=True, need_db=True,
                  low_memory=True)
        out = kernels.forward(x, w, b, t, IGNORE, None, cw, **kw)
        ref = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, None, _d(cw),
                                **{**kw, "coefs": GradCoefs(*map(_d, co))})
        _check_stats(out, ref, t, 1e-5, (x, w, b, t, cw), None)
        _check_grads(out, ref._asdict(), x, w, b, 1e-5, (True, True, True))
        assert _rel(out.row_loss, ops._row_loss(ref, GradCoefs(*map(_d, co)), True)) < 1e-5
    assert used


@pytest.mark.parametrize("ignored,budget,arrived", [(1.0, 7 * 128 * 4, False),
                                                    (0.9, 7 * 128 * 4, False),
                                                    (0.5, 2**20, False), (0.5, 2**20, True)])
def test_logits_tiles_first_chunk_before_count(ignored, budget, arrived, monkeypatch):
    """Unless the host read of the valid count has arrived (``arrived``; on the CPU it always
    has), the epilogue path launches its first chunk's logits GEMM before waiting for it, over
    the first rows of the stable partition (chunked as if every row were valid; the kernel
    skips the rows past the count it reads on the device): against fp64 with every row ignored
    (zero gradients), with fewer valid rows than one chunk, and with half the rows valid in one
    chunk."""
    from fused_ce.kernels import logits_tiles
    monkeypatch.setattr(kernels.CountRead, "arrived", lambda self: arrived)
    order = []
    real_logits, real_wait = logits_tiles.TileStats.logits, kernels.CountRead.wait
    stats = []
    monkeypatch.setattr(logits_tiles.TileStats, "logits",
                        lambda self, *a, **k: order.append("logits") or stats.append(self)
                        or real_logits(self, *a, **k))
    monkeypatch.setattr(kernels.CountRead, "wait",
                        lambda self, *a, **k: order.append("wait") or real_wait(self, *a, **k))
    monkeypatch.setattr(config, "LOGITS_EPILOGUE", True)
    monkeypatch.setattr(config, "ROW_CHUNKS_ON_CPU", True)
    monkeypatch.setattr(config, "ROW_CHUNK_BYTES", budget)
    monkeypatch.setattr(config, "ROW_CHUNKS_FEW", 1000)
    g = _gen()
    n, h, v = 60, 52, 101
    x, w, b, t, cw = _inputs(n, h, v, torch.float32, ignored=ignored, out_of_shard=False, g=g)
    co = GradCoefs(*(c / n for c in _coefs(n, g)))
    kw = dict(with_weighted_sum=True, coefs=co, need_dx=True, need_dw=True, need_db=True)
    ours = kernels.forward(x, w, b, t, IGNORE, None, cw, **kw)
    ref = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, None, _d(cw),
                            **{**kw, "coefs": GradCoefs(*map(_d, co))})
    n_valid = int((t != IGNORE).sum())
    if arrived:
        assert order[:2] == ["wait", "logits"]
    else:
        assert order[:2] == ["logits", "wait"]
        # the GEMM computed no row past the valid count (the workspace is NaN-filled)
        assert stats[0].m[n_valid:].isnan().all() and not stats[0].m[:n_valid].isnan().any()
    _check_stats(ours, ref, t, 1e-5, (x, w, b, t, cw), None)
    if ignored < 1.0:
        _check_grads(ours, ref._asdict(), x, w, b, 1e-5, (True, True, True))
    else:
        assert all(not g.any() for g in (ours.dx, ours.dw, ours.db))


def test_no_gemm_ahead_with_two_chunks(monkeypatch):
    """With two chunks the GEMM ahead is off (config.OVERLAP_MIN_CHUNKS: its second buffer
    would take back the memory the second chunk saved): one E buffer serves both chunks, in
    order, and dX, dW, db match fp64."""
    import fused_ce
    from fused_ce.kernels import logits_tiles
    from tests.oracle import cross_entropy64
    monkeypatch.setattr(config, "LOGITS_EPILOGUE", True)
    monkeypatch.setattr(config, "ROW_CHUNKS_ON_CPU", True)
    monkeypatch.setattr(config, "ROW_CHUNK_BYTES", 7 * 128 * 4)
    monkeypatch.setattr(config, "ROW_CHUNKS_FEW", 1000)
    monkeypatch.setattr(config, "ROW_CHUNK_SPLIT_MIN_ROWS", 1)  # (test-sized chunks)
    monkeypatch.setitem(config.INTERPRETER, "logits_tiles",
                        {**config.INTERPRETER["logits_tiles"], "overlap": True})
    events = []
    real = logits_tiles.TileStats.logits
    monkeypatch.setattr(logits_tiles.TileStats, "logits",
                        lambda self, p, xc, e, c0, *a, **k: events.append((c0, self))
                        or real(self, p, xc, e, c0, *a, **k))
    g = _gen()
    x, w, b, t, _ = _inputs(30, 52, 101, torch.float32, ignored=0.0, out_of_shard=False, g=g)
    t[torch.randperm(30, generator=g)[:6]] = IGNORE  # 24 valid rows: 2 chunks of 12
    ps = [p.clone().requires_grad_() for p in (x, w, b)]
    fused_ce.linear_cross_entropy(ps[0], ps[1], t, linear_bias=ps[2]).backward()
    assert [c0 for c0, _ in events] == [0, 12] and events[0][1] is events[1][1]
    ref = [p.double().requires_grad_() for p in (x, w, b)]
    cross_entropy64(ref[0], ref[1], t, bias=ref[2]).backward()
    for p, r in zip(ps, ref):
        assert _rel(p.grad, r.grad) <= TOL[torch.float32]["grads"]


@pytest.mark.parametrize("arrived", [False, True])
def test_logits_tiles_gemm_ahead(arrived, monkeypatch):
    """With the tile configuration's "overlap" (row_chunks._GemmAhead), chunk i + 1's logits
    GEMM is launched (on a second stream on a GPU) before chunk i's statistics and D, into the
    other of two buffers, which alternate: the results are bitwise those without it (the same
    kernels on the same rows; dW still accumulated in chunk order) and match fp64; with and
    without the first chunk launched before the count read."""
    from fused_ce.kernels import logits_tiles
    monkeypatch.setattr(kernels.CountRead, "arrived", lambda self: arrived)
    monkeypatch.setattr(config, "LOGITS_EPILOGUE", True)
    monkeypatch.setattr(config, "ROW_CHUNKS_ON_CPU", True)
    monkeypatch.setattr(config, "ROW_CHUNK_BYTES", 7 * 128 * 4)
    monkeypatch.setattr(config, "ROW_CHUNKS_FEW", 1000)
    events = []
    real_logits, real_finish = logits_tiles.TileStats.logits, logits_tiles.TileStats.finish
    monkeypatch.setattr(logits_tiles.TileStats, "logits",
                        lambda self, p, xc, e, c0, *a, **k: events.append(("logits", c0, self))
                        or real_logits(self, p, xc, e, c0, *a, **k))
    monkeypatch.setattr(logits_tiles.TileStats, "finish",
                        lambda self, p, xc, e, c0, *a, **k: events.append(("finish", c0, self))
                        or real_finish(self, p, xc, e, c0, *a, **k))
    g = _gen()
    n, h, v = 45, 52, 101
    x, w, b, t, cw = _inputs(n, h, v, torch.float32, ignored=0.0, g=g)
    # exactly 9 ignored rows, at random places: 36 valid rows of 624 workspace bytes exceed
    # the budget (half the fp32 dW, 10504 bytes), so they go in 3 chunks of 12 rows (a random
    # count of ignored rows left fewer chunks sometimes; with 2 there is no GEMM ahead:
    # test_no_gemm_ahead_with_two_chunks)
    t[torch.randperm(n, generator=g)[:9]] = IGNORE
    co = GradCoefs(*(c / n for c in _coefs(n, g)))
    kw = dict(with_weighted_sum=True, coefs=co, need_dx=True, need_dw=True, need_db=True)
    results = {}
    for overlap in (False, True):
        monkeypatch.setitem(config.INTERPRETER, "logits_tiles",
                            {**config.INTERPRETER["logits_tiles"], "overlap": overlap})
        events.clear()
        results[overlap] = kernels.forward(x, w, b, t, IGNORE, None, cw, **kw)
    ours = results[True]
    starts = sorted({c0 for kind, c0, _ in events})
    assert len(starts) >= 3, "several chunks expected"
    for i, c0 in enumerate(starts):
        logits = [j for j, (kind, at, _) in enumerate(events) if kind == "logits" and at == c0]
        finish = [j for j, (kind, at, _) in enumerate(events) if kind == "finish" and at == c0]
        assert len(logits) == len(finish) == 1
        if i + 1 < len(starts):  # the next chunk's GEMM comes before this chunk's finish
            nxt = [j for j, (kind, at, _) in enumerate(events)
                   if kind == "logits" and at == starts[i + 1]]
            assert nxt[0] < finish[0]
        assert events[logits[0]][2] is events[finish[0]][2]  # the same buffer
    owners = [ts for kind, _, ts in events if kind == "finish"]
    assert len({id(o) for o in owners}) == 2
    assert all(a is not b for a, b in zip(owners, owners[1:]))  # alternating
    for name, got in ours._asdict().items():
        if got is not None:
            assert torch.equal(got, getattr(results[False], name)), name
    ref = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, None, _d(cw),
                            **{**kw, "coefs": GradCoefs(*map(_d, co))})
    _check_stats(ours, ref, t, 1e-5, (x, w, b, t, cw), None)
    _check_grads(ours, ref._asdict(), x, w, b, 1e-5, (True, True, True))


def test_logits_tiles_first_chunk_dropped_below_min_rows(monkeypatch):
    """By default the path is chosen by the valid count: when the first chunk's logits were
    launched (all N rows would take the epilogue path) but fewer than min_rows turn out valid,
    that work is dropped and cuBLAS-style fp32 logits (finish_rows_kernel) serve the call. The
    kernel has computed nothing for it (it reads the count): its E and tile statistics keep
    what they held."""
    from fused_ce.kernels import logits_tiles
    cfg = {**config.INTERPRETER["logits_tiles"], "use": True, "min_rows": 20}
    monkeypatch.setitem(config.INTERPRETER, "logits_tiles", cfg)
    monkeypatch.setattr(config, "ROW_CHUNKS_ON_CPU", True)
    monkeypatch.setattr(kernels.CountRead, "arrived", lambda self: False)  # as on a GPU
    used = {"tiles": 0, "rows": 0}
    real_logits, real_rows = logits_tiles.TileStats.logits, row_chunks.finish_rows_kernel
    monkeypatch.setattr(logits_tiles.TileStats, "logits",
                        lambda self, *a, **k: used.update(tiles=used["tiles"] + 1)
                        or real_logits(self, *a, **k))
    workspaces = []
    real_workspace = row_chunks._tile_workspace

    def marked_workspace(*a):
        d, ts, db_parts = real_workspace(*a)
        for buf in (d, ts.m, ts.s):
            buf.fill_(7.0)
        workspaces.append((d, ts))
        return d, ts, db_parts
    monkeypatch.setattr(row_chunks, "_tile_workspace", marked_workspace)

    class Rows:
        def __getitem__(self, grid):
            used["rows"] += 1
            return real_rows[grid]
    monkeypatch.setattr(row_chunks, "finish_rows_kernel", Rows())
    g = _gen()
    n, h, v = 40, 48, 71
    x, w, b, t, cw = _inputs(n, h, v, torch.float32, ignored=0.0, out_of_shard=False, g=g)
    t[15:] = IGNORE  # 15 valid rows < min_rows
    co = GradCoefs(*(c / n for c in _coefs(n, g)))
    kw = dict(with_weighted_sum=True, coefs=co, need_dx=True, need_dw=True, need_db=True)
    ours = kernels.forward(x, w, b, t, IGNORE, None, cw, **kw)
    ref = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, None, _d(cw),
                            **{**kw, "coefs": GradCoefs(*map(_d, co))})
    assert used == {"tiles": 1, "rows": 1}
    (d, ts), = workspaces
    assert all(bool((buf == 7.0).all()) for buf in (d, ts.m, ts.s))
    _check_stats(ours, ref, t, 1e-5, (x, w, b, t, cw), None)
    _check_grads(ours, ref._asdict(), x, w, b, 1e-5, (True, True, True))


def test_logits_tiles_chosen_by_valid_rows(monkeypatch):
    """By default (config.LOGITS_EPILOGUE None) the epilogue logits are used where the tile
    configuration says "use", from "min_rows" valid rows on; forced on or off otherwise; never
    with a softcap and label smoothing together (the weighted sums), a given lse or rows a
    descriptor cannot address; with a softcap alone, yes."""
    from fused_ce.kernels import logits_tiles
    from fused_ce.kernels.problem import Problem
    cfg = {**config.INTERPRETER["logits_tiles"], "use": True, "min_rows": 20}
    monkeypatch.setitem(config.INTERPRETER, "logits_tiles", cfg)
    x, w, b, t, _ = _inputs(30, 48, 67, torch.float32, out_of_shard=False)
    p = Problem(x, w, b, t, IGNORE, None, None)
    for ws in (False, True):
        assert logits_tiles.applicable(p, None, 20, ws)
        assert not logits_tiles.applicable(p, None, 19, ws)
        assert not logits_tiles.applicable(p, torch.zeros(30), 30, ws)  # a given lse
    capped = Problem(x, w, b, t, IGNORE, 3.0, None)
    assert logits_tiles.applicable(capped, None, 30, False)
    assert not logits_tiles.applicable(capped, None, 30, True)
    assert not logits_tiles.applicable(Problem(x[:, :47], w[:, :47], b, t, IGNORE, None, None),
                                       None, 30, False)  # 47 fp32 columns: rows not aligned
    w_off = torch.empty(w.numel() + 1)[1:].view(w.shape).copy_(w)  # base off 16 bytes
    assert not logits_tiles.applicable(Problem(x, w_off, b, t, IGNORE, None, None), None, 30,
                                       False)
    monkeypatch.setattr(config, "LOGITS_EPILOGUE", True)
    assert logits_tiles.applicable(p, None, 1, True)
    monkeypatch.setattr(config, "LOGITS_EPILOGUE", False)
    assert not logits_tiles.applicable(p, None, 30, False)


def test_row_chunk_sizes():
    """row_chunks.chunking at the issue's shapes (fp32 rows of V padded to 64): 256 MiB of Z
    at BERT's head up to 8k tokens (4 chunks of 2048), then a quarter of the valid rows (16k
    tokens: 4 of 4096, ROW_CHUNKS_FEW); the large vocabularies within the 1 GiB cap; one chunk
    when all rows fit in twice the budget and two chunks would hold fewer than
    ROW_CHUNK_SPLIT_MIN_ROWS rows each (MLM's 15 %), else two (the epilogue path's bf16 rows
    at 8k tokens); log-softmax (no dW) keeps 256 MiB."""
    from fused_ce.kernels.row_chunks import chunking
    bert = 30592 * 4
    tiles = 30592 * 2 + 240 * 16  # bf16 E and the tile statistics
    assert chunking(8192, tiles, 30258 * 1024 * 4) == (2, 4096)
    assert chunking(4095, tiles * 2, 30258 * 1024 * 4) == (1, 4095)
    assert chunking(2458, tiles, 30522 * 1024 * 4) == (1, 2458)
    assert chunking(8192, bert, 30258 * 1024 * 4) == (4, 2048)
    assert chunking(16384, bert, 30522 * 1024 * 4) == (4, 4096)
    assert chunking(12000, bert, 30522 * 1024 * 4) == (4, 3072)
    assert chunking(2458, bert, 30522 * 1024 * 4) == (1, 2458)
    assert chunking(16384, bert, 0) == (8, 2048)
    assert chunking(16384, 128256 * 4, 128256 * 4096 * 4) == (8, 2048)
    assert chunking(8192, 256000 * 4, 256000 * 2304 * 4) == (8, 1024)
    for rows in (1, 127, 128, 1000, 2**20):
        n, c = chunking(rows, bert, 30522 * 1024 * 4)
        assert n * c >= rows and (n == 1 or c * bert <= config.ROW_CHUNK_BYTES_MAX)


def test_row_chunk_sizes_up_to_rounded_grads():
    """Where the backward's 16-bit gradients (dW and dX, rounded from the fp32 ones while those
    are held: the peak) exceed ROW_CHUNK_BYTES_MAX, a chunk may take as much: the epilogue
    path's rows (bf16 E of V padded to 64, 16 bytes per 128-column tile) at Llama-3's and
    Gemma-2's heads in 4 chunks, not 5; BERT's head and a small gradient keep the 1 GiB cap."""
    from fused_ce.kernels.row_chunks import chunking, padded_vocab

    def tiles_row(v):
        return padded_vocab(v) * 2 + triton.cdiv(v, 128) * 16

    def grads16(n, h, v):
        return 2 * h * (n + v)

    for n, h, v, without, with_grads in ((16384, 4096, 128256, (5, 3328), (4, 4096)),
                                         (8192, 2304, 256000, (5, 1664), (4, 2048))):
        assert chunking(n, tiles_row(v), v * h * 4) == without
        assert chunking(n, tiles_row(v), v * h * 4, grads16(n, h, v)) == with_grads
        n_chunks, c = chunking(n, tiles_row(v), v * h * 4, grads16(n, h, v))
        assert c * tiles_row(v) <= grads16(n, h, v)
    bert = tiles_row(30522)
    assert chunking(16384, bert, 30522 * 1024 * 4, grads16(16384, 1024, 30522)) == (4, 4096)
    for rows in (2**16, 2**20):  # Z at most the 1 GiB cap when the gradients are smaller
        n_chunks, c = chunking(rows, bert, 30522 * 1024 * 4, 2**29)
        assert c * bert <= config.ROW_CHUNK_BYTES_MAX


def test_row_chunk_log_softmax_logic(monkeypatch):
    """log_softmax_chunks.log_softmax with a CPU stand-in for the fp32-output GEMM, several
    chunks."""
    from fused_ce.kernels import log_softmax_chunks

    real_mm = torch.mm

    def mm(a, b, out_dtype=None, out=None):
        r = real_mm(a.float(), b.float()).to(out_dtype or a.dtype)
        return r if out is None else out.copy_(r)

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(config, "ROW_CHUNK_BYTES", 16 * 72 * 4)  # chunks of 16 rows
    g = _gen()
    x, w, b, _, _ = _inputs(41, 48, 71, torch.float16, g=g)
    ours = log_softmax_chunks.log_softmax(x, w, b)
    ref = torch.log_softmax(x.double() @ w.double().t() + b.double(), -1)
    assert ours.dtype == x.dtype and not ours.isnan().any()
    assert _rel(ours, ref) <= 1e-3


@pytest.mark.parametrize("n,h,v,budget,split", [(1, 52, 37, 2**20, 2), (45, 48, 101, 16 * 128 * 4, 2),
                                                (90, 56, 71, 32 * 128 * 4, 1)])
def test_log_softmax_tiles(n, h, v, budget, split, monkeypatch):
    """log_softmax by the epilogue GEMM (logits_tiles_kernel with LOG_PROBS, then
    log_probs_tiles_kernel; fp32 U here): N = 1, H not a multiple of the K tile, V prime, one
    chunk or several (16 or 32 rows), the epilogue on whole tiles or column halves, a large
    bias, and a row whose logits are its bias alone (x = 0)."""
    from fused_ce.kernels import log_softmax_chunks

    _epilogue_split(monkeypatch, split)
    monkeypatch.setattr(config, "LOG_PROBS_EPILOGUE", True)
    monkeypatch.setattr(config, "ROW_CHUNK_BYTES", budget)
    used = _recorded(monkeypatch, log_softmax_chunks, "_log_softmax_tiles")
    g = _gen()
    x, w, b, _, _ = _inputs(n, h, v, torch.float32, g=g)
    b = b * 30.0
    x[-1] = 0.0  # every logit of the last row is its bias
    ours = log_softmax_chunks.log_softmax(x, w, b)
    ref = torch.log_softmax(x.double() @ w.double().t() + b.double(), -1)
    assert used, "the epilogue path did not run"
    assert ours.dtype == x.dtype and ours.shape == (n, v)
    assert _rel(ours, ref) <= 1e-5
    assert ((ours.double() - ref).abs() <= 1e-5 * (1 + ref.abs())).all()


def test_log_softmax_tiles_chosen(monkeypatch):
    """By default the epilogue log-softmax is for bf16 CUDA inputs only; forced on, never for
    rows a descriptor cannot address (47 fp32 columns) or mixed dtypes."""
    from fused_ce.kernels import log_softmax_chunks
    x, w, _, _, _ = _inputs(5, 48, 67, torch.float32)
    assert not log_softmax_chunks.log_probs_by_tiles(x, w)
    monkeypatch.setattr(config, "LOG_PROBS_EPILOGUE", True)
    assert log_softmax_chunks.log_probs_by_tiles(x, w)
    assert not log_softmax_chunks.log_probs_by_tiles(x[:, :47].contiguous(), w[:, :47].contiguous())
    assert not log_softmax_chunks.log_probs_by_tiles(x, w.double())


def _scan_expected(t, v):
    valid = t != IGNORE
    row_idx = torch.argsort((~valid).to(torch.int8), stable=True)  # valid first, in order
    bad = valid & ((t < 0) | (t >= v))
    return row_idx, [int(valid.sum()), int(bad.sum())]


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 40, 41, 100, 333])
@pytest.mark.parametrize("ignored", [0.0, 0.4, 1.0])
def test_scan_targets(n, ignored):
    """targets.scan_targets: the stable partition (valid rows first, each part in order) and
    the two counts, against torch's stable argsort, across block boundaries (interpreter
    configuration: up to 40 rows one program in steps of 8; beyond, blocks of 16 rows whose
    counts are summed 2 at a time)."""
    from fused_ce.kernels.targets import scan_targets
    g = _gen()
    v = 37
    t = torch.randint(-3, v + 3, (n,), generator=g)  # some out of range both ways
    t[torch.rand(n, generator=g) < ignored] = IGNORE
    row_idx, counts = scan_targets(t, IGNORE, v, config.current()["scan"])
    exp_idx, exp_counts = _scan_expected(t, v)
    assert torch.equal(row_idx, exp_idx)
    assert counts.dtype == torch.int32 and counts.tolist() == exp_counts


@pytest.mark.parametrize("row_chunks", [True, False])
def test_prepared_targets_same_results(row_chunks, monkeypatch):
    """linear_cross_entropy with prepare_targets' scan (made before the call) gives bitwise the
    results of the call without it, on the row-chunk path and the sweep; an out-of-range target
    still raises, from the prepared read."""
    import fused_ce
    from tests.oracle import assert_prepared_targets_change_nothing
    monkeypatch.setattr(config, "ROW_CHUNKS_ON_CPU", row_chunks)
    g = _gen()
    x, w, b, t, _ = _inputs(37, 70, 89, torch.float32, out_of_shard=False, g=g)
    assert_prepared_targets_change_nothing(x, w, b, t)
    t[5] = 89
    with pytest.raises(ValueError, match="target: expected class indices in \\[0, 89\\)"):
        fused_ce.linear_cross_entropy(x, w, t, linear_bias=b,
                                      prepared_targets=fused_ce.prepare_targets(t, 89))


@pytest.mark.parametrize("sizes", [(17,), (0, 16, 1), (100, 15, 33), (0,)])
def test_scaled_grads_round_once(sizes):
    """kernels.scaled_grads: every element times the fp32 scalar, rounded once into its dtype
    (bitwise), for up to three tensors in one launch: fp32 sources into fp16 and fp32 (in
    place) destinations; sizes around the 16-element block of the interpreter config. (bf16 on
    the GPU only: the interpreter truncates fp32 -> bf16 conversions instead of rounding them
    to nearest.)"""
    g = _gen()
    dtypes = [torch.float16, torch.float32, torch.float16]
    src = [torch.randn(n, generator=g) * 100 for n in sizes]
    src[-1] = src[-1].to(dtypes[len(sizes) - 1])  # a 16-bit gradient scaled in place too
    k = torch.rand((), generator=g) + 0.1  # fp32, not a power of two
    want = [(s.float() * k).to(dt) for s, dt in zip(src, dtypes)]
    same = [s.dtype == dt for s, dt in zip(src, dtypes)]
    got = kernels.scaled_grads(src, dtypes[:len(sizes)], k)
    for out, s, exp, inplace in zip(got, src, want, same):
        assert out.dtype == exp.dtype and torch.equal(out, exp)
        assert (out is s) == inplace


@pytest.mark.parametrize("n", [1, 16, 33])
def test_scale_into_given_destinations(n):
    """scale.scale_into with ``outs`` (the sweeps' rounding of fp32 gradient chunks into dW's
    and dX's rows): bitwise the fp32 product rounded once, into a given fp16 destination and
    into the fp32 source itself; sizes around the interpreter's 16-element block. (bf16 on the
    GPU: test_gpu.py)"""
    from fused_ce.kernels.scale import scale_into
    g = _gen()
    src = torch.randn(n, 3, generator=g) * 100
    k = torch.rand((), generator=g) + 0.1
    out = torch.full((n, 3), float("nan"), dtype=torch.float16)
    assert scale_into([src], [torch.float16], k, outs=[out])[0] is out
    assert torch.equal(out, (src * k).half())
    want = src * k
    assert scale_into([src], [torch.float32], k, outs=[src])[0] is src
    assert torch.equal(src, want)


@pytest.mark.parametrize("n,n_valid,h", [(9, 4, 70), (1, 0, 3), (5, 5, 16), (13, 1, 33)])
@pytest.mark.parametrize("k", [0.37, float("inf")])
def test_scaled_grads_scatter_compact_dx(n, n_valid, h, k):
    """kernels.scaled_grads with ``dx_rows`` (a dx of the valid rows only): row j of the
    compact fp32 dx lands, times the scalar and rounded once, on x's row dx_rows[j], every other
    row is 0 * g (nan for an infinite g, as a zeroed row scaled), bitwise as
    reference.scaled_grads (which scatters, then scales); dW beside it scaled as before. Row
    counts and widths around the interpreter's 16-element blocks."""
    g = _gen()
    rows = torch.randperm(n, generator=g)
    dx = torch.randn(n_valid, h, generator=g) * 100
    dw = torch.randn(11, h, generator=g)
    scalar = torch.tensor(k)
    got = kernels.scaled_grads([dx, dw], [torch.float16, torch.float16], scalar, rows)
    want = reference.scaled_grads([dx, dw], [torch.float16, torch.float16], scalar, rows)
    full = torch.zeros(n, h)
    full[rows[:n_valid]] = dx
    torch.testing.assert_close(want[0], (full * scalar).half(), rtol=0, atol=0, equal_nan=True)
    for out, exp in zip(got, want):
        assert out.dtype == exp.dtype
        torch.testing.assert_close(out, exp, rtol=0, atol=0, equal_nan=True)


def test_eager_route_dx_of_valid_rows_only(monkeypatch):
    """On the row-chunk path the eager route's forward keeps dX for the valid rows only
    (RowStats.dx_rows; no N x H fp32 buffer) and its backward scatters it: the gradients are
    bitwise those of the custom-op route (torch.compile's), whose dX has every row, and match
    the fp64 oracle. Several chunks, a quarter of the rows ignored, a non-unit upstream
    gradient."""
    from tests.oracle import cross_entropy64, eager_and_custom_op_grads
    monkeypatch.setattr(config, "ROW_CHUNKS_ON_CPU", True)
    monkeypatch.setattr(config, "ROW_CHUNK_BYTES", 7 * 128 * 4)
    monkeypatch.setattr(config, "ROW_CHUNKS_FEW", 1000)
    g = _gen()
    x, w, b, t, _ = _inputs(37, 70, 89, torch.float16, out_of_shard=False, g=g)
    seen = []
    real = kernels.forward
    monkeypatch.setattr(kernels, "forward", lambda *a, **kw: seen.append(real(*a, **kw))
                        or seen[-1])
    eager, custom = eager_and_custom_op_grads(monkeypatch, x, w, b, t, 0.37)
    n_valid = int((t != IGNORE).sum())
    assert seen[0].dx.shape == (n_valid, 70) and torch.equal(seen[0].dx_rows[:n_valid],
                                                            (t != IGNORE).nonzero()[:, 0])
    assert seen[1].dx.shape == (37, 70) and seen[1].dx_rows is None
    ref = [p.double().requires_grad_() for p in (x, w, b)]
    (cross_entropy64(ref[0], ref[1], t, bias=ref[2]) * 0.37).backward()
    for e, c, r in zip(eager, custom, ref):
        assert torch.equal(e, c)
        assert _rel(e, r.grad) <= TOL[torch.float16]["grads"]


@pytest.mark.parametrize("n", [1, 7, 8, 61])
@pytest.mark.parametrize("mean", [False, True])
def test_total_loss_is_the_sum_or_its_mean(n, mean):
    """kernels.total_loss (one program, 8-row steps in the interpreter config): the row losses'
    sum against fp64 (row counts around the step), its 'mean' divided by the divisor exactly as
    reference.mean_from_sum divides it (bitwise); nan where the denominator is 0 and where a
    row is nan; the reference's fallback for fp64 rows."""
    g = _gen()
    rows = torch.randn(n, generator=g) * 1e3 + 5e3
    d = torch.tensor(float(torch.randint(1, 9, (), generator=g)))
    args = (d, d.clamp_min(1)) if mean else ()
    got = kernels.total_loss(rows, *args)
    total = rows.double().sum()
    want64 = total / d.double() if mean else total
    assert got.dtype == torch.float32 and got.shape == ()
    assert abs(float(got) - float(want64)) <= 1e-6 * abs(float(want64))
    if mean:
        # the division itself as torch does it (correctly rounded): from the kernel's own sum
        own_sum = kernels.total_loss(rows)
        assert torch.equal(got, reference.mean_from_sum(own_sum, *args))
        zero = torch.tensor(0.0)
        assert torch.isnan(kernels.total_loss(torch.zeros(n), zero, zero.clamp_min(1)))
    args64 = [a.double() for a in args]
    assert torch.equal(kernels.total_loss(rows.double(), *args64),
                       reference.total_loss(rows.double(), *args64))
    rows[n // 2] = float("nan")
    assert torch.isnan(kernels.total_loss(rows, *args))


def test_api_gradients_rounded_once(grad_path, monkeypatch):
    """A non-unit upstream gradient: the API's gradients are the forward's (fp32, unrounded,
    on every path) times it, rounded once (ops.linear_ce_sum)."""
    from tests.oracle import assert_grads_rounded_once
    g = _gen()
    x, w, b, t, _ = _inputs(37, 70, 89, torch.float16, out_of_shard=False, g=g)
    k = float(torch.rand((), generator=g)) * 3 + 0.1
    dtypes = assert_grads_rounded_once(kernels, monkeypatch, x, w, b, t, k)
    assert dtypes == [torch.float32] * 3


def test_api_backward_scales_by_upstream_gradient(grad_path):
    """The public loss times a non-unit, non-power-of-two factor: its gradients (scaled in the
    backward by scaled_grads) against the fp64 oracle of the scaled loss."""
    import fused_ce
    from tests.oracle import cross_entropy64
    g = _gen()
    x, w, b, t, _ = _inputs(37, 70, 89, torch.float16, out_of_shard=False, g=g)
    k = float(torch.rand((), generator=g)) * 3 + 0.1
    xs = [p.clone().requires_grad_() for p in (x, w, b)]
    (fused_ce.linear_cross_entropy(xs[0], xs[1], t, linear_bias=xs[2]) * k).backward()
    ref = [p.double().requires_grad_() for p in (x, w, b)]
    (cross_entropy64(ref[0], ref[1], t, bias=ref[2]) * k).backward()
    for ours, exp in zip(xs, ref):
        assert ours.grad.dtype == ours.dtype
        assert _rel(ours.grad, exp.grad) <= TOL[torch.float16]["grads"]


def test_cublas_check_not_made_without_host_read(monkeypatch):
    """While a CUDA graph is captured (``probe=False``) the cuBLAS fp32-output check, which
    waits for its result on the host, is not made: an unchecked device reads as without it
    (the loss then takes the vocabulary sweeps), a checked one as checked."""
    monkeypatch.setattr(row_chunks, "_PROBE", {})
    assert not row_chunks.cublas_fp32_out_available(torch.device("cuda:3"), probe=False)
    assert row_chunks._PROBE == {}  # (nothing was run on the device)
    monkeypatch.setattr(row_chunks, "_PROBE", {"cuda:3": True})
    assert row_chunks.cublas_fp32_out_available(torch.device("cuda:3"), probe=False)


@pytest.mark.parametrize("dtype,tiles,ignored,bias,softcap,class_weight,budget", [
    (torch.float32, False, 0.4, True, 3.0, True, 7 * 128 * 4),
    (torch.float32, True, 0.4, True, None, True, 7 * 128 * 4),
    (torch.float32, True, 0.4, False, None, False, 7 * 128 * 4),
    (torch.float32, True, 0.4, True, None, False, 2**20),
    (torch.float32, True, 0.0, True, None, False, 7 * 128 * 4),
    (torch.float32, False, 1.0, True, None, False, 7 * 128 * 4),
    (torch.float32, True, 1.0, False, None, False, 7 * 128 * 4),
    (torch.float16, False, 0.4, True, None, True, 7 * 128 * 4)])
def test_row_chunks_without_host_read(dtype, tiles, ignored, bias, softcap, class_weight, budget,
                                      monkeypatch):
    """Where nothing may wait on the host (CUDA-graph capture; here kernels._cannot_sync
    patched) the row-chunk path reads no count: its chunks span all N compacted positions, and
    the kernels give the rows past the device's valid count zero rows of D (E of those rows is
    never computed: NaN from the poisoned allocations), so the products over whole chunks add
    nothing for them. The logits by cuBLAS-style fp32 Z (finish_rows_kernel) or by the epilogue
    GEMM (D by finish_tiles_kernel, or by d_tiles_kernel with a bias), several chunks or one,
    rows ignored in between, none, or all; fp16 (fp32 Z: D holds dz times a power of two,
    which the products keep until it is divided out on the device, their alpha being a host
    number). Statistics and gradients as the fp64 oracle's, for the forward (dX of every row,
    or in the compacted order as the eager route keeps it) and for the backward from a given
    lse (reduction='none')."""
    monkeypatch.setattr(config, "ROW_CHUNKS_ON_CPU", True)
    monkeypatch.setattr(config, "LOGITS_EPILOGUE", tiles)
    monkeypatch.setattr(config, "ROW_CHUNK_BYTES", budget)
    monkeypatch.setattr(config, "ROW_CHUNKS_FEW", 1000)
    monkeypatch.setattr(kernels, "_cannot_sync", lambda: True)
    monkeypatch.setattr(kernels, "CountRead", None)  # a host read would fail here
    spans = []
    real = row_chunks._sweep_chunks
    monkeypatch.setattr(row_chunks, "_sweep_chunks",
                        lambda p, cf, scale, d_scale, nv, all_valid, c, *a: spans.append(
                            (nv, all_valid, c)) or real(p, cf, scale, d_scale, nv, all_valid, c,
                                                        *a))
    used = _epilogue_path_used(monkeypatch)
    g = _gen()
    n, h, v = 45, 48, 101
    x, w, b, t, cw = _inputs(n, h, v, dtype, bias=bias, ignored=ignored,
                             out_of_shard=False, class_weight=class_weight, g=g)
    co = GradCoefs(*(c / n for c in _coefs(n, g)))  # (mean-sized: fp16's D scale is 2^k, k > 0)
    tol = TOL[dtype]["grads"]
    co64 = GradCoefs(*map(_d, co))
    need = (True, True, bias)
    kw = dict(with_weighted_sum=True, coefs=co, need_dx=True, need_dw=True, need_db=bias)
    ref = reference.forward(_d(x), _d(w), _d(b), t, IGNORE, softcap, _d(cw),
                            **{**kw, "coefs": co64})
    for compact in (False, True):
        ours = kernels.forward(x, w, b, t, IGNORE, softcap, cw, check_targets=True,
                               compact_dx=compact, round_grads=not compact, **kw)
        _check_stats(ours, ref, t, 1e-5, (x, w, b, t, cw), softcap)
        grads = [ours.dx, ours.dw, ours.db]
        if compact:  # the backward's scatter and rounding (upstream gradient 1)
            assert ours.dx.shape == (n, h) and torch.equal(ours.dx_rows, kernels.Problem(
                x, w, b, t, IGNORE, None, None).row_idx)
            grads[:2 + bias] = kernels.scaled_grads(grads[:2 + bias], [dtype] * (2 + bias),
                                                    torch.ones(1), ours.dx_rows)
        dx = grads[0]
        _check_grads(dict(zip(("dx", "dw", "db"), grads)), ref._asdict(), x, w, b, tol, need)
        assert (dx[t == IGNORE] == 0).all()
    lse = ref.lse.float() + 0.1 * torch.rand(n, generator=g)
    back = kernels.backward(x, w, b, t, IGNORE, softcap, cw, lse, co, need_dx=True,
                            need_dw=True, need_db=bias)
    ref_back = reference.backward(_d(x), _d(w), _d(b), t, IGNORE, softcap, _d(cw), lse.double(),
                                  co64, need_dx=True, need_dw=True, need_db=bias)
    _check_grads(dict(zip(("dx", "dw", "db"), back)), dict(zip(("dx", "dw", "db"), ref_back)),
                 x, w, b, tol, need)
    assert len(spans) == 3 and all(nv == n and not every for nv, every, _ in spans)
    assert spans[0][2] < n if budget < 2**20 else spans[0][2] == n  # several chunks, or one
    assert len(used) == (2 * triton.cdiv(n, spans[0][2]) if tiles else 0)


def _row_ref_path(monkeypatch, **tiles) -> tuple[list, list]:
    """The epilogue path on the CPU with row references wanted (and the tile configuration's
    ``tiles``): (the epilogue GEMM's runs, the row_ref.RowRefs made), as the case fills them."""
    from fused_ce.kernels import row_ref

    monkeypatch.setitem(config.INTERPRETER, "logits_tiles",
                        {**config.INTERPRETER["logits_tiles"], "row_ref": True, **tiles})
    used = _epilogue_path_used(monkeypatch)
    monkeypatch.setattr(config, "LOGITS_EPILOGUE", True)
    monkeypatch.setattr(config, "ROW_CHUNKS_ON_CPU", True)
    return used, _recorded_instances(monkeypatch, row_ref.RowRefs)


def _unsmoothed_coefs(n, g) -> GradCoefs:
    """Random coefficients of a loss without label smoothing (the row references' losses)."""
    co = GradCoefs(*(c / n for c in _coefs(n, g)))
    return co._replace(smooth=torch.zeros(n), prob=co.target)


def _forward_without_db(x, w, b, t, softcap, cw, co):
    """(kernels.forward, reference.forward in fp64) with dX and dW, not db."""
    kw = dict(with_weighted_sum=False, coefs=co, need_dx=True, need_dw=True, need_db=False)
    return (kernels.forward(x, w, b, t, IGNORE, softcap, cw, **kw),
            reference.forward(_d(x), _d(w), _d(b), t, IGNORE, softcap, _d(cw),
                              **{**kw, "coefs": GradCoefs(*map(_d, co))}))


@pytest.mark.parametrize("n,h,v", [(1, 52, 37), (45, 52, 101), (90, 48, 71)])
@pytest.mark.parametrize("bias,class_weight,budget,softcap,far", [
    (True, False, 2**20, None, False), (False, True, 7 * 128 * 4, None, False),
    (True, True, 2**20, 2.0, False), (True, True, 2**20, None, True),
    (False, True, 7 * 128 * 4, None, True)])
def test_row_ref_path(n, h, v, bias, class_weight, budget, softcap, far, monkeypatch):
    """The epilogue path with one reference logit per row (row_ref.py: E against the target
    logit, dX = s (E W) + D_t W_t, dW = E^T (s x) + the target terms) against fp64: losses
    without label smoothing and without db (a bias given, not differentiated), a softcap,
    class weights, a z-loss, ignored rows and out-of-shard targets, one chunk or several. With
    ``far``, every third row of x is 30 times larger (logits of scale 30: tiles whose max lies
    over 40 above the target logit take their own, and rows whose loss exceeds 40 nats the
    whole D row), a bias of +38 on one column (rows whose target logit is below about -2
    exceed the span) and the last row's coefficients are 0 (s_r = 0: the whole D row);
    out-of-shard targets take it too, the other rows keep the scale. Every other row's target
    is one class (a run of equal targets longer than dw_targets_kernel's row block). Which rows
    did is read from s with one chunk (1 for a whole D row)."""
    used, made = _row_ref_path(monkeypatch)
    monkeypatch.setattr(config, "ROW_CHUNK_BYTES", budget)
    monkeypatch.setattr(config, "ROW_CHUNKS_FEW", 1000)
    g = _gen()
    x, w, b, t, cw = _inputs(n, h, v, torch.float32, bias=bias, class_weight=class_weight,
                             ignored=0.25 if n > 1 else 0.0, g=g)
    t[3::2] = torch.where(t[3::2] == IGNORE, IGNORE, 5)  # (t[1], t[2]: out of shard)
    co = _unsmoothed_coefs(n, g)
    if far:
        x[::3] *= 30
        if b is None:
            b = torch.zeros(v)
        b[int(torch.randint(0, v, (1,), generator=g))] = 38.0
        co.target[-1] = co.prob[-1] = co.lse_sq[-1] = 0.0
    ours, ref = _forward_without_db(x, w, b, t, softcap, cw, co)
    assert used and len(made) == 1, "the row-reference path did not run"
    _check_stats(ours, ref, t, 1e-5, (x, w, b, t, cw), softcap)
    _check_grads(ours, ref._asdict(), x, w, b, 1e-5, (True, True, False))
    assert (ours.dx[t == IGNORE] == 0).all()
    if budget == 2**20 and n > 1:  # one chunk: s[k] is the k-th row not ignored
        tv = t[t != IGNORE]
        in_shard = (tv >= 0) & (tv < v)
        s = made[0].s[:len(tv)]
        assert (s[~in_shard] == 1).all()
        if far:
            assert (s[in_shard] == 1).any() and (s[in_shard] != 1).any()
        else:
            assert (s[in_shard] != 1).all()


@pytest.mark.parametrize("min_v,taken", [(71, True), (72, False)])
def test_row_ref_from_its_vocabulary_size(min_v, taken, monkeypatch):
    """Row references serve vocabularies of at least the configuration's row_ref_min_v
    (row_ref.applicable: below it the D pass is cheap and runs of equal targets long); below
    it the D pass runs, with the same gradients against fp64."""
    used, made = _row_ref_path(monkeypatch, row_ref_min_v=min_v)
    n, h, v = 30, 20, 71
    x, w, _, t, _ = _inputs(n, h, v, torch.float32, bias=False)
    ours, ref = _forward_without_db(x, w, None, t, None, None, _unsmoothed_coefs(n, _gen()))
    assert used and len(made) == int(taken)
    _check_grads(ours, ref._asdict(), x, w, None, 1e-5, (True, True, False))
