"""The fp64 PyTorch oracle every numeric test compares against."""

import torch
import torch.nn.functional as F


def logits64(x, weight, bias=None, softcap=None):
    z = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


def cross_entropy64(x, weight, target, bias=None, class_weight=None, reduction="mean",
                    ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None):
    """fp64 ``F.cross_entropy`` of the explicit logits, plus the z-loss term."""
    z = logits64(x, weight, bias, softcap)
    flat = z.reshape(-1, z.shape[-1])
    t = target.reshape(-1).long()
    cw = None if class_weight is None else class_weight.double()
    loss = F.cross_entropy(flat, t, weight=cw, reduction=reduction, ignore_index=ignore_index,
                           label_smoothing=label_smoothing)
    if z_loss:
        valid = t != ignore_index
        zl = z_loss * torch.logsumexp(flat, -1) ** 2 * valid
        if reduction == "mean":
            zl = zl.sum() / valid.sum()
        elif reduction == "sum":
            zl = zl.sum()
        loss = loss + zl
    return loss.reshape(target.shape) if reduction == "none" else loss


def rel_err(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
