"""Forward+backward benchmark of fused_ce against its peers on the issue's shapes (CUDA only),
and the loss alone under torch.no_grad (the ``_eval`` shapes: evaluation).

    python benchmarks/bench.py --out results/            # every shape, every method
    python benchmarks/bench.py --shapes bert8k,mlm --methods fused_ce,floor --out r/

For each (shape, method): median time of forward+backward (CUDA events via
triton.testing.do_bench, median of many runs after warm-up), peak extra memory of one
forward+backward (max_memory_allocated minus the allocation before the call; includes the gradient
buffers, which are also reported alone), and relative errors against an fp32 reference on the same
bf16 inputs (loss: |a-b|/|b|; gradients: ||a-b|| / ||b||). Prints a table, writes results.json and
PNG plots (time and memory against vocabulary size and token count) to --out. The shape
gemma2_softcap is Gemma-2's head with its logits softcapped at 30 (SOFTCAP), as the model has
it, for the methods that take a softcap. llama3_zipf and gemma2_zipf draw their targets as
text's (p_k ~ 1 / (k + 1)) instead of uniformly, for kernels whose work depends on how often a
target repeats; not run unless named.

Methods: fused_ce (default: the row-chunk cuBLAS path for bf16), fused_ce_sweep (the
vocabulary sweep, which fp32 inputs take, and CUDA-graph capture took before NOTES.md #91),
fused_ce_lowmem (low_memory=True),
fused_ce_sweep_triton / fused_ce_lowmem_triton (the same two with the sweep's dX/dW products in
Triton instead of cuBLAS), fused_ce_again (fused_ce once more, after the peers: a check
that the order of methods does not change the numbers), fused_ce_stats (the same call with
return_stats=True: lse, argmax and accuracy come from the same pass), eager (bf16 F.linear +
F.cross_entropy), compile (torch.compile of eager), fused_ce_graphs / compile_graphs (fused_ce
and eager under torch.compile(mode="reduce-overhead"): the step replayed from CUDA graphs, no
host work per kernel; peak memory over the warm-up steps that record the graphs, comparable
only run alone in a process: GRAPH_METHODS), liger
(LigerFusedLinearCrossEntropyLoss),
cce (cut_cross_entropy.linear_cross_entropy, no bias), torch_lce (torch's chunked
F.linear_cross_entropy, torch >= 2.13), kernels (fused_ce.kernels.forward with gradients called
directly: the kernels' own time and memory, no autograd layer), fused_ce_rowstats (``_eval``
shapes: the statistics by row_stats.py instead of the epilogue GEMM of stats_pass.py), floor
(three cuBLAS GEMMs on the valid rows, V padded to a multiple of 128; ``_eval``: the logits
GEMM alone). Peers that are not importable are reported as such.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = {
    # name: (N, H, V, bias, fraction of rows with a label, kind)
    "bert8k": (8192, 1024, 30258, True, 1.0, "ce"),
    "bert16k": (16384, 1024, 30522, True, 1.0, "ce"),
    "mlm": (16384, 1024, 30522, True, 0.15, "ce"),
    "llama3": (16384, 4096, 128256, False, 1.0, "ce"),
    "gemma2": (8192, 2304, 256000, False, 1.0, "ce"),
    "logsoftmax": (8192, 1024, 30258, True, 1.0, "logsoftmax"),
    # the loss alone under torch.no_grad (evaluation): forward only
    "bert16k_eval": (16384, 1024, 30522, True, 1.0, "eval"),
    "mlm_eval": (16384, 1024, 30522, True, 0.15, "eval"),
    "llama3_eval": (16384, 4096, 128256, False, 1.0, "eval"),
    "gemma2_eval": (8192, 2304, 256000, False, 1.0, "eval"),
    # Gemma-2's head as the model has it: logits softcapped at 30 (c tanh(z / c))
    "gemma2_softcap": (8192, 2304, 256000, False, 1.0, "ce"),
    # targets as text's instead of uniform: p_k ~ 1 / (k + 1), the commonest ~8 % of the rows
    "llama3_zipf": (16384, 4096, 128256, False, 1.0, "ce"),
    "gemma2_zipf": (8192, 2304, 256000, False, 1.0, "ce"),
    # a small language model's head (Qwen2.5-0.5B: tied embeddings, no bias), narrow and wide:
    # the D pass is a larger share there than at the wide heads
    "qwen05b": (16384, 896, 151936, False, 1.0, "ce"),
}
SOFTCAP = {"gemma2_softcap": 30.0}
ZIPF = ("llama3_zipf", "gemma2_zipf")
EXTRA = ZIPF + ("qwen05b",)  # not in the default run (the shapes)
CE_METHODS = ["fused_ce", "fused_ce_again", "fused_ce_stats", "fused_ce_fp32z",
              "fused_ce_epilogue", "fused_ce_rowref", "fused_ce_dpass", "fused_ce_sweep",
              "fused_ce_lowmem", "fused_ce_lowmem_one_sweep", "fused_ce_lowmem_blocks",
              "fused_ce_sweep_triton",
              "fused_ce_lowmem_triton", "kernels", "eager", "compile", "fused_ce_graphs",
              "compile_graphs", "liger", "cce", "torch_lce", "floor"]
# the methods run by torch.compile(mode="reduce-overhead"): CUDA-graph trees record the forward
# and the backward during the warm-up steps and replay them after; their peak memory is taken
# over the warm-up (the graphs' memory pool), not over one replay. The trees keep one pool per
# process, which later recordings reuse: for their memory, one shape and method per process.
GRAPH_METHODS = ("fused_ce_graphs", "compile_graphs")
LS_METHODS = ["fused_ce", "fused_ce_fp32z", "eager", "compile", "floor"]
EVAL_METHODS = ["fused_ce", "fused_ce_rowstats", "eager", "compile", "liger", "cce", "floor"]
METHODS = {"ce": CE_METHODS, "logsoftmax": LS_METHODS, "eval": EVAL_METHODS}
MiB = 2**20


def make_inputs(shape, seed=0):
    n, h, v, bias, frac, kind = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(n, h, device="cuda", generator=g) * 1.0).to(torch.bfloat16)
    w = (torch.randn(v, h, device="cuda", generator=g) / math.sqrt(h)).to(torch.bfloat16)
    b = (torch.randn(v, device="cuda", generator=g) * 0.5).to(torch.bfloat16) if bias else None
    if shape in ZIPF:
        t = torch.multinomial(1.0 / torch.arange(1, v + 1, device="cuda"), n, replacement=True,
                              generator=g)
    else:
        t = torch.randint(0, v, (n,), device="cuda", generator=g)
    if frac < 1.0:
        keep = torch.rand(n, device="cuda", generator=g) < frac
        t = torch.where(keep, t, torch.full_like(t, -100))
    for p in (x, w, b):
        if p is not None:
            p.requires_grad_(kind != "logsoftmax")  # (eval: a model's weights, no_grad)
    return x, w, b, t


# ----------------------------------------------------------------------------------- methods

def _fused_api():
    import fused_ce
    if hasattr(fused_ce, "linear_cross_entropy"):
        return fused_ce.linear_cross_entropy, fused_ce.linear_log_softmax
    raise ImportError("fused_ce.linear_cross_entropy missing")


def _logits(x, w, b, softcap=None):
    z = F.linear(x, w, b)
    return z if softcap is None else softcap * torch.tanh(z / softcap)


# the methods that take a softcap (SOFTCAP's shapes; training only)
SOFTCAP_METHODS = ("fused_ce", "fused_ce_lowmem", "fused_ce_lowmem_one_sweep",
                   "fused_ce_lowmem_blocks", "fused_ce_fp32z", "fused_ce_epilogue",
                   "fused_ce_rowref", "fused_ce_dpass", "eager",
                   "compile", "fused_ce_graphs", "compile_graphs", "liger", "cce", "floor")


def _switch_places(config, name):
    """[(dict, key)] where config_switches' ``name`` lives: a config module name, or
    "section.key", that entry of both GPU tile configurations. An unknown name raises."""
    section, _, key = name.rpartition(".")
    boxes = ([config.CONFIG[c].get(section) for c in ("gpu", "gpu_wide")] if section
             else [vars(config)])
    if any(box is None or key not in box for box in boxes):
        raise KeyError(f"config switch {name!r}: expected a fused_ce.kernels.config name or "
                       f"'section.key' of its GPU tile configurations")
    return [(box, key) for box in boxes]


@contextlib.contextmanager
def config_switches(switches):
    """fused_ce.kernels.config's module switches set to ``switches`` inside, restored after.
    A "section.key" name sets that entry of both GPU tile configurations
    (``config.CONFIG["gpu" | "gpu_wide"][section][key]``)."""
    from fused_ce.kernels import config
    places = [_switch_places(config, name) for name in switches]
    saved = [[(box, key, box[key]) for box, key in where] for where in places]
    for where, value in zip(places, switches.values()):
        for box, key in where:
            box[key] = value
    try:
        yield
    finally:
        for where in saved:
            for box, key, value in where:
                box[key] = value


def _with_config(run, **switches):
    """``run`` with fused_ce.kernels.config's module switches set to ``switches`` during each
    call: the variants below, one setting beside the default. The switches also go with the
    function (``.switches``): forward_backward and errors keep them set through the backward
    pass, where low_memory computes its gradients."""
    def variant():
        with config_switches(switches):
            return run()
    variant.switches = switches
    return variant


def method_fn(name, kind, x, w, b, t, softcap=None):
    """A closure computing the method's output (loss for 'ce', log-probs for 'logsoftmax');
    ``softcap``: the loss's logits softcapped (SOFTCAP; the methods of SOFTCAP_METHODS)."""
    if softcap is not None and (kind != "ce" or name not in SOFTCAP_METHODS):
        raise NotImplementedError(f"{name} ({kind}): no softcap here")
    if name in ("fused_ce", "fused_ce_lowmem", "fused_ce_again", "fused_ce_stats"):
        lce, lls = _fused_api()
        if kind == "logsoftmax":
            return lambda: lls(x, w, b)
        low = name == "fused_ce_lowmem"
        if name == "fused_ce_stats":  # the same loss with the token statistics returned too
            return lambda: lce(x, w, t, linear_bias=b, return_stats=True).loss
        return lambda: lce(x, w, t, linear_bias=b, low_memory=low, softcap=softcap)
    if name in ("fused_ce_sweep", "fused_ce_sweep_triton", "fused_ce_lowmem_triton"):
        # the vocabulary sweep (fp32's path, and what a captured step took before NOTES.md
        # #91), optionally with its Triton products
        lce, _ = _fused_api()
        low = name == "fused_ce_lowmem_triton"
        return _with_config(lambda: lce(x, w, t, linear_bias=b, low_memory=low),
                            ROW_CHUNKS=False, LIBRARY_PRODUCTS=name == "fused_ce_sweep")
    if name == "fused_ce_rowstats":  # no gradients: the statistics by row_stats.py
        lce, _ = _fused_api()
        return _with_config(lambda: lce(x, w, t, linear_bias=b), STATS_EPILOGUE=False)
    if name in ("fused_ce_fp32z", "fused_ce_epilogue"):
        # the row-chunk path with its logits by cuBLAS (fp32 Z) and finish_rows_kernel, or by
        # the Triton GEMM with the softmax epilogue (kernels/logits_tiles.py)
        lce, lls = _fused_api()
        epilogue = name == "fused_ce_epilogue"
        if kind == "logsoftmax":  # log_softmax's logits by the epilogue GEMM or cuBLAS fp32
            return _with_config(lambda: lls(x, w, b), LOG_PROBS_EPILOGUE=epilogue)
        return _with_config(lambda: lce(x, w, t, linear_bias=b, softcap=softcap),
                            LOGITS_EPILOGUE=epilogue)
    if name in ("fused_ce_lowmem_one_sweep", "fused_ce_lowmem_blocks"):
        # low_memory in one sweep where it applies (kernels/gradients._low_memory_one_sweep), or
        # by dX's row blocks and then the dW sweep, whatever the configuration says
        lce, _ = _fused_api()
        return _with_config(lambda: lce(x, w, t, linear_bias=b, low_memory=True, softcap=softcap),
                            LOW_MEMORY_ONE_SWEEP=name == "fused_ce_lowmem_one_sweep")
    if name in ("fused_ce_rowref", "fused_ce_dpass"):
        # the epilogue path with E against one reference per row (kernels/row_ref.py) where it
        # applies, or with every tile's own max and the D pass, whatever the configuration says
        lce, _ = _fused_api()
        return _with_config(lambda: lce(x, w, t, linear_bias=b, softcap=softcap),
                            **{"logits_tiles.row_ref": name == "fused_ce_rowref"})
    if name == "eager":
        if kind == "logsoftmax":
            return lambda: F.log_softmax(F.linear(x, w, b), -1)
        return lambda: F.cross_entropy(_logits(x, w, b, softcap), t)
    if name == "compile":
        if kind == "logsoftmax":
            f = torch.compile(lambda x, w, b: F.log_softmax(F.linear(x, w, b), -1))
        else:
            f = torch.compile(lambda x, w, b, t: F.cross_entropy(_logits(x, w, b, softcap), t))
            return lambda: f(x, w, b, t)
        return lambda: f(x, w, b)
    if name in GRAPH_METHODS:
        if name == "fused_ce_graphs":
            lce, _ = _fused_api()
            loss = lambda x, w, b, t: lce(x, w, t, linear_bias=b, softcap=softcap)  # noqa: E731
        else:
            loss = lambda x, w, b, t: F.cross_entropy(_logits(x, w, b, softcap), t)  # noqa: E731
        f = torch.compile(loss, mode="reduce-overhead")

        def replay():
            torch.compiler.cudagraph_mark_step_begin()  # (the last step's outputs are done)
            return f(x, w, b, t)
        return replay
    if name == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        loss = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, softcap=softcap)
        return lambda: loss(w, x, t, b)
    if name == "cce":
        if b is not None:
            raise NotImplementedError("no bias")
        from cut_cross_entropy import linear_cross_entropy
        return lambda: linear_cross_entropy(x, w, t, ignore_index=-100, softcap=softcap)
    if name == "torch_lce":
        if not hasattr(F, "linear_cross_entropy"):
            raise NotImplementedError(f"torch {torch.__version__} has no F.linear_cross_entropy")
        opts = torch.nn.LinearCrossEntropyOptions()  # the chunked path ("auto" policy)
        return lambda: F.linear_cross_entropy(x, w, t, linear_bias=b, options=opts)
    if name == "floor":
        return floor_fn(kind, x, w, b, t)
    if name == "kernels":  # fused_ce.kernels.forward with gradients, no autograd layer
        from fused_ce import kernels
        from fused_ce.reference import GradCoefs
        valid = (t != -100).float()
        a = valid / valid.sum()
        z = torch.zeros_like(a)
        co = GradCoefs(a, z, a, z)
        xd, wd, bd = x.detach(), w.detach(), None if b is None else b.detach()
        return lambda: kernels.forward(xd, wd, bd, t, -100, None, None, coefs=co, need_dx=True,
                                       need_dw=True, need_db=b is not None)
    raise ValueError(name)


