"""A training step's loss captured into a CUDA graph, as users capture it (CUDA only).

    python tools/probe_capture.py --shapes bert8k,mlm [--rounds 3]

Per shape, in one process:

* ``capture_after_eager``: the fused loss (forward + backward through the public API) run
  eagerly on a side stream (the usual warm-up), then captured with ``torch.cuda.graph`` and
  replayed on new values; reports whether capture worked (a Triton kernel loaded for the first
  time while a stream is captured fails: CUDA forbids cuModuleLoadData then), and the
  replayed gradients' errors against fp32 on the new values.
* ``compile_reduce_overhead``: the same step under ``torch.compile(mode="reduce-overhead")``
  (CUDA-graph trees): works or not, and its errors.
* times (``triton.testing.do_bench``'s median ms over ``--rep-ms`` of steps after its
  warm-up, ``--rounds`` alternating rounds): ``eager`` (the default path, host read), ``graph`` (the captured step
  replayed: the row-chunk path without the host read, or whatever the library captures),
  ``graph_one_stream`` (with ``--one-stream``: the same with the next chunk's GEMM not run
  ahead on a second stream, config ``overlap`` off),
  ``graph_sweep`` (the captured step with ``config.ROW_CHUNKS = False``: the vocabulary sweeps),
  and the peak memory of each capture.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import fused_ce  # noqa: E402
from bench import SHAPES, make_inputs  # noqa: E402
from fused_ce.kernels import config  # noqa: E402

MiB = 2**20


def _params(x, w, b):
    return [p for p in (x, w, b) if p is not None]


def _step(x, w, b, t):
    for p in _params(x, w, b):
        p.grad = None
    loss = fused_ce.linear_cross_entropy(x, w, t, linear_bias=b)
    loss.backward()
    return loss


def _refresh(shape, x, w, b, t, seed):
    """New values of ``shape``'s inputs (bench.make_inputs with another seed) in the same
    tensors: what a graph replays on."""
    with torch.no_grad():
        for dst, src in zip((x, w, b, t), make_inputs(shape, seed)):
            if dst is not None:
                dst.copy_(src)


def _errors(x, w, b, t, loss):
    xf = x.detach().float().requires_grad_()
    wf = w.detach().float().requires_grad_()
    bf = None if b is None else b.detach().float().requires_grad_()
    ref = F.cross_entropy(F.linear(xf, wf, bf), t)
    ref.backward()
    rel = lambda a, r: ((a.float() - r).norm() / r.norm()).item()  # noqa: E731
    out = {"loss": abs(loss.item() - ref.item()) / abs(ref.item()), "dx": rel(x.grad, xf.grad),
           "dw": rel(w.grad, wf.grad)}
    if b is not None:
        out["db"] = rel(b.grad, bf.grad)
    return out


def _fmt(e):
    return " ".join(f"{k} {v:.2e}" for k, v in e.items())


def _capture(step, warmup_steps=2):
    """(graph, loss, peak MiB of the capture) of ``step`` after ``warmup_steps`` eager runs on a
    side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup_steps):
            step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()
    torch.cuda.synchronize()
    return graph, loss, (torch.cuda.max_memory_allocated() - base) / MiB


def probe(shape, args):
    n, h, v, bias, frac, kind = SHAPES[shape]
    x, w, b, t = make_inputs(shape)
    step = lambda: _step(x, w, b, t)  # noqa: E731
    print(f"== {shape}: N {n} H {h} V {v} bias {bias} valid {frac}", flush=True)
    graphs = {}
    tiles = config.GPU["logits_tiles"]
    variants = (("graph", True, tiles["overlap"]), ("graph_one_stream", True, False),
                ("graph_sweep", False, tiles["overlap"]))
    for name, row_chunks, overlap in variants if args.one_stream else (variants[0],
                                                                        variants[2]):
        config.ROW_CHUNKS = row_chunks
        default_overlap, tiles["overlap"] = tiles["overlap"], overlap
        try:
            graph, loss, peak = _capture(step)
            _refresh(shape, x, w, b, t, 1)
            graph.replay()
            torch.cuda.synchronize()
            print(f"{name}: capture after eager warm-up OK, peak {peak:.0f} MiB, replayed on "
                  f"new values: {_fmt(_errors(x, w, b, t, loss))}", flush=True)
            graphs[name] = graph
        except Exception as err:  # noqa: BLE001 (reported)
            print(f"{name}: capture FAILED: {type(err).__name__}: {str(err)[:300]}", flush=True)
            traceback.print_exc(limit=3)
            torch.cuda.synchronize()
        finally:
            config.ROW_CHUNKS = True
            tiles["overlap"] = default_overlap
    if args.compile:
        try:
            torch._dynamo.reset()
            f = torch.compile(lambda x, w, b, t: _step(x, w, b, t), mode="reduce-overhead")
            for i in range(4):
                torch.compiler.cudagraph_mark_step_begin()
                loss = f(x, w, b, t)
            _refresh(shape, x, w, b, t, 2)
            torch.compiler.cudagraph_mark_step_begin()
            loss = f(x, w, b, t)
            torch.cuda.synchronize()
            print(f"compile_reduce_overhead: OK, new values: {_fmt(_errors(x, w, b, t, loss))}",
                  flush=True)
        except Exception as err:  # noqa: BLE001 (reported)
            print(f"compile_reduce_overhead: FAILED: {type(err).__name__}: {str(err)[:300]}",
                  flush=True)
            traceback.print_exc(limit=3)
    methods = {"eager": step, **{k: g.replay for k, g in graphs.items()}}
    res = {k: [] for k in methods}
    for _ in range(args.rounds):
        for k, fn in methods.items():
            res[k].append(triton.testing.do_bench(fn, warmup=50, rep=args.rep_ms,
                                                  return_mode="median"))
    print(" | ".join(f"{k} {' / '.join(f'{t:.3f}' for t in ts)} ms" for k, ts in res.items()),
          flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="bert8k,mlm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep-ms", type=int, default=300, help="do_bench's measuring time")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--one-stream", action="store_true",
                    help="also capture with the tile configuration's overlap off (graph_one_stream)")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for shape in args.shapes.split(","):
        probe(shape, args)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
