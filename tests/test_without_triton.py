"""Without Triton (macOS, Windows: pyproject installs it on Linux only) the package, its
PyTorch path and both integrations work. Checked in a fresh process whose imports of
``triton`` fail, against eager PyTorch in float64."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import json, sys

    class NoTriton:
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError("no triton on this platform (test)")
            return None

    sys.meta_path.insert(0, NoTriton())
    import torch
    import torch.nn.functional as F
    import fused_ce

    torch.manual_seed(0)
    x = torch.randn(6, 9, dtype=torch.float64, requires_grad=True)
    w = torch.randn(13, 9, dtype=torch.float64, requires_grad=True)
    b = torch.randn(13, dtype=torch.float64) * 30
    t = torch.tensor([0, 12, -100, 5, 5, 7])
    loss = fused_ce.linear_cross_entropy(x, w, t, linear_bias=b, label_smoothing=0.1)
    gx, gw = torch.autograd.grad(loss, (x, w))
    ref = F.cross_entropy(F.linear(x, w, b), t, label_smoothing=0.1)
    rx, rw = torch.autograd.grad(ref, (x, w))
    logp = fused_ce.linear_log_softmax(x, w, b)

    from transformers import BertConfig, BertForMaskedLM
    model = BertForMaskedLM(BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                       num_attention_heads=2, intermediate_size=32))
    fused_ce.patch_hf_model(model)
    callback = fused_ce.FusedCrossEntropyCallback()
    print(json.dumps({
        "loss_err": abs(loss - ref).item(),
        "dx_err": (gx - rx).abs().max().item(),
        "dw_err": (gw - rw).abs().max().item(),
        "logp_err": (logp - F.log_softmax(F.linear(x, w, b), -1)).abs().max().item(),
        "patched": fused_ce.is_patched(model),
        "callback": type(callback).__name__,
        "triton_imported": "triton" in sys.modules,
    }))
""")


def test_everything_but_the_kernels_works_without_triton():
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    env.pop("TRITON_INTERPRET", None)
    env.pop("FUSED_CE_BACKEND", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, check=True,
                         capture_output=True, text=True, timeout=300)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["loss_err"] < 1e-12 and got["dx_err"] < 1e-12 and got["dw_err"] < 1e-12, got
    assert got["logp_err"] < 1e-12, got
    assert got["patched"] and "Callback" in got["callback"], got
    assert not got["triton_imported"], got