def floor_fn(kind, x, w, b, t):
    """Three cuBLAS GEMMs over the valid rows with V padded to 128 (logits, dX, dW); for
    log-softmax, the logits GEMM writing the full output; for eval, the logits GEMM over the
    valid rows."""
    v = w.shape[0]
    vp = (v + 127) // 128 * 128
    wp = torch.zeros(vp, w.shape[1], dtype=w.dtype, device=w.device)
    wp[:v] = w.detach()
    rows = (t != -100).nonzero().squeeze(1)
    xv = x.detach()[rows].contiguous()
    out = torch.empty(xv.shape[0], vp, dtype=x.dtype, device=x.device)
    if kind != "ce":  # (eval: the logits of the valid rows)
        return lambda: torch.mm(xv, wp.t(), out=out)

    def run():
        torch.mm(xv, wp.t(), out=out)
        dx = out @ wp
        dw = out.t() @ xv
        return dx, dw
    return run


def forward_backward(name, kind, fn, params):
    if kind == "eval":
        def no_grad_step():
            with torch.no_grad():
                return fn()
        return no_grad_step

    def step():
        for p in params:
            p.grad = None
        with config_switches(getattr(fn, "switches", {})):
            out = fn()
            if kind == "ce" and name not in ("floor", "kernels"):
                out.backward()
        return out
    return step


