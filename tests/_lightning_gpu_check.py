"""GPU checks of FusedCrossEntropyCallback that CI (CPU only) cannot run; run by hand on a CUDA
machine:  python tests/_lightning_gpu_check.py

With and without the callback on one GPU (the oracle is the run without it): FSDP (model built
in __init__, patched at setup before wrapping), 16-mixed and bf16-mixed; and FSDP with the model
built in configure_model, which must stop with the callback's explanatory error. Prints one line
per check and exits non-zero if one fails."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def main():
    from lightning.pytorch.strategies import FSDPStrategy
    from transformers.models.bert.modeling_bert import BertLayer

    from tests import _lightning_models as models

    def fsdp():
        return FSDPStrategy(auto_wrap_policy={BertLayer})

    failures = []
    checks = [("fsdp fp32", fsdp, "32-true", 1e-4), ("single 16-mixed", "auto", "16-mixed", 2e-2),
              ("fsdp bf16-mixed", fsdp, "bf16-mixed", 3e-2)]
    for name, strategy, precision, rtol in checks:
        runs = []
        for fused in (False, True):
            s = strategy() if callable(strategy) else strategy
            module, trainer, cb = models.train("lightning", fused=fused, strategy=s,
                                               precision=precision, accelerator="gpu", steps=6,
                                               deterministic=False)
            state = {k: v.detach().float().cpu() for k, v in module.state_dict().items()}
            runs.append((module.step_losses, state, cb))
        (lb, wb, _), (lf, wf, cb) = runs
        dl = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(lf, lb))
        dw = max(float((wf[k] - wb[k]).abs().max()) for k in wb)
        ok = len(lf) == len(lb) == 6 and dl <= rtol and cb.patched == ["model"]
        print(f"{'ok  ' if ok else 'FAIL'} {name}: max rel loss diff {dl:.2e} (tol {rtol:.0e}), "
              f"max weight diff {dw:.2e}, report {cb.report['models']}", flush=True)
        if not ok:
            failures.append(name)
    try:
        models.train("lightning", fused=True, strategy=fsdp(), accelerator="gpu", steps=2,
                     build_in="configure_model", deterministic=False)
        print("FAIL fsdp configure_model: no error", flush=True)
        failures.append("fsdp configure_model")
    except RuntimeError as exc:
        ok = "already wrapped by FSDP" in str(exc)
        print(f"{'ok  ' if ok else 'FAIL'} fsdp configure_model: {str(exc)[:160]}...", flush=True)
        if not ok:
            failures.append("fsdp configure_model")
    print("GPU checks:", "all passed" if not failures else f"FAILED {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
