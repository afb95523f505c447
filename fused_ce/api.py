"""Public functional API: argument handling, autocast, reduction semantics, then the custom ops."""

from __future__ import annotations

import math
import sys
from contextlib import nullcontext
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor, nn

from fused_ce import _validation as check
from fused_ce import ops
from fused_ce.reference import GradCoefs, mean_from_sum, total_loss


class LinearCrossEntropyStats(NamedTuple):
    """What ``linear_cross_entropy(..., return_stats=True)`` returns.

    ``loss`` is the value returned without ``return_stats``. Per token (``target``'s shape, no
    gradient): ``lse`` = logsumexp of the token's logits (0 on ignored tokens), ``predicted`` =
    ``argmax`` of its logits (ties to the lowest index, like ``torch.argmax``; ``ignore_index`` on
    ignored tokens), ``correct`` = ``predicted == target`` (False on ignored tokens). ``accuracy``
    is the fraction of non-ignored tokens predicted correctly (nan if there are none) and
    ``z_loss`` the z-loss term alone, reduced like the loss (None when ``z_loss == 0``).
    """

    loss: Tensor
    lse: Tensor
    predicted: Tensor
    correct: Tensor
    accuracy: Tensor
    z_loss: Optional[Tensor]


class PreparedTargets:
    """What ``prepare_targets`` returns: one target tensor's scan, for one later
    ``linear_cross_entropy`` call on that same tensor (unchanged since)."""

    def __init__(self, target: Tensor, vocab: int, ignore_index: int):
        from fused_ce._dispatch import backend_for

        self._source = self._identity(target)
        self.vocab, self.ignore_index = vocab, ignore_index
        self.backend = backend_for(target)
        make = getattr(self.backend, "scan_targets", None)
        self.scan = None if make is None else make(target.reshape(-1).long(), ignore_index, vocab)

    @staticmethod
    def _identity(target: Tensor) -> tuple:
        """The tensor's storage, layout and in-place version counter."""
        return (target.data_ptr(), tuple(target.shape), target.dtype, target.device,
                target._version)

    def matches(self, target: Tensor, vocab: int, ignore_index: int) -> bool:
        """Whether this was made for ``target`` (the same tensor, unchanged since) and these
        options."""
        return self._identity(target) == self._source and (vocab, ignore_index) == (self.vocab,
                                                                    self.ignore_index)

    def check(self, target: Tensor, vocab: int, ignore_index: int) -> None:
        if not self.matches(target, vocab, ignore_index):
            raise ValueError(
                f"prepared_targets: expected fused_ce.prepare_targets of this call's target "
                f"(the same tensor, unchanged since), vocab={vocab} and "
                f"ignore_index={ignore_index}; got one made for another target or options "
                f"(vocab={self.vocab}, ignore_index={self.ignore_index})")


def prepare_targets(target: Tensor, vocab: int, *, ignore_index: int = -100) -> PreparedTargets:
    """Scan ``target`` now for a later ``linear_cross_entropy(..., target,
    prepared_targets=...)`` call with ``vocab`` classes.

    The CUDA loss reads one value from the device per call (the number of valid targets, which
    sizes its cuBLAS products, and the out-of-range check). At the end of a model's forward pass
    that read waits until the GPU has run the whole pass, and the host's lead over the GPU is
    lost. Prepared before the forward pass (the HF adapter does this), the value is on the host
    by the time the loss needs it. Results are identical with or without it; elsewhere (CPU,
    graph capture, compile) it does nothing.
    """
    check.check_tensor("target", target, floating=False)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"vocab: expected an int >= 1 (the number of classes), got {vocab!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {ignore_index!r}")
    return PreparedTargets(target, vocab, ignore_index)


def _rows(x: Tensor) -> Tensor:
    """``x (..., H)`` as an (N, H) matrix; also for H = 0 (where ``reshape(-1, 0)`` fails)."""
    return x.reshape(x.shape[:-1].numel(), x.shape[-1])


