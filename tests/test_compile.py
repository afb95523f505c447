"""torch.compile(fullgraph=True) sees one custom op: no graph break, same numbers; opcheck."""

import pytest
import torch

import fused_ce
from fused_ce import ops
from tests.oracle import cross_entropy64, rel_err


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 41)

    def forward(self, x, t):
        h = torch.tanh(self.body(x))
        return fused_ce.linear_cross_entropy(h, self.head.weight, t, linear_bias=self.head.bias,
                                             label_smoothing=0.1, z_loss=1e-4)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(backend):
    torch.manual_seed(torch.seed() % 2**31)
    model = TinyLM()
    x = torch.randn(3, 7, 16)
    t = torch.randint(0, 41, (3, 7))
    t[0, 0] = -100
    eager = model(x, t)
    eager.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    loss = compiled(x, t)
    loss.backward()
    assert rel_err(loss, eager) < 1e-6
    for p, g in zip(model.parameters(), grads):
        assert rel_err(p.grad, g) < 1e-5


def _op_args(n=5, h=7, v=11, bias=True):
    x = torch.randn(n, h, requires_grad=True)
    w = torch.randn(v, h, requires_grad=True)
    b = torch.randn(v, requires_grad=True) if bias else None
    t = torch.randint(0, v, (n,))
    t[1] = -100
    coefs = [torch.rand(n) for _ in range(4)]
    return x, w, b, t, coefs


def test_opcheck_custom_ops():
    x, w, b, t, coefs = _op_args()
    torch.library.opcheck(ops.linear_ce_rows, (x, w, b, t, None, *coefs, -100, 5.0, True, False))
    torch.library.opcheck(ops.linear_ce_sum,
                          (x, w, b, t, None, *coefs, -100, None, False, True, True, True))
    # 'mean': the sum divided inside the op. (Its fp32 gradient outputs are consumed, scaled in
    # place, by its backward, and opcheck compares them after a backward of upstream gradient
    # 1: a divisor of 1 keeps them; test_eager_route_equals_custom_op checks other divisors.)
    d = torch.tensor(1.0)
    torch.library.opcheck(ops.linear_ce_sum,
                          (x, w, b, t, None, *coefs, -100, None, False, True, True, True, d, d))
    torch.library.opcheck(ops.linear_log_softmax, (x, w, b))


def test_compiled_log_softmax():
    x = torch.randn(4, 8)
    w = torch.randn(13, 8)
    f = torch.compile(lambda a, c: fused_ce.linear_log_softmax(a, c), fullgraph=True, backend="aot_eager")
    assert rel_err(f(x, w), (x.double() @ w.double().T).log_softmax(-1)) < 1e-6


@pytest.mark.parametrize("rows,mean", [(False, False), (False, True), (True, False)])
def test_eager_route_equals_custom_op(rows, mean):
    """Eager calls on plain tensors take the autograd.Function route (cheaper dispatch), traced
    ones the custom op; both run the same implementation and backward: identical numbers. With
    'mean''s denominator and divisor the sum op returns the sum divided by it, and its
    gradients are the sum's times the upstream gradient over the divisor."""
    results = []
    x0, w0, b0, t, coefs = _op_args(n=9, h=13, v=17)
    g_rows = torch.randn(9)
    divisor = torch.tensor(7.0)
    for route in ("eager", "custom_op"):
        x, w, b = (p.detach().clone().requires_grad_() for p in (x0, w0, b0))
        if rows:
            args = (x, w, b, t, None, *coefs, -100, 5.0, True, False)
            out = (ops.loss_rows if route == "eager" else ops.linear_ce_rows)(*args)
            (out[0] * g_rows).sum().backward()
        else:
            args = (x, w, b, t, None, *coefs, -100, None, False, True, True, True)
            args += (divisor, divisor) if mean else ()
            out = (ops.loss_sum if route == "eager" else ops.linear_ce_sum)(*args)
            (out[0] * 0.7).backward()
            if mean:  # against the sum without them, divided outside
                xs, ws, bs = (p.detach().clone().requires_grad_() for p in (x0, w0, b0))
                plain = ops.loss_sum(xs, ws, bs, *args[3:15])[0]
                (plain / divisor * 0.7).backward()
                assert rel_err(out[0], plain / divisor) < 1e-6
                for got, want in ((x.grad, xs.grad), (w.grad, ws.grad), (b.grad, bs.grad)):
                    assert rel_err(got, want) < 1e-6
        assert ("Linear" in type(out[0].grad_fn).__name__) == (route == "eager")
        results.append([out[0].detach(), out[1], x.grad, w.grad, b.grad])
    for a, c in zip(*results):
        assert torch.equal(a, c)


