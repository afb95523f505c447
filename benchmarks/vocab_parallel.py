"""Vocab-parallel fused loss on 2 GPUs (NCCL) vs the single-GPU fused loss and eager PyTorch.

    python benchmarks/vocab_parallel.py                 # 2 GPUs, 16384 x 4096 x 128256 bf16
    python benchmarks/vocab_parallel.py --cpu           # 2 CPU processes (gloo), tiny shapes

Each rank holds one half of the head's rows (``fused_ce.distributed.shard_bounds``) and the same
``x``/targets. Per rank it reports forward+backward time (median) and peak extra memory (the
maximum allocated during the step minus what was allocated before it, gradients included) for:

* ``vocab-parallel``: ``linear_cross_entropy(x, W_r, t, linear_bias=b_r, process_group=WORLD)``;
* ``single fused``:   ``linear_cross_entropy(x, W, t, linear_bias=b)`` with the whole head;
* ``eager``:          ``F.cross_entropy(F.linear(x, W, b), t)`` (the logits in bf16).

Accuracy: each result's loss, ``dx``, this rank's ``dW``/``db`` rows against an fp32 single-device
reference (the fused loss on fp32 copies), as relative Frobenius errors, and vocab-parallel vs
single fused directly. ``--out FILE`` writes everything as JSON.

NVLink SHARP / multicast stay off (the machines' fabric is not set up for it): the script sets
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 before any process
group exists.
"""

from __future__ import annotations

import os

# Before torch.distributed / NCCL initialize, in this process and (inherited) in the workers.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fused_ce  # noqa: E402
from fused_ce.distributed import shard_bounds  # noqa: E402

WORLD = 2


