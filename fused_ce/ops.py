"""The fused operation as ``torch.library`` custom ops, so ``torch.compile`` sees one op.

The loss of row ``i`` is written through per-row coefficients (computed by ``fused_ce.api`` from
the reduction, class weights, label smoothing and z-loss)::

    loss_i = prob_i * lse_i - target_i * z_{i,t_i} - smooth_i * sum_j w_j z_ij + lse_sq_i * lse_i**2

Both loss ops check that every target is ``ignore_index`` or a column of the weight (ValueError
otherwise, before any gradient exists): the backend does it at its one host synchronization.
Two ops, chosen by how the upstream gradient is shaped:

* ``fused_ce::linear_ce_sum`` -- ``sum_i loss_i``, or its 'mean' (``reference.mean_from_sum``)
  when given the mean's denominator and divisor (both by the backend's ``total_loss``). When
  gradients are needed they are computed in the forward pass for an upstream gradient of 1
  (three GEMMs, no second sweep), kept in their accumulation dtype (fp32 for 16-bit
  parameters), and in the backward multiplied by the actual scalar upstream gradient and
  rounded once into the parameters' dtypes: the same single rounding as a loss whose upstream
  gradient is known.
* ``fused_ce::linear_ce_rows`` -- ``loss_i`` per row (reduction 'none', and every reduction
  with ``low_memory``, whose gradient buffers are its parameters' dtypes: no fp32 copies held
  from the forward to the backward). The backward recomputes the logits with the saved lse and
  the coefficients scaled by the per-row upstream gradient, and rounds each gradient once.

``fused_ce::linear_log_softmax`` returns the log-probabilities themselves.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from fused_ce._dispatch import backend_for
from fused_ce.reference import GradCoefs, accumulation_dtype, chunk_rows, grad_dtypes

_DOUBLE_BACKWARD = ("fused_ce: double backward (create_graph=True) through the fused loss is not "
                    "supported; compute higher-order gradients from explicit logits instead")


def _row_loss(stats, coefs: GradCoefs, with_weighted_sum: bool) -> Tensor:
    """loss_i (module docstring). Without the weighted sums (no label smoothing: the API then
    passes smooth = 0 and prob = target) the first terms are target * (lse - z_t), taken from
    the backend's nll = lse - z_t when it gives one: no cancellation of lse against z_t. The
    backend's own row losses (the same formula, computed in its kernel) when it gives them."""
    if stats.row_loss is not None:
        return stats.row_loss
    lse = stats.lse
    if with_weighted_sum:
        loss = (coefs.prob * lse - coefs.target * stats.target_logit
                - coefs.smooth * stats.weighted_sum)
    elif stats.nll is not None:
        loss = coefs.target * stats.nll
    else:
        loss = coefs.prob * lse - coefs.target * stats.target_logit
    return loss + coefs.lse_sq * lse * lse


def _own(t: Tensor) -> Tensor:
    """t, or a copy when it is a view (an op's outputs must not share storage)."""
    return t if t._base is None else t.clone()


def _empty(like: Optional[Tensor], n: int = 0) -> Tensor:
    return like.new_empty(n) if like is not None else torch.empty(n)


# --------------------------------------------------------------------------- sum of row losses