def test_eager_route_refuses_double_and_second_backward():
    x, w, b, t, coefs = _op_args()
    args = (x, w, b, t, None, *coefs, -100, None, False, True, True, True)
    loss = ops.loss_sum(*args)[0]
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, x, create_graph=True)
    loss = ops.loss_sum(*args)[0]
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


@pytest.mark.parametrize("kwargs", [{}, {"reduction": "none", "label_smoothing": 0.1},
                                    {"low_memory": True, "z_loss": 1e-4}])
def test_meta_tensors_give_shapes(kwargs):
    """On meta tensors (shape inference, memory planning, models built with device='meta') the
    loss, its statistics, its gradients and linear_log_softmax have torch's shapes and dtypes,
    as F.cross_entropy(F.linear(...)) has there; nothing reads a value."""
    x = torch.randn(2, 3, 17, device="meta", requires_grad=True)
    w = torch.randn(11, 17, device="meta", requires_grad=True)
    b = torch.randn(11, device="meta", requires_grad=True)
    t = torch.randint(0, 11, (2, 3), device="meta")
    loss = fused_ce.linear_cross_entropy(x, w, t, linear_bias=b, **kwargs)
    ref = torch.nn.functional.cross_entropy(
        torch.nn.functional.linear(x, w, b).transpose(1, 2), t,
        **{k: v for k, v in kwargs.items() if k in ("reduction", "label_smoothing")})
    assert (loss.shape, loss.dtype, loss.device.type) == (ref.shape, ref.dtype, "meta")
    loss.sum().backward()
    assert (x.grad.shape, w.grad.shape, b.grad.shape) == (x.shape, w.shape, b.shape)
    assert x.grad.is_meta and w.grad.is_meta and b.grad.is_meta
    stats = fused_ce.linear_cross_entropy(x, w, t, return_stats=True, **kwargs)
    assert stats.lse.shape == stats.predicted.shape == (2, 3) and stats.accuracy.shape == ()
    logp = fused_ce.linear_log_softmax(x, w, b)
    assert logp.shape == (2, 3, 11) and logp.is_meta


@pytest.mark.parametrize("kwargs", [{}, {"reduction": "none"},
                                    {"reduction": "sum", "label_smoothing": 0.1},
                                    {"low_memory": True}])
def test_vmap_matches_per_sample(kwargs):
    """torch.func.vmap of the loss (the custom ops' route: the eager route's autograd.Function
    cannot be vmapped) equals the loss of each sample, against fp64 torch."""
    torch.manual_seed(torch.seed() % 2**31)
    w = torch.randn(13, 8, dtype=torch.float64)
    x = torch.randn(4, 3, 8, dtype=torch.float64)
    t = torch.randint(0, 13, (4, 3))
    t[0, 1] = -100
    got = torch.func.vmap(lambda a, tt: fused_ce.linear_cross_entropy(a, w, tt, **kwargs))(x, t)
    ref_kwargs = {k: v for k, v in kwargs.items() if k != "low_memory"}
    ref = torch.stack([cross_entropy64(x[i], w, t[i], **ref_kwargs) for i in range(4)])
    assert rel_err(got, ref) < 1e-12
    logp = torch.func.vmap(lambda a: fused_ce.linear_log_softmax(a, w))(x)
    assert rel_err(logp, (x @ w.T).log_softmax(-1)) < 1e-12


@pytest.mark.parametrize("transform", ["grad", "jacrev", "jvp"])
def test_func_gradient_transforms_raise_clearly(transform):
    x = torch.randn(3, 8, dtype=torch.float64)
    w = torch.randn(13, 8, dtype=torch.float64)
    t = torch.tensor([1, 2, -100])
    loss = lambda a: fused_ce.linear_cross_entropy(a, w, t)  # noqa: E731
    call = {"grad": lambda: torch.func.grad(loss)(x),
            "jacrev": lambda: torch.func.jacrev(lambda a: fused_ce.linear_log_softmax(a, w))(x),
            "jvp": lambda: torch.func.jvp(loss, (x,), (x,))}[transform]
    with pytest.raises(NotImplementedError, match="torch.func's grad, vjp, jacrev and jvp"):
        call()
