"""Every bad input raises before any work, naming the argument, what was expected and what came."""

import pytest
import torch

import fused_ce


def _ok():
    x = torch.randn(4, 6)
    W = torch.randn(9, 6)
    t = torch.randint(0, 9, (4,))
    return x, W, t


@pytest.mark.parametrize("bad_value", [9, 100, -1, -101])
def test_out_of_range_target(bad_value):
    x, W, t = _ok()
    t[2] = bad_value
    with pytest.raises(ValueError, match=rf"target: expected class indices in \[0, 9\).*got {bad_value} at flat position 2"):
        fused_ce.linear_cross_entropy(x, W, t)


def test_ignore_index_inside_range_is_accepted_and_other_negative_rejected():
    x, W, t = _ok()
    t[1] = 0
    fused_ce.linear_cross_entropy(x, W, t, ignore_index=0)
    t[1] = -100
    with pytest.raises(ValueError, match="ignore_index=0"):
        fused_ce.linear_cross_entropy(x, W, t, ignore_index=0)


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(target=torch.zeros(4)), TypeError, "target: expected an int64"),
    (dict(target=torch.zeros(4, dtype=torch.int16)), TypeError, "target: expected an int64.*int16"),
    (dict(target=torch.zeros(5, dtype=torch.long)), ValueError, r"target: expected shape \(4,\).*got \(5,\)"),
    (dict(input=torch.randn(4, 7)), ValueError, r"input: expected last dimension H=6.*\(4, 7\)"),
    (dict(linear_weight=torch.randn(9, 6, 1)), ValueError, r"linear_weight: expected shape \(V, H\)"),
    (dict(linear_bias=torch.randn(8)), ValueError, r"linear_bias: expected shape \(9,\), got \(8,\)"),
    (dict(weight=torch.rand(10)), ValueError, r"weight: expected class weights of shape \(9,\), got \(10,\)"),
    (dict(reduction="avg"), ValueError, r"reduction: expected one of .*got 'avg'"),
    (dict(label_smoothing=1.5), ValueError, r"label_smoothing: expected a float in \[0.0, 1.0\], got 1.5"),
    (dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
    (dict(softcap=0.0), ValueError, "softcap: expected None or a finite float > 0, got 0.0"),
    (dict(softcap=-3), ValueError, "softcap"),
    (dict(z_loss=-1e-4), ValueError, "z_loss: expected a finite float >= 0"),
    (dict(ignore_index=1.5), TypeError, "ignore_index: expected an int"),
    (dict(ignore_index=True), TypeError, "ignore_index: expected an int, got True"),
    (dict(label_smoothing=torch.tensor([0.1, 0.2])), ValueError, "label_smoothing: expected a float"),
    (dict(label_smoothing="0.1"), ValueError, "label_smoothing: expected a float.*got '0.1'"),
    (dict(input=torch.randn(4, 6, dtype=torch.float64)), TypeError, "input is torch.float64, linear_weight is torch.float32"),
    (dict(input=torch.randint(0, 3, (4, 6))), TypeError, "input: expected a floating-point tensor"),
    (dict(input=[[1.0]]), TypeError, "input: expected a torch.Tensor, got list"),
    (dict(input=torch.randn(4, 6, device="meta")), ValueError, "expected all tensors on one device.*input on meta"),
])
def test_bad_arguments(kwargs, exc, pattern):
    x, W, t = _ok()
    args = dict(input=x, linear_weight=W, target=t)
    args.update({k: v for k, v in kwargs.items() if k in args})
    opts = {k: v for k, v in kwargs.items() if k not in args}
    with pytest.raises(exc, match=pattern):
        fused_ce.linear_cross_entropy(args["input"], args["linear_weight"], args["target"], **opts)


def test_nn_linear_with_extra_bias_is_rejected():
    x, _, t = _ok()
    with pytest.raises(ValueError, match="linear_bias: expected None when linear_weight is an nn.Linear"):
        fused_ce.linear_cross_entropy(x, torch.nn.Linear(6, 9), t, linear_bias=torch.zeros(9))