def _rel(got, want):
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, warmup, iters):
        times = []
        for i in range(warmup + iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                fn()
                ms = (time.perf_counter() - t0) * 1e3
            if i >= warmup:
                times.append(ms)
        return statistics.median(times)


def _peak_extra_mib(fn, device):
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def _worker(rank, args, init):
    cuda = not args.cpu
    if cuda:
        gpu = 0 if args.one_gpu else rank
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // WORLD))
        device = torch.device("cpu")
    nccl = cuda and not args.one_gpu  # NCCL refuses two ranks on one GPU
    dist.init_process_group("nccl" if nccl else "gloo", init_method=init, rank=rank,
                            world_size=WORLD, device_id=device if nccl else None)
    reports = run_benchmark(args, dist.group.WORLD, device)
    if rank == 0:
        _print(reports)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(reports, f, indent=1)
    dist.destroy_process_group()


def run_benchmark(args, group, device):
    """The measurements on this rank of ``group`` (2 ranks); returns every rank's report."""
    rank = dist.get_rank(group)
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    n, h, v = args.n, args.h, args.v
    g = torch.Generator(device=device).manual_seed(args.seed)  # same data on every rank
    x = torch.randn(n, h, generator=g, device=device, dtype=torch.float32).to(dtype)
    W = (torch.randn(v, h, generator=g, device=device, dtype=torch.float32) / h ** 0.5).to(dtype)
    b = (torch.randn(v, generator=g, device=device, dtype=torch.float32) * 0.1).to(dtype) \
        if args.bias else None
    t = torch.randint(0, v, (n,), generator=g, device=device)
    lo, hi = shard_bounds(v, WORLD, rank)

    W_r = W[lo:hi].clone().requires_grad_()
    b_r = b[lo:hi].clone().requires_grad_() if b is not None else None
    W_full = W.requires_grad_()
    b_full = b.requires_grad_() if b is not None else None
    xg = x.clone().requires_grad_()
    params = [xg, W_r, W_full] + [p for p in (b_r, b_full) if p is not None]

    def zero():
        for p in params:
            p.grad = None

    def vocab_parallel():
        zero()
        loss = fused_ce.linear_cross_entropy(xg, W_r, t, linear_bias=b_r,
                                             process_group=group)
        loss.backward()
        return loss

    def single():
        zero()
        loss = fused_ce.linear_cross_entropy(xg, W_full, t, linear_bias=b_full)
        loss.backward()
        return loss

    def eager():
        zero()
        loss = F.cross_entropy(F.linear(xg, W_full, b_full), t)
        loss.backward()
        return loss

    # fp32 reference: single device, fp32 inputs, the chunked PyTorch path (no TF32)
    x32 = x.float().requires_grad_()
    W32 = W.detach().float().requires_grad_()
    b32 = b.detach().float().requires_grad_() if b is not None else None
    backend = os.environ.get("FUSED_CE_BACKEND")
    os.environ["FUSED_CE_BACKEND"] = "torch"
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = fused_ce.linear_cross_entropy(x32, W32, t, linear_bias=b32)
        ref.backward()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        if backend is None:
            os.environ.pop("FUSED_CE_BACKEND")
        else:
            os.environ["FUSED_CE_BACKEND"] = backend
    ref_grads = {"loss": ref.detach(), "dx": x32.grad, "dW": W32.grad[lo:hi],
                 "db": None if b32 is None else b32.grad[lo:hi]}
    del W32, b32, x32
    if cuda:
        torch.cuda.empty_cache()

    timer = Timer(device)
    report = {"rank": rank, "shape": [n, h, v], "dtype": args.dtype, "rows": [lo, hi],
              "device": str(device) + (" (shared by both ranks: times not meaningful)"
                                       if getattr(args, "one_gpu", False) else ""),
              "backend": dist.get_backend(group)}
    results = {}
    for name, fn in (("vocab-parallel", vocab_parallel), ("single fused", single), ("eager", eager)):
        if name == "eager" and args.skip_eager:
            continue
        loss = fn()
        grads = {"loss": loss.detach(), "dx": xg.grad.clone(),
                 "dW": (W_r.grad if name == "vocab-parallel" else W_full.grad[lo:hi]).clone(),
                 "db": None if b is None else
                 (b_r.grad if name == "vocab-parallel" else b_full.grad[lo:hi]).clone()}
        errs = {k: _rel(grads[k], ref_grads[k]) for k in grads if grads[k] is not None}
        dist.barrier(group=group)
        ms = timer(fn, args.warmup, args.iters)
        dist.barrier(group=group)
        mib = _peak_extra_mib(fn, device)
        results[name] = grads
        report[name] = {"ms": ms, "peak_extra_mib": mib, "rel_err_vs_fp32": errs}
    vp, sg = results["vocab-parallel"], results["single fused"]
    report["vocab-parallel vs single fused"] = {
        k: _rel(vp[k], sg[k]) for k in vp if vp[k] is not None}
    reports = [None] * WORLD
    dist.all_gather_object(reports, report, group=group)
    return reports


def _print(reports):
    r0 = reports[0]
    n, h, v = r0["shape"]
    print(f"{n}x{h}x{v} {r0['dtype']}, {WORLD} ranks ({r0['backend']}; "
          f"{[r['device'] for r in reports]}), head rows per rank: {[r['rows'] for r in reports]}")
    print(f"{'rank':>4} {'method':<16} {'ms':>9} {'peak MiB':>9}   rel. err vs fp32 (loss, dx, dW, db)")
    for r in reports:
        for name in ("vocab-parallel", "single fused", "eager"):
            if name not in r:
                continue
            e = r[name]
            mib = "n/a" if e["peak_extra_mib"] is None else f"{e['peak_extra_mib']:.0f}"
            errs = ", ".join(f"{k} {val:.1e}" for k, val in e["rel_err_vs_fp32"].items())
            print(f"{r['rank']:>4} {name:<16} {e['ms']:>9.2f} {mib:>9}   {errs}")
        d = ", ".join(f"{k} {val:.1e}" for k, val in r["vocab-parallel vs single fused"].items())
        print(f"{r['rank']:>4} vocab-parallel vs single fused: {d}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="2 CPU processes over gloo, tiny default shapes")
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--h", type=int, default=None)
    p.add_argument("--v", type=int, default=None)
    p.add_argument("--dtype", default=None, help="bfloat16 (GPU default) / float32 (CPU default)")
    p.add_argument("--no-bias", dest="bias", action="store_false")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--skip-eager", action="store_true")
    p.add_argument("--one-gpu", action="store_true",
                   help="both ranks on GPU 0 over gloo: checks results and per-process memory at "
                        "full size on a 1-GPU machine; the times are NOT meaningful (shared GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the per-rank results as JSON")
    args = p.parse_args(argv)
    defaults = dict(n=64, h=32, v=1001, dtype="float32", iters=3, warmup=1) if args.cpu else \
        dict(n=16384, h=4096, v=128256, dtype="bfloat16", iters=10, warmup=3)
    for k, val in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, val)
    return args


def main(argv=None):
    args = parse_args(argv)
    if not args.cpu and torch.cuda.device_count() < (1 if args.one_gpu else WORLD):
        sys.exit(f"needs {WORLD} GPUs (found {torch.cuda.device_count()}); use --cpu for a tiny "
                 f"gloo run")
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        method = "fork" if args.cpu and "fork" in mp.get_all_start_methods() else "spawn"
        mp.start_processes(_worker, args=(args, init), nprocs=WORLD, start_method=method)


if __name__ == "__main__":
    main()