def ms_per_step(step, steps: int) -> float:
    """Mean ms per step of ``steps`` calls of ``step`` issued back to back, as a training loop
    issues them (one pair of CUDA events around them all; perf_counter on a CPU)."""
    if torch.cuda.is_available():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return 1e3 * (time.perf_counter() - t0) / steps


def reference_fp32(kind, x, w, b, t, softcap=None):
    """fp32 logits from the same bf16 inputs (softcapped with ``softcap``); loss and grads in
    fp32 (no TF32)."""
    xf = x.detach().float().requires_grad_()
    wf = w.detach().float().requires_grad_()
    bf = None if b is None else b.detach().float().requires_grad_()
    if kind == "logsoftmax":
        with torch.no_grad():
            return {"out": F.log_softmax(F.linear(xf, wf, bf), -1)}
    if kind == "eval":
        with torch.no_grad():
            return {"loss": F.cross_entropy(F.linear(xf, wf, bf), t)}
    loss = F.cross_entropy(_logits(xf, wf, bf, softcap), t)
    loss.backward()
    ref = {"loss": loss.detach(), "dx": xf.grad, "dw": wf.grad}
    if bf is not None:
        ref["db"] = bf.grad
    return ref


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def errors(name, kind, fn, params, ref):
    x, w, b = params[0], params[1], (params[2] if len(params) > 2 else None)
    for p in params:
        p.grad = None
    if name in ("floor", "kernels"):
        return {}
    out = fn()
    if kind == "logsoftmax":
        return {"out": rel(out, ref["out"])}
    if kind == "eval":
        with torch.no_grad():
            out = fn()
        return {"loss": abs(out.item() - ref["loss"].item()) / abs(ref["loss"].item())}
    with config_switches(getattr(fn, "switches", {})):
        out.backward()
    e = {"loss": abs(out.item() - ref["loss"].item()) / abs(ref["loss"].item()),
         "dx": rel(x.grad, ref["dx"]), "dw": rel(w.grad, ref["dw"])}
    if b is not None and "db" in ref:
        e["db"] = rel(b.grad, ref["db"])
    return e