def _unpack_linear(linear_weight, linear_bias):
    if isinstance(linear_weight, nn.Linear):
        if linear_bias is not None:
            raise ValueError("linear_bias: expected None when linear_weight is an nn.Linear "
                             "(its own bias is used), got a tensor")
        return linear_weight.weight, linear_weight.bias
    return linear_weight, linear_bias


def _is_dtensor(t) -> bool:
    """A DTensor head (vocab-sharded) takes the vocab-parallel path even without a process_group.
    No DTensor can exist unless its module was imported, so this imports nothing."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype in effect for ``device_type``, None where there is none (and for
    device types without autocast, such as 'meta')."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _cast_for_autocast(tensors, device_type):
    """Under autocast, ``F.linear`` runs in the autocast dtype; so do we. Like autocast's own
    casts, float64 operands stay float64 (all float64: the op runs in float64). The operands
    (after the casts) must share one dtype. Returns the tensors to compute with and the context
    to run the op in."""
    dtype = _autocast_dtype(device_type)
    names = ("input", "linear_weight", "linear_bias")
    if dtype is None:
        check.check_dtypes(dict(zip(names, tensors)))
        return tensors, nullcontext()
    cast = [t if t is None or t.dtype == torch.float64 else t.to(dtype) for t in tensors]
    check.check_dtypes(dict(zip(names, cast)), dtype)
    return cast, torch.autocast(device_type, enabled=False)


def _coefficients(target: Tensor, valid: Tensor, class_weight: Optional[Tensor], vocab: int,
                  reduction: str, label_smoothing: float, z_loss: float, acc: torch.dtype):
    """Per-row coefficients of ``loss_i`` (see ``fused_ce.ops``) reproducing
    ``F.cross_entropy(logits, target, weight, reduction, ignore_index, label_smoothing)``.

    torch's definition, row ``i`` valid (target not ignored), ``eps = label_smoothing``::

        nll_i    = w[t_i] * (lse_i - z_{i,t_i})
        smooth_i = sum_j w[j] * (lse_i - z_ij)          (w = 1 without class weights)
        loss     = (1 - eps) * reduce(nll) + eps / V * reduce'(smooth)

    'mean' divides both parts by ``sum_valid w[t_i]`` (the number of valid rows without class
    weights). The z-loss ``z_loss * lse_i**2`` is averaged over valid rows, unweighted.

    Returns (coefficients, the 'mean' denominator d of the nll part, the divisor applied to the
    summed loss: d (1 where d is 0); both None unless 'mean'). 'mean' is left to that
    division (``reference.mean_from_sum``; the upstream gradient divided by it reaches the op's
    one rounding): the coefficients are 'sum''s, 1 (or w[t_i]) and not 1/n, and the z-loss's is
    multiplied by d, so that a 16-bit D's target entries (p - 1) * coefficient are not all
    rounded by the same relative error of 1/n, an error that dX and dW would inherit row for
    row (up to 2^-9: dX 2.7e-3 instead of 1.7e-3 against fp64 at n = 614, NOTES.md #64).
    """
    valid_f = valid.to(acc)
    w_t = valid_f if class_weight is None else class_weight.to(acc)[target.clamp(0, vocab - 1)] * valid_f
    w_sum = float(vocab) if class_weight is None else class_weight.to(acc).sum()
    d_nll = divisor = d_z = None  # (None: 1)
    if reduction == "mean":
        # (0 valid rows: a divisor of 1 keeps the zero gradients; the caller adds the nan.
        # Without class weights d_nll counts rows, so max(d_nll, 1) is that divisor)
        d_nll = w_t.sum()
        divisor = (d_nll.clamp_min(1) if class_weight is None
                   else torch.where(d_nll == 0, 1.0, d_nll))
        if class_weight is not None:
            # valid rows whose class weights sum to 0: torch's mean is 0/0 and so are their
            # gradients (nan; the ignored rows' stay 0): their coefficients carry that nan
            w_t = torch.where(valid & (d_nll == 0), math.nan, w_t)
        if z_loss:  # its mean over the valid rows, times the divisor the loss then gets
            d_z = valid_f.sum() / divisor
    # w_t is 0 on ignored rows; a term that is off (no smoothing, no z-loss) gets exact zeros
    # without the arithmetic
    a = (1 - label_smoothing) * w_t if label_smoothing else w_t
    zeros = None if label_smoothing and z_loss else torch.zeros_like(a)
    c = valid_f * (label_smoothing / vocab) if label_smoothing else zeros
    if not z_loss:
        e = zeros
    elif d_z is None:
        e = valid_f * z_loss
    else:  # (no valid row: d_z is 0, and the ignored rows keep their exact 0)
        e = torch.where(valid, z_loss / d_z, 0.0)
    coefs = GradCoefs(target=a, smooth=c, prob=a + c * w_sum if label_smoothing else a, lse_sq=e)
    return coefs, d_nll, divisor


def linear_cross_entropy(
    input: Tensor,
    linear_weight: Union[Tensor, nn.Linear],
    target: Tensor,
    *,
    linear_bias: Optional[Tensor] = None,
    weight: Optional[Tensor] = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    low_memory: bool = False,
    return_stats: bool = False,
    process_group=None,
    prepared_targets: Optional[PreparedTargets] = None,
):
    """Cross-entropy of a linear layer's output without materializing its logits.

    Exactly::

        F.cross_entropy(F.linear(input, linear_weight, linear_bias), target, weight=weight,
                        reduction=reduction, ignore_index=ignore_index,
                        label_smoothing=label_smoothing)

    for ``input`` (N, H) and ``target`` (N,) (other leading shapes count as their rows:
    ``input.reshape(-1, H)``, ``target.reshape(-1)``), computed in row chunks with fp32
    accumulation (fp64 for fp64 inputs), plus two options:

    * ``softcap=c``: the logits become ``c * tanh(logits / c)`` after the bias (Gemma-2).
    * ``z_loss=s``: adds ``s * logsumexp(logits)**2`` for every non-ignored token, reduced like
      the loss ('mean': over non-ignored tokens, not weighted by ``weight``).

    Shapes: ``input (..., H)``, ``linear_weight (V, H)`` (or an ``nn.Linear``, whose weight and
    bias are used), ``linear_bias (V,)``, ``target (...)`` int64/int32, ``weight (V,)``.
    'none' returns ``target``'s shape. The loss is fp32 for fp32/fp16/bf16 inputs (what
    ``F.cross_entropy`` returns under autocast) and fp64 for fp64 inputs.

    Edge cases as torch: 'mean' over zero non-ignored tokens (or zero rows) is nan, 'sum' is 0;
    the gradients are then zero. Rows whose target is ``ignore_index`` do no GEMM work.
    Gradients flow to ``input``, ``linear_weight`` and ``linear_bias``, each only when it
    requires grad; double backward raises. Under ``torch.autocast`` the computation runs in the
    autocast dtype; outside it, ``input``/``linear_weight``/``linear_bias`` must share a dtype.

    ``low_memory=True`` bounds the workspace to O(rows) beyond the gradient buffers at some
    speed cost; its gradients are computed in the backward from the saved log-sum-exp, so no
    gradient-sized buffer is held from the forward to the backward. ``return_stats=True``
    returns :class:`LinearCrossEntropyStats` instead of the loss. ``process_group`` selects
    the vocab-parallel mode (``fused_ce.distributed``).

    Out-of-range targets raise ``ValueError``; checking them reads one bool from the device
    (asynchronous device assert while a CUDA graph is captured or torch.compile traces).
    ``prepared_targets``: ``prepare_targets(target, V, ignore_index=...)`` made earlier, so
    that this read does not wait (see there); the result is the same.

    A training step that calls it can be captured into a CUDA graph (``torch.cuda.graph`` after
    an eager warm-up, ``torch.compile(mode="reduce-overhead")``): while captured nothing waits
    on the host, and the GEMMs then span the ignored rows too (README, "Exact semantics").
    """
    linear_weight, linear_bias = _unpack_linear(linear_weight, linear_bias)
    check.check_linear(input, linear_weight, linear_bias)
    if process_group is not None or _is_dtensor(linear_weight):
        from fused_ce import distributed
        return distributed.vocab_parallel_cross_entropy(
            input, linear_weight, target, linear_bias=linear_bias, weight=weight,
            reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
            z_loss=z_loss, softcap=softcap, low_memory=low_memory, return_stats=return_stats,
            process_group=process_group)
    vocab = linear_weight.shape[0]
    reduction, ignore_index, label_smoothing, z_loss, softcap = check.check_loss_options(
        target, input, vocab, weight, reduction, ignore_index, label_smoothing, z_loss, softcap)
    # (target values are checked by the op, at the backend's one host synchronization)
    if prepared_targets is not None:
        if not isinstance(prepared_targets, PreparedTargets):
            raise TypeError(f"prepared_targets: expected None or fused_ce.prepare_targets(...), "
                            f"got {type(prepared_targets).__name__}")
        prepared_targets.check(target, vocab, ignore_index)

    (x, w, b), ctx = _cast_for_autocast((input, linear_weight, linear_bias), input.device.type)
    x = _rows(x)
    t = target.reshape(-1).long()
    valid = t != ignore_index
    acc = torch.promote_types(x.dtype, torch.float32)
    coefs, d_nll, divisor = _coefficients(t, valid, weight, vocab, reduction, label_smoothing,
                                          z_loss, acc)
    cw = None if weight is None else weight.to(acc)
    with_ws = label_smoothing > 0
    with ctx:
        if reduction == "none" or low_memory:
            # (low_memory: the gradients computed in the backward, in the parameters' dtypes)
            rows, lse, argmax = ops.loss_rows(
                x, w, b, t, cw, *coefs, ignore_index, softcap, with_ws, low_memory)
            # ('sum' and 'mean': d_nll and divisor are None unless 'mean')
            loss = (rows.reshape(target.shape) if reduction == "none"
                    else total_loss(rows, d_nll, divisor))
        else:
            grad_on = torch.is_grad_enabled()
            need = [grad_on and p is not None and p.requires_grad for p in (x, w, b)]
            # ('mean': the op divides its sum, outside autograd)
            loss, lse, argmax, *_ = ops.loss_sum(
                x, w, b, t, cw, *coefs, ignore_index, softcap, with_ws, *need, d_nll, divisor,
                scan=prepared_targets)
    if not return_stats:
        return loss
    return _stats(loss, lse, argmax, t, valid, coefs, target.shape, z_loss, divisor)


def _stats(loss, lse, argmax, t, valid, coefs, shape, z_loss, divisor=None
           ) -> LinearCrossEntropyStats:
    correct = (argmax == t) & valid
    accuracy = correct.sum().to(lse.dtype) / valid.sum().to(lse.dtype)
    z_term = None
    if z_loss > 0:
        z_rows = coefs.lse_sq * lse * lse
        if loss.dim() > 0:
            z_term = z_rows.reshape(shape)
        else:
            # 'mean' over the valid rows: nan without one, as the loss
            z_term = (z_rows.sum() if divisor is None
                      else mean_from_sum(z_rows.sum(), valid.sum(), divisor))
    return LinearCrossEntropyStats(loss, lse.reshape(shape), argmax.reshape(shape),
                                   correct.reshape(shape), accuracy, z_term)


def linear_log_softmax(input: Tensor, linear_weight: Union[Tensor, nn.Linear],
                       linear_bias: Optional[Tensor] = None) -> Tensor:
    """``F.log_softmax(F.linear(input, linear_weight, linear_bias), dim=-1)`` as one op.

    The bias add and the log-softmax are fused into the GEMM's row chunks (fp32 accumulation);
    the only full-size tensor is the returned log-probabilities, in the compute dtype (the
    autocast dtype under ``torch.autocast``, else ``input``'s). Shapes: ``input (..., H)`` ->
    ``(..., V)``.
    """
    linear_weight, linear_bias = _unpack_linear(linear_weight, linear_bias)
    check.check_linear(input, linear_weight, linear_bias)
    (x, w, b), ctx = _cast_for_autocast((input, linear_weight, linear_bias), input.device.type)
    with ctx:
        out = ops.log_softmax(_rows(x), w, b)
    return out.reshape(*input.shape[:-1], w.shape[0])
