"""One device call: where a BERT-large MLM training step spends its time, per head variant.

    python tools/profile_hf_step.py [--variants unpatched,rows,sweep] [--steps 10] [--tables]

Builds the model of benchmarks/hf_bert_mlm.py (random BERT-large, batch 64 x 128, 15 % masked,
bf16 autocast, fused AdamW), runs warm-up steps, then for each variant prints the median wall
time per step (synchronized at the step's ends, like the benchmark), the GPU busy time per
step (sum of kernel durations from torch.profiler, overlaps merged), the GPU idle time, and the
top kernels and host operators. ``rows`` is the default patched head, ``sweep`` the patched
head with ``config.ROW_CHUNKS = False``.
"""
import argparse
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import hf_bert_mlm  # noqa: E402
import transformers  # noqa: E402

import fused_ce  # noqa: E402
from fused_ce import _validation  # noqa: E402
from fused_ce.kernels import config as kconfig  # noqa: E402

_CANNOT_SYNC = _validation._cannot_sync


def busy_ms(events):
    """Union of the kernels' [start, end) intervals, in ms."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    total, cur_s, cur_e = 0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total / 1e3


def gaps(kernels, steps, top=8):
    """The largest idle stretches of the GPU between kernels, with their neighbours."""
    ev = sorted(kernels, key=lambda e: e.time_range.start)
    out, end, last = [], None, None
    for e in ev:
        if end is not None and e.time_range.start - end > 0:
            out.append(((e.time_range.start - end) / 1e3, last.name[:50], e.name[:50]))
        if end is None or e.time_range.end > end:
            end, last = e.time_range.end, e
    out.sort(reverse=True)
    big = sum(g for g, _, _ in out if g > 0.2)
    print(f"idle in gaps > 0.2 ms: {big / steps:.1f} ms/step; largest:")
    for g, a, b in out[:top]:
        print(f"  {g:7.2f} ms after {a!r} before {b!r}")


def run(variant, args, cfg, init_state, batches):
    kconfig.ROW_CHUNKS = not variant.startswith("sweep")
    # sweep_async: the target check as a device assert (no host read): the sync-free sweep
    _validation._cannot_sync = (lambda: True) if variant == "sweep_async" else _CANNOT_SYNC
    model = transformers.BertForMaskedLM(cfg)
    model.load_state_dict(init_state)
    model.cuda().train()
    if not variant.startswith("unpatched"):
        fused_ce.patch_hf_model(model)
    if variant == "unpatched_sync":  # the row-chunk path's host read, without its work
        model.cls.register_forward_hook(lambda *a: torch.cuda.synchronize())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(ids, labels, attn):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=ids, attention_mask=attn, labels=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    dev = [tuple(t.cuda() for t in b) for b in batches]
    times = []
    for i, b in enumerate(dev[:args.warmup + args.steps]):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(*b)
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(1e3 * (time.perf_counter() - t0))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for b in dev[:args.profile_steps]:
            torch.cuda.synchronize()
            step(*b)
            torch.cuda.synchronize()
        pwall = 1e3 * (time.perf_counter() - t0) / args.profile_steps
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = busy_ms(kernels) / args.profile_steps
    wall = statistics.median(times)
    print(f"\n=== {variant}: wall {wall:.1f} ms/step (median of {args.steps}, min "
          f"{min(times):.1f}); profiled: {pwall:.1f} ms/step, GPU busy {busy:.1f}, idle "
          f"{pwall - busy:.1f}; {len(kernels) / args.profile_steps:.0f} kernels/step", flush=True)
    gaps(kernels, args.profile_steps)
    if not args.tables:
        return cleanup(model, opt)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows,
                                    max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                    max_name_column_width=60))
    if args.trace:
        prof.export_chrome_trace(os.path.join(args.trace, f"trace_{variant}.json"))
    cleanup(model, opt)


def cleanup(model, opt):
    del model, opt
    torch.cuda.empty_cache()
    kconfig.ROW_CHUNKS = True
    _validation._cannot_sync = _CANNOT_SYNC


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="unpatched,rows,sweep")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--rows", type=int, default=18)
    p.add_argument("--trace", default="", help="folder for chrome traces ('' to skip)")
    p.add_argument("--tables", action="store_true", help="print the operator tables")
    args = p.parse_args()
    hargs = hf_bert_mlm.parse_args(["--steps", str(args.steps), "--warmup", str(args.warmup)])
    cfg = transformers.BertConfig(**hf_bert_mlm.LARGE)
    torch.manual_seed(0)
    init = transformers.BertForMaskedLM(cfg)
    init_state = {k: v.clone() for k, v in init.state_dict().items()}
    del init
    batches = hf_bert_mlm.make_batches(hargs, cfg.vocab_size)
    for v in args.variants.split(","):
        run(v, args, cfg, init_state, batches)


if __name__ == "__main__":
    main()