def peak_mib(fn) -> float:
    """Peak device memory of one call of fn, in MiB above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / MiB
    del out
    return peak


def measure(name, shape, args):
    import triton.testing
    n, h, v, bias, frac, kind = SHAPES[shape]
    x, w, b, t = make_inputs(shape)
    params = [p for p in (x, w, b) if p is not None]
    fn = method_fn(name, kind, x, w, b, t, SOFTCAP.get(shape))
    step = forward_backward(name, kind, fn, params)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for _ in range(args.warmup_steps):  # compile, and the allocator's first large blocks
        step()
    torch.cuda.synchronize()
    graphs_peak = (torch.cuda.max_memory_allocated() - base) / MiB
    grads_mib = sum(p.numel() * p.element_size() for p in params) / MiB if kind == "ce" else 0.0
    # memory: one call from a clean state (grads freed); for log-softmax the output itself is
    # part of the peak, like the peers'
    for p in params:
        p.grad = None
    peak = graphs_peak if name in GRAPH_METHODS else peak_mib(step)
    est = triton.testing.do_bench(step, warmup=max(25, args.warmup_ms), rep=args.rep_ms,
                                  return_mode="median")
    err = {}
    if args.errors:
        ref = reference_fp32(kind, x, w, b, t, SOFTCAP.get(shape))
        err = errors(name, kind, fn, params, ref)
        del ref
    return {"shape": shape, "method": name, "N": n, "H": h, "V": v, "bias": bias,
            "valid_frac": frac, "kind": kind, "ms": est, "peak_mib": peak,
            "grads_mib": grads_mib, "errors": err}


def print_table(rows):
    print(f"{'shape':<11} {'method':<16} {'ms':>8} {'peak MiB':>9} {'grads':>6}  errors")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<11} {r['method']:<16} {'-':>8} {'-':>9} {'-':>6}  {r['error']}")
            continue
        e = " ".join(f"{k}={v:.2e}" for k, v in r["errors"].items())
        print(f"{r['shape']:<11} {r['method']:<16} {r['ms']:8.3f} {r['peak_mib']:9.0f} "
              f"{r['grads_mib']:6.0f}  {e}")


def plots(rows, out, gpu):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots")
        return
    ok = [r for r in rows if "error" not in r and r["kind"] == "ce" and r["valid_frac"] == 1.0]
    methods = sorted({r["method"] for r in ok})
    for xkey, fname in (("V", "vs_vocab.png"), ("N", "vs_tokens.png")):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for m in methods:
            pts = sorted((r[xkey], r["ms"], r["peak_mib"]) for r in ok if r["method"] == m)
            if not pts:
                continue
            xs = [p[0] for p in pts]
            axes[0].plot(xs, [p[1] for p in pts], "o-", label=m)
            axes[1].plot(xs, [p[2] for p in pts], "o-", label=m)
        for ax, yl in zip(axes, ("forward+backward ms (median)", "peak extra MiB")):
            ax.set_xlabel("vocabulary size V" if xkey == "V" else "tokens N")
            ax.set_ylabel(yl)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{gpu}, bf16, issue shapes, against "
                     f"{'vocabulary' if xkey == 'V' else 'tokens'}")
        fig.tight_layout()
        fig.savefig(os.path.join(out, fname), dpi=110)
        plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="results folder (JSON, PNG)")
    ap.add_argument("--shapes", default=",".join(s for s in SHAPES if s not in EXTRA))
    ap.add_argument("--methods", default=",".join(CE_METHODS))
    ap.add_argument("--rep-ms", type=float, default=400.0)
    ap.add_argument("--warmup-ms", type=float, default=100.0)
    ap.add_argument("--warmup-steps", type=int, default=3,
                    help="whole steps run before any measurement (at Llama-3 size a step is "
                         "~0.1 s, so --warmup-ms alone is one step)")
    ap.add_argument("--no-errors", dest="errors", action="store_false")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for shape in args.shapes.split(","):
        kind = SHAPES[shape][5]
        for name in args.methods.split(","):
            if name not in METHODS[kind]:
                continue
            t0 = time.time()
            try:
                r = measure(name, shape, args)
            except Exception as exc:  # a peer missing or failing is a row, not a crash
                r = {"shape": shape, "method": name, "kind": kind,
                     "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"}
                if os.environ.get("BENCH_TRACE"):
                    traceback.print_exc()
            r["wall_s"] = time.time() - t0
            rows.append(r)
            print_table([r])
            sys.stdout.flush()
            with open(os.path.join(args.out, "results.json"), "w") as f:  # partial results
                json.dump({"rows": rows}, f, indent=1)
            torch.cuda.empty_cache()
            torch._dynamo.reset()
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {"date": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "command": " ".join(sys.argv)}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("\n", meta)
    print_table(rows)
    plots(rows, args.out, meta["gpu"])


if __name__ == "__main__":
    main()
