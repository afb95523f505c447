"""BERT-large masked-LM training steps, unpatched vs ``fused_ce.patch_hf_model``.

Trains a randomly initialised BERT-large-shaped ``BertForMaskedLM`` (24 layers, hidden 1024, vocab
30522; batch 64 x 128 tokens, 15 % of the tokens masked) for a few AdamW steps under bf16 autocast,
once unpatched and once patched, from the same initial weights on the same batches. Checks that
the per-step losses agree, and reports the median step time and the peak memory of each.

    python benchmarks/hf_bert_mlm.py                   # the H200 run (CUDA)
    python benchmarks/hf_bert_mlm.py --small           # tiny config, runs on CPU in seconds

Writes a markdown snippet (``--markdown``, default ``benchmarks/hf_bert_mlm.md``) for
``benchmarks/RESULTS.md`` and prints it. Exits with status 1 if the losses disagree.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402

import fused_ce  # noqa: E402

LARGE = dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
             intermediate_size=4096, max_position_embeddings=512)
SMALL = dict(vocab_size=1031, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=128, max_position_embeddings=128)
MASK_ID = 103  # [MASK] in the bert-base-uncased vocabulary


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny config and batch (CPU smoke test)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (64; --small 8)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (128; --small 32)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (10; --small 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps (3; --small 1)")
    p.add_argument("--mask-prob", type=float, default=0.15)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--rtol", type=float, default=2e-2,
                   help="allowed relative difference of each step's loss (bf16 training)")
    p.add_argument("--device", default=None, help="cuda if available, else cpu")
    p.add_argument("--no-autocast", action="store_true", help="fp32 instead of bf16 autocast")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--markdown", default=os.path.join(os.path.dirname(__file__), "hf_bert_mlm.md"),
                   help="where to write the markdown snippet ('' to skip)")
    args = p.parse_args(argv)
    small = args.small
    args.batch = args.batch or (8 if small else 64)
    args.seq = args.seq or (32 if small else 128)
    args.steps = args.steps or (3 if small else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if small else 3)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.batch < 1 or args.seq < 2 or args.steps < 1 or args.warmup < 0:
        p.error(f"--batch/--seq/--steps/--warmup: expected positive sizes, got "
                f"{args.batch}/{args.seq}/{args.steps}/{args.warmup}")
    if not 0 < args.mask_prob <= 1:
        p.error(f"--mask-prob: expected a fraction in (0, 1], got {args.mask_prob}")
    return args


def make_batches(args, vocab):
    """Random token ids; mask_prob of them masked (80 % [MASK], 10 % random, 10 % kept, as BERT),
    labels -100 elsewhere. The same batches for both variants."""
    g = torch.Generator().manual_seed(args.seed + 1)
    mask_id = MASK_ID if vocab > MASK_ID else 4
    batches = []
    for _ in range(args.warmup + args.steps):
        ids = torch.randint(5, vocab, (args.batch, args.seq), generator=g)
        masked = torch.rand(ids.shape, generator=g) < args.mask_prob
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        roll = torch.rand(ids.shape, generator=g)
        inputs = torch.where(masked & (roll < 0.8), torch.full_like(ids, mask_id), ids)
        inputs = torch.where(masked & (roll >= 0.8) & (roll < 0.9),
                             torch.randint(5, vocab, ids.shape, generator=g), inputs)
        batches.append((inputs, labels, torch.ones_like(ids)))
    return batches


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(variant, args, config, init_state, batches):
    device = args.device
    model = transformers.BertForMaskedLM(config)
    model.load_state_dict(init_state)
    model.to(device).train()
    if variant == "patched":
        fused_ce.patch_hf_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=not args.no_autocast)
    torch.manual_seed(args.seed + 2)  # same dropout masks in both variants
    if device.type == "cuda":
        torch.cuda.empty_cache()
        static = torch.cuda.memory_allocated(device)
    losses, times, logits_seen = [], [], False
    for step, (ids, labels, attn) in enumerate(batches):
        ids, labels, attn = (t.to(device, non_blocking=True) for t in (ids, labels, attn))
        if step == args.warmup and device.type == "cuda":
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            static = torch.cuda.memory_allocated(device)  # params + AdamW state (grads are None)
        sync(device)
        t0 = time.perf_counter()
        with autocast:
            out = model(input_ids=ids, attention_mask=attn, labels=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        dt = time.perf_counter() - t0
        logits_seen |= out.logits is not None
        losses.append(out.loss.item())
        if step >= args.warmup:
            times.append(dt)
    peak = static_mem = None
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        static_mem = static
    del model, opt, out
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(variant=variant, losses=losses, step_ms=1e3 * statistics.median(times),
                peak=peak, static=static_mem, logits=logits_seen)


def gib(n):
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def markdown(args, results, max_rel, ok):
    dev = args.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "CPU"
    cfg = "tiny (--small)" if args.small else "BERT-large (24 x 1024, vocab 30522)"
    base, fused = results
    lines = [
        f"### HF BertForMaskedLM training step: unpatched vs `fused_ce.patch_hf_model`",
        "",
        f"{cfg}, batch {args.batch} x {args.seq} tokens, {args.mask_prob:.0%} masked, "
        f"{'bf16 autocast' if not args.no_autocast else 'fp32'}, AdamW; median of {args.steps} "
        f"steps after {args.warmup} warm-up. {name}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, fused_ce {fused_ce.__version__}.",
        "",
        "| variant | step ms | peak GiB | peak above params+AdamW state GiB | logits built | "
        "final loss |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        extra = None if r["peak"] is None else r["peak"] - r["static"]
        lines.append(f"| {r['variant']} | {r['step_ms']:.1f} | {gib(r['peak'])} | {gib(extra)} | "
                     f"{'yes' if r['logits'] else 'no'} | {r['losses'][-1]:.4f} |")
    speed = base["step_ms"] / fused["step_ms"]
    mem = ""
    if base["peak"] is not None:
        mem = f", peak memory {gib(base['peak'])} -> {gib(fused['peak'])} GiB"
    lines += ["", f"Speed-up {speed:.2f}x{mem}. Per-step losses agree within "
                  f"{max_rel:.2e} relative (limit {args.rtol:g}): {'OK' if ok else 'MISMATCH'}.",
              ""]
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    config = transformers.BertConfig(**(SMALL if args.small else LARGE))
    torch.manual_seed(args.seed)
    init = transformers.BertForMaskedLM(config)
    init_state = {k: v.clone() for k, v in init.state_dict().items()}
    del init
    batches = make_batches(args, config.vocab_size)
    results = []
    for variant in ("unpatched", "patched"):
        r = train(variant, args, config, init_state, batches)
        results.append(r)
        print(f"{variant:>9}: {r['step_ms']:.1f} ms/step, peak {gib(r['peak'])} GiB, losses "
              + " ".join(f"{x:.4f}" for x in r["losses"]), flush=True)
    base, fused = results
    rel = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(base["losses"], fused["losses"])]
    max_rel = max(rel)
    ok = all(math.isfinite(x) for x in fused["losses"]) and max_rel <= args.rtol \
        and not fused["logits"] and base["logits"]
    text = markdown(args, results, max_rel, ok)
    print("\n" + text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
        print(f"wrote {args.markdown}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