def test_error_leaves_gradients_untouched():
    head = torch.nn.Linear(6, 9)
    x, _, t = _ok()
    fused_ce.linear_cross_entropy(x, head, t).backward()
    before = head.weight.grad.clone()
    t[0] = 50
    with pytest.raises(ValueError):
        fused_ce.linear_cross_entropy(x, head, t).backward()
    assert torch.equal(head.weight.grad, before)


def test_module_options_are_checked_at_construction():
    with pytest.raises(ValueError, match="reduction"):
        fused_ce.FusedCrossEntropy(reduction="batchmean")
    with pytest.raises(ValueError, match="label_smoothing"):
        fused_ce.FusedCrossEntropy(label_smoothing=2.0)
    with pytest.raises(ValueError, match="out_features: expected a positive int, got 0"):
        fused_ce.FusedLinearLogSoftmax(4, 0)


def test_log_softmax_bad_input():
    with pytest.raises(ValueError, match="input: expected last dimension H=6"):
        fused_ce.linear_log_softmax(torch.randn(3, 5), torch.randn(9, 6))
    with pytest.raises(TypeError, match="input is torch.float16"):
        fused_ce.linear_log_softmax(torch.randn(3, 6).half(), torch.randn(9, 6))


def test_prepared_targets_must_be_this_calls():
    """prepare_targets: bad arguments, another target's preparation, a target changed in place
    since, or other options are refused, naming the argument."""
    x, W, t = _ok()
    with pytest.raises(ValueError, match="vocab: expected an int >= 1"):
        fused_ce.prepare_targets(t, 0)
    with pytest.raises(TypeError, match="ignore_index: expected an int"):
        fused_ce.prepare_targets(t, 9, ignore_index=None)
    with pytest.raises(TypeError, match="prepared_targets: expected None or"):
        fused_ce.linear_cross_entropy(x, W, t, prepared_targets=t)
    prepared = fused_ce.prepare_targets(t, 9)
    ok = fused_ce.linear_cross_entropy(x, W, t, prepared_targets=prepared)
    assert torch.equal(ok, fused_ce.linear_cross_entropy(x, W, t))
    for target, opts in [(t.clone(), {}), (t, {"ignore_index": 3})]:
        with pytest.raises(ValueError, match="prepared_targets: expected fused_ce.prepare_targets"):
            fused_ce.linear_cross_entropy(x, W, target, prepared_targets=prepared, **opts)
    t[0] = 1  # in place: the scan no longer describes it
    with pytest.raises(ValueError, match="prepared_targets: expected"):
        fused_ce.linear_cross_entropy(x, W, t, prepared_targets=prepared)


def test_options_take_what_f_cross_entropy_takes():
    """NumPy numbers and 0-d tensors as options (label_smoothing, ignore_index, z_loss,
    softcap), as F.cross_entropy takes them: the same loss as with Python numbers, also for
    the module, which stores them as Python numbers."""
    np = pytest.importorskip("numpy")
    x, W, t = _ok()
    t[1] = 3
    want = fused_ce.linear_cross_entropy(x, W, t, ignore_index=3, label_smoothing=0.25,
                                         z_loss=1e-3, softcap=2.0)
    for opts in (dict(ignore_index=np.int64(3), label_smoothing=np.float64(0.25),
                      z_loss=np.float64(1e-3), softcap=np.float32(2.0)),
                 dict(ignore_index=torch.tensor(3), label_smoothing=torch.tensor(0.25, dtype=torch.float64),
                      z_loss=torch.tensor(1e-3, dtype=torch.float64), softcap=torch.tensor(2.0))):
        assert torch.equal(fused_ce.linear_cross_entropy(x, W, t, **opts), want)
        module = fused_ce.FusedCrossEntropy(**opts)
        assert torch.equal(module(x, W, t), want)
        assert type(module.ignore_index) is int and type(module.label_smoothing) is float