def _linear_ce_sum(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                  class_weight: Optional[Tensor], coef_target: Tensor, coef_smooth: Tensor,
                  coef_prob: Tensor, coef_lse_sq: Tensor, ignore_index: int,
                  softcap: Optional[float], with_weighted_sum: bool, need_dx: bool, need_dw: bool,
                  need_db: bool, mean_d: Optional[Tensor] = None,
                  mean_divisor: Optional[Tensor] = None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(sum of row losses, or ``reference.mean_from_sum(sum, mean_d, mean_divisor)`` when those
    are given, lse, argmax, dx, dw, db); a gradient not asked for is empty, the others for an
    upstream gradient of 1 on the sum, unrounded, in the accumulation dtype (fp32 for 16-bit
    parameters)."""
    return _ce_sum(x, weight, bias, target, class_weight, coef_target, coef_smooth, coef_prob,
                   coef_lse_sq, ignore_index, softcap, with_weighted_sum, need_dx, need_dw,
                   need_db, mean_d, mean_divisor)


def _ce_sum(x, weight, bias, target, class_weight, coef_target, coef_smooth, coef_prob,
            coef_lse_sq, ignore_index, softcap, with_weighted_sum, need_dx, need_dw, need_db,
            mean_d=None, mean_divisor=None, scan=None, compact_dx=False):
    """_linear_ce_sum, plus for the eager route ``scan``: the backend's target scan made
    earlier (``api.prepare_targets``), used when this backend made it; ``compact_dx``: dx
    may hold the valid rows only, and a seventh output says which (RowStats.dx_rows; None
    where dx has every row)."""
    coefs = GradCoefs(coef_target, coef_smooth, coef_prob, coef_lse_sq)
    backend = backend_for(x)
    made = scan is not None and scan.scan is not None and scan.backend is backend
    extra = {"scan": scan.scan} if made else {}
    stats = backend.forward(
        x, weight, bias, target, ignore_index, softcap, class_weight,
        with_weighted_sum=with_weighted_sum, coefs=coefs, need_dx=need_dx, need_dw=need_dw,
        need_db=need_db and bias is not None, check_targets=True, round_grads=False,
        compact_dx=compact_dx, **extra)
    # 'mean' here, outside autograd, whose recorded ops and backward nodes cost ~0.1 ms of host
    # time per call (NOTES.md #73); the backward divides the upstream gradient
    loss = backend.total_loss(_row_loss(stats, coefs, with_weighted_sum), mean_d, mean_divisor)
    grads = [_empty(x) if g is None else g for g in (stats.dx, stats.dw, stats.db)]
    out = (loss, _own(stats.lse), _own(stats.argmax), *grads)
    return out + (stats.dx_rows,) if compact_dx else out


linear_ce_sum = torch.library.custom_op("fused_ce::linear_ce_sum", mutates_args=())(_linear_ce_sum)


@linear_ce_sum.register_fake
def _(x, weight, bias, target, class_weight, coef_target, coef_smooth, coef_prob, coef_lse_sq,
      ignore_index, softcap, with_weighted_sum, need_dx, need_dw, need_db, mean_d=None,
      mean_divisor=None):
    acc = accumulation_dtype(x.dtype)
    n = x.shape[0]
    gx, gw, gb = (accumulation_dtype(d) for d in grad_dtypes(x, weight, bias))
    return (x.new_empty((), dtype=acc), x.new_empty(n, dtype=acc),
            x.new_empty(n, dtype=torch.long),
            x.new_empty(x.shape, dtype=gx) if need_dx else x.new_empty(0),
            weight.new_empty(weight.shape, dtype=gw) if need_dw else x.new_empty(0),
            (bias.new_empty(bias.shape, dtype=gb) if (need_db and bias is not None)
             else x.new_empty(0)))


def _tracing(t: Tensor) -> bool:
    """True while torch.compile / AOT autograd traces (fake or functional tensors)."""
    from torch._subclasses.fake_tensor import is_fake
    from torch._subclasses.functional_tensor import FunctionalTensor

    return torch.compiler.is_compiling() or is_fake(t) or isinstance(t, FunctionalTensor)


def _sum_setup(ctx, inputs, output):
    _, lse, argmax, dx, dw, db, *dx_rows = output  # (dx_rows: the eager route's compact dx)
    ctx.mark_non_differentiable(lse, argmax, dx, dw, db)
    divisor = inputs[16] if len(inputs) > 16 else None  # the mean's divisor
    ctx.save_for_backward(dx, dw, db, divisor, dx_rows[0] if dx_rows else None)
    ctx.grad_dtypes = grad_dtypes(*inputs[:3])
    ctx.consumed = False
    # the outputs other than the loss get no upstream gradient: without this autograd would
    # allocate zeros for them, dx-, dw- and db-sized, in every backward
    ctx.set_materialize_grads(False)


def _sum_backward(ctx, g_loss, *_):
    """The gradients were computed in the forward for an upstream gradient of 1; multiply them
    by the actual (scalar) upstream gradient, rounded once into the parameters' dtypes (in place
    where they already have them). That consumes them: a second backward through the same
    graph is refused."""
    if torch.is_grad_enabled():
        raise RuntimeError(_DOUBLE_BACKWARD)
    if ctx.consumed:
        raise RuntimeError("fused_ce: a second backward through the same fused loss "
                           "(retain_graph=True) is not supported; recompute the loss instead")
    ctx.consumed = True
    dx, dw, db, divisor, dx_rows = ctx.saved_tensors
    need = ctx.needs_input_grad
    if g_loss is None:  # (not materialized) the loss itself got no gradient
        return (None,) * 17
    if divisor is not None:  # the forward returned the sum / divisor
        g_loss = g_loss / divisor
    wanted = [(g, dt) for g, dt, w in zip((dx, dw, db), ctx.grad_dtypes, need[:3]) if w]
    # each gradient times the scalar, in the wider precision of the two, rounded once
    if not wanted:
        scaled = []
    elif _tracing(dx):  # graph capture (AOT autograd) needs out-of-place code (the custom op's
        # route: its dx has every row, dx_rows is None)
        scaled = [(g * g_loss).to(dt) for g, dt in wanted]
    else:  # in one launch where the backend can (scattering a compact dx)
        grads, dtypes = zip(*wanted)
        scaled = backend_for(grads[0]).scaled_grads(grads, dtypes, g_loss,
                                                    dx_rows if need[0] else None)
    it = iter(scaled)
    return tuple(next(it) if w else None for w in need[:3]) + (None,) * 14


torch.library.register_autograd("fused_ce::linear_ce_sum", _sum_backward, setup_context=_sum_setup)


# --------------------------------------------------------------------------- per-row losses

def _linear_ce_rows(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                   class_weight: Optional[Tensor], coef_target: Tensor, coef_smooth: Tensor,
                   coef_prob: Tensor, coef_lse_sq: Tensor, ignore_index: int,
                   softcap: Optional[float], with_weighted_sum: bool, low_memory: bool
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """(row losses, lse, argmax)."""
    coefs = GradCoefs(coef_target, coef_smooth, coef_prob, coef_lse_sq)
    stats = backend_for(x).forward(x, weight, bias, target, ignore_index, softcap, class_weight,
                                   with_weighted_sum=with_weighted_sum, coefs=coefs,
                                   low_memory=low_memory, check_targets=True)
    return (_own(_row_loss(stats, coefs, with_weighted_sum)), _own(stats.lse),
            _own(stats.argmax))


linear_ce_rows = torch.library.custom_op("fused_ce::linear_ce_rows",
                                         mutates_args=())(_linear_ce_rows)


@linear_ce_rows.register_fake
def _(x, weight, bias, target, class_weight, coef_target, coef_smooth, coef_prob, coef_lse_sq,
      ignore_index, softcap, with_weighted_sum, low_memory):
    acc = accumulation_dtype(x.dtype)
    n = x.shape[0]
    return (x.new_empty(n, dtype=acc), x.new_empty(n, dtype=acc), x.new_empty(n, dtype=torch.long))


@torch.library.custom_op("fused_ce::linear_ce_rows_backward", mutates_args=())
def linear_ce_rows_backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                            class_weight: Optional[Tensor], coef_target: Tensor,
                            coef_smooth: Tensor, coef_prob: Tensor, coef_lse_sq: Tensor,
                            lse: Tensor, ignore_index: int, softcap: Optional[float],
                            need_dx: bool, need_dw: bool, need_db: bool, low_memory: bool
                            ) -> tuple[Tensor, Tensor, Tensor]:
    coefs = GradCoefs(coef_target, coef_smooth, coef_prob, coef_lse_sq)
    # lse_is_local lets the PyTorch path take the probabilities from the recomputed logits' own
    # max + log-sum (the digits an fp32 lse drops at large logits): free with whole rows, one
    # more pass over the logits with low_memory's vocabulary tiles (CPU, BERT's head: 2.4 vs
    # 0.8 s), whose probabilities then come from the saved lse (gradients 9e-7 instead of 5e-7
    # from fp64 at logits of ~40, NOTES.md #67)
    grads = backend_for(x).backward(x, weight, bias, target, ignore_index, softcap, class_weight,
                                    lse, coefs, need_dx=need_dx, need_dw=need_dw,
                                    need_db=need_db and bias is not None, low_memory=low_memory,
                                    lse_is_local=not low_memory)
    return tuple(g if g is not None else _empty(x) for g in grads)


@linear_ce_rows_backward.register_fake
def _(x, weight, bias, target, class_weight, coef_target, coef_smooth, coef_prob, coef_lse_sq,
      lse, ignore_index, softcap, need_dx, need_dw, need_db, low_memory):
    return (x.new_empty(x.shape) if need_dx else x.new_empty(0),
            weight.new_empty(weight.shape) if need_dw else x.new_empty(0),
            bias.new_empty(bias.shape) if (need_db and bias is not None) else x.new_empty(0))


def _rows_setup(ctx, inputs, output):
    _, lse, argmax = output
    ctx.mark_non_differentiable(lse, argmax)
    (x, weight, bias, target, class_weight, *coefs) = inputs[:9]
    ctx.options = inputs[9:]  # ignore_index, softcap, with_weighted_sum, low_memory
    ctx.save_for_backward(x, weight, bias, target, class_weight, lse, *coefs)
    ctx.set_materialize_grads(False)  # (no zeros for lse and argmax's absent gradients)


def _rows_backward(ctx, g_rows, *_):
    if torch.is_grad_enabled():
        raise RuntimeError(_DOUBLE_BACKWARD)
    x, weight, bias, target, class_weight, lse, *coefs = ctx.saved_tensors
    ignore_index, softcap, _, low_memory = ctx.options
    need = ctx.needs_input_grad
    if g_rows is None:
        return (None,) * 13
    g = g_rows.to(coefs[0].dtype)
    dx, dw, db = linear_ce_rows_backward(
        x, weight, bias, target, class_weight, *(c * g for c in coefs), lse, ignore_index,
        softcap, need[0], need[1], need[2], low_memory)
    return (dx if need[0] else None, dw if need[1] else None,
            db if need[2] and bias is not None else None) + (None,) * 10


torch.library.register_autograd("fused_ce::linear_ce_rows", _rows_backward,
                                setup_context=_rows_setup)


# --------------------------------------------------------------------------- eager route

def _eager_function(name: str, impl, setup, backward):
    """The same op (implementation, setup_context, backward) as a torch.autograd.Function. Its
    forward takes ctx and runs the setup itself: a Function with a separate setup_context has
    its arguments bound through inspect.signature on every apply (~0.1 ms of host time)."""
    def forward(ctx, *inputs):
        output = impl(*inputs)
        setup(ctx, inputs, output)
        return output
    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


# (the eager route's dx may hold the valid rows only: its backward scatters them)
_LinearCeSum = _eager_function("LinearCeSum", partial(_ce_sum, compact_dx=True), _sum_setup,
                               lambda ctx, *grads: _sum_backward(ctx, *grads) + (None,))
_LinearCeRows = _eager_function("LinearCeRows", _linear_ce_rows, _rows_setup, _rows_backward)


_FUNC_GRAD = ("fused_ce: torch.func's grad, vjp, jacrev and jvp cannot differentiate the fused "
              "loss or log-softmax (their gradients come from their own backward functions, which "
              "torch's custom ops do not expose to these transforms); use loss.backward() or "
              "torch.autograd.grad (torch.func.vmap of the forward works)")


def _under_func_transform(tensors) -> bool:
    """Whether torch.func transforms wrap these tensors: vmap then takes the custom ops (the
    eager route's autograd.Function cannot be vmapped); grad and jvp raise _FUNC_GRAD instead
    of torch's message about setup_context. (Skipped under torch.compile, whose dynamo cannot
    trace the check: False there.)"""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if torch.compiler.is_compiling() or not any(t is not None and wrapped(t) for t in tensors):
        return False
    from torch._functorch.pyfunctorch import TransformType, retrieve_all_functorch_interpreters
    if any(i.key() in (TransformType.Grad, TransformType.Jvp)
           for i in retrieve_all_functorch_interpreters()):
        raise NotImplementedError(_FUNC_GRAD)
    return True


def _plain_eager(*tensors) -> bool:
    """Eager mode on plain tensors. There the loss ops run as autograd.Functions: a custom op's
    Python dispatch with autograd costs ~0.4 ms of host time per call (H200, NOTES.md #23),
    which is most of the MLM step. torch.compile, fake/functional tensors, meta tensors (shapes
    only: the custom ops' fake implementations), torch.func.vmap, tensor subclasses and active
    dispatch modes (which then see one op, as under compile) get the custom ops."""
    return (not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and all(t is None or (type(t) in (Tensor, torch.nn.Parameter) and not t.is_meta)
                    for t in tensors)
            and not _under_func_transform(tensors))


def loss_sum(*args, scan=None):
    """``linear_ce_sum(*args)`` by the cheapest route with the same autograd semantics;
    ``scan`` (a ``PreparedTargets``) serves the eager route only."""
    if _plain_eager(*args[:5]):
        return _LinearCeSum.apply(*args, *(None,) * (17 - len(args)), scan)
    return linear_ce_sum(*args)


def loss_rows(*args):
    """``linear_ce_rows(*args)`` by the cheapest route with the same autograd semantics."""
    if _plain_eager(*args[:5]):
        return _LinearCeRows.apply(*args)
    return linear_ce_rows(*args)


# --------------------------------------------------------------------------- log-softmax

@torch.library.custom_op("fused_ce::linear_log_softmax", mutates_args=())
def linear_log_softmax(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    return backend_for(x).log_softmax(x, weight, bias)


@linear_log_softmax.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _lsm_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, output)


def _lsm_backward(ctx, g_out):
    """d log_softmax: dz = g - softmax * sum_j g_j, then the three linear-layer GEMMs, in row
    chunks so that only one chunk of dz lives at a time."""
    if torch.is_grad_enabled():
        raise RuntimeError(_DOUBLE_BACKWARD)
    x, weight, out = ctx.saved_tensors
    need = ctx.needs_input_grad
    acc = accumulation_dtype(x.dtype)
    dx = torch.empty_like(x) if need[0] else None
    dw = torch.zeros(weight.shape, dtype=acc, device=x.device) if need[1] else None
    db = torch.zeros(weight.shape[0], dtype=acc, device=x.device) if (need[2] and ctx.has_bias) else None
    step = chunk_rows(weight.shape[0], acc, 2, False)  # dz and the exp of the output
    for s in range(0, x.shape[0], step):
        g = g_out[s:s + step].to(acc)
        dz = g - out[s:s + step].to(acc).exp() * g.sum(1, keepdim=True)
        if dx is not None:
            dx[s:s + step] = (dz.to(weight.dtype) @ weight).to(x.dtype)
        if dw is not None:
            dw.addmm_(dz.t(), x[s:s + step].to(acc))
        if db is not None:
            db.add_(dz.sum(0))
    return (dx, None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(weight.dtype))


torch.library.register_autograd("fused_ce::linear_log_softmax", _lsm_backward,
                                setup_context=_lsm_setup)


def log_softmax(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``linear_log_softmax(x, weight, bias)`` (a custom op on every route), with _FUNC_GRAD's
    error under torch.func's grad and jvp."""
    _under_func_transform((x, weight, bias))
    return linear_log_softmax(x, weight, bias)
