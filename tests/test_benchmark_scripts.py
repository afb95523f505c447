"""The benchmark scripts' method closures and measurement on CPU at tiny sizes: every method
computes the loss it claims (against float64 PyTorch), so the scripts do not rot between GPU
sessions. No timing is asserted."""

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name, folder="benchmarks"):
    spec = importlib.util.spec_from_file_location(f"_{folder}_{name}",
                                                  os.path.join(ROOT, folder, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, 70, generator=g).requires_grad_()
    w = (torch.randn(101, 70, generator=g) / 8).requires_grad_()
    b = (torch.randn(101, generator=g) * 5).requires_grad_()  # a large bias
    t = torch.randint(0, 101, (9,), generator=g)
    t[[0, 4]] = -100
    return x, w, b, t


def _loss64(x, w, b, t):
    return F.cross_entropy(F.linear(x.double(), w.double(), b.double()), t)


@pytest.mark.parametrize("method", ["fused_ce", "fused_ce_lowmem", "fused_ce_fp32z",
                                    "fused_ce_epilogue", "fused_ce_rowref", "fused_ce_dpass",
                                    "fused_ce_rowstats", "eager", "torch_lce"])
def test_bench_methods_compute_the_loss(method):
    bench = _load("bench")
    x, w, b, t = _inputs(int(torch.randint(0, 2**31, ())))
    if method == "torch_lce" and not hasattr(F, "linear_cross_entropy"):
        with pytest.raises(NotImplementedError, match="no F.linear_cross_entropy"):
            bench.method_fn(method, "ce", x, w, b, t)
        return
    loss = bench.method_fn(method, "ce", x, w, b, t)()
    ref = _loss64(x, w, b, t)
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())


@pytest.mark.parametrize("method", ["fused_ce", "fused_ce_lowmem", "fused_ce_fp32z",
                                    "fused_ce_epilogue", "fused_ce_rowref", "eager"])
def test_bench_softcapped_methods_and_reference(method):
    """The softcapped shape's closures (bench.SOFTCAP, gemma2_softcap) compute the softcapped
    loss, and reference_fp32 takes the same softcap: loss and gradients of a method against it
    are those of float64 PyTorch's c tanh(z / c) logits."""
    bench = _load("bench")
    assert bench.SOFTCAP["gemma2_softcap"] == 30.0 and "gemma2_softcap" in bench.SHAPES
    x, w, b, t = _inputs(int(torch.randint(0, 2**31, ())))
    c = 2.0  # (most of these logits in the cap's bend)
    fn = bench.method_fn(method, "ce", x, w, b, t, c)
    z = F.linear(x.double(), w.double(), b.double())
    ref = F.cross_entropy(c * torch.tanh(z / c), t)
    assert abs(fn().item() - ref.item()) <= 1e-5 * abs(ref.item())
    err = bench.errors(method, "ce", fn, [x, w, b], bench.reference_fp32("ce", x, w, b, t, c))
    assert set(err) == {"loss", "dx", "dw", "db"} and max(err.values()) <= 1e-5
    with pytest.raises(NotImplementedError, match="softcap"):
        bench.method_fn("fused_ce", "eval", x, w, b, t, c)


@pytest.mark.parametrize("method", ["fused_ce", "fused_ce_rowstats", "eager"])
def test_bench_eval_step_is_forward_only(method):
    """The ``_eval`` shapes' step: the loss under torch.no_grad (no graph, no gradients), and
    their error against the fp32 reference is the loss's alone."""
    bench = _load("bench")
    x, w, b, t = _inputs(int(torch.randint(0, 2**31, ())))
    fn = bench.method_fn(method, "eval", x, w, b, t)
    loss = bench.forward_backward(method, "eval", fn, [x, w, b])()
    assert loss.grad_fn is None and x.grad is None and w.grad is None
    ref = _loss64(x, w, b, t)
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    err = bench.errors(method, "eval", fn, [x, w, b], bench.reference_fp32("eval", x, w, b, t))
    assert set(err) == {"loss"} and err["loss"] <= 1e-5


@pytest.mark.parametrize("method", ["fused_ce", "torch_lce"])
def test_cpu_peers_measures_one(monkeypatch, method):
    cpu_peers = _load("cpu_peers")
    monkeypatch.setitem(cpu_peers.SHAPES, "tiny", (9, 70, 101, True, 0.5))
    if method == "torch_lce" and not hasattr(F, "linear_cross_entropy"):
        with pytest.raises(NotImplementedError, match="no F.linear_cross_entropy"):
            cpu_peers.measure_one("tiny", method, reps=2)
        return
    r = cpu_peers.measure_one("tiny", method, reps=2)
    assert r["shape"] == "tiny" and r["method"] == method and len(r["ms_all"]) == 2
    assert r["ms"] > 0 and r["peak_mib"] >= 0
    assert set(r["errors"]) == {"loss", "dx", "dw", "db"}
    assert all(0 <= e <= 1e-5 for e in r["errors"].values()), r["errors"]


def _switch(name):
    """The current value of bench.config_switches' name: a config module name, or a
    "section.key" entry of both GPU tile configurations (checked to agree)."""
    from fused_ce.kernels import config
    section, _, key = name.rpartition(".")
    if not section:
        return getattr(config, key)
    values = {config.CONFIG[c][section][key] for c in ("gpu", "gpu_wide")}
    assert len(values) == 1, values
    return values.pop()


@pytest.mark.parametrize("method,switch,want", [
    ("fused_ce_lowmem_one_sweep", "LOW_MEMORY_ONE_SWEEP", True),
    ("fused_ce_lowmem_blocks", "LOW_MEMORY_ONE_SWEEP", False),
    ("fused_ce_rowref", "logits_tiles.row_ref", True),
    ("fused_ce_dpass", "logits_tiles.row_ref", False)])
def test_config_variants_hold_through_the_backward(method, switch, want):
    """A config variant's switches (module names or tile-configuration entries) stay set
    through the step's backward pass (low_memory computes its gradients there), and are the
    default's again after the step."""
    bench = _load("bench")
    default = _switch(switch)
    seen = []

    class Probe(torch.autograd.Function):  # records the switch in the forward and backward
        @staticmethod
        def forward(ctx, v):
            seen.append(("forward", _switch(switch)))
            return v.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(("backward", _switch(switch)))
            return g

    x, w, b, t = _inputs(int(torch.randint(0, 2**31, ())))
    fn = bench.method_fn(method, "ce", x, w, b, t)
    probed = bench._with_config(lambda: Probe.apply(fn()), **fn.switches)
    loss = bench.forward_backward(method, "ce", probed, [x, w, b])()
    assert seen == [("forward", want), ("backward", want)]
    assert _switch(switch) == default
    torch.testing.assert_close(loss.double(), _loss64(x, w, b, t), rtol=1e-5, atol=1e-6)
    assert x.grad is not None and w.grad is not None


def test_bench_plots_name_the_device(tmp_path, monkeypatch):
    """bench.py's plots: both PNGs written from a table's rows (rows with errors, partial
    batches and log-softmax rows left out), titled with the GPU the rows came from."""
    pytest.importorskip("matplotlib")
    import matplotlib.figure
    bench = _load("bench")
    titles = []
    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle",
                        lambda self, text, **kw: titles.append(text))
    row = dict(kind="ce", valid_frac=1.0, N=8192, V=30258, ms=3.1, peak_mib=465.0)
    rows = [dict(row, method="fused_ce"), dict(row, method="floor", ms=2.3, peak_mib=75.0),
            dict(row, method="fused_ce", V=128256, N=16384, ms=80.0, peak_mib=3390.0),
            dict(row, method="fused_ce", valid_frac=0.15),
            {"shape": "bert8k", "method": "liger", "kind": "ce", "error": "ImportError"}]
    bench.plots(rows, str(tmp_path), "NVIDIA H100 80GB HBM3")
    assert sorted(os.listdir(tmp_path)) == ["vs_tokens.png", "vs_vocab.png"]
    assert all(p.stat().st_size > 0 for p in tmp_path.iterdir())
    assert len(titles) == 2 and all(t.startswith("NVIDIA H100 80GB HBM3, bf16") for t in titles)


def test_bench_tiles_config_sets_switches_for_the_script(tmp_path):
    """tools/bench_tiles_config.py runs the named script with its overrides set (a bare key in
    logits_tiles, "section.key", "config." module names) in both GPU tile configurations; an
    unknown name fails with its name before the script runs."""
    import subprocess
    import sys
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys\nfrom fused_ce.kernels import config\n"
        "print('args', sys.argv[1:])\n"
        "for c in ('gpu', 'gpu_wide'):\n"
        "    print(c, config.CONFIG[c]['logits_tiles']['split'],"
        " config.CONFIG[c]['grad_logits']['GROUP_M'])\n"
        "print('rows', config.ROW_CHUNKS_FEW)\n")
    tool = os.path.join(ROOT, "tools", "bench_tiles_config.py")

    def run(overrides):
        return subprocess.run([sys.executable, tool, overrides, str(probe), "--x", "1"],
                              capture_output=True, text=True, cwd=ROOT)
    from fused_ce.kernels import config
    split = 1 + config.CONFIG["gpu"]["logits_tiles"]["split"]
    group = 3 + config.CONFIG["gpu"]["grad_logits"]["GROUP_M"]
    rows = 5 + config.ROW_CHUNKS_FEW
    done = run(f'{{"split": {split}, "grad_logits.GROUP_M": {group}, '
               f'"config.ROW_CHUNKS_FEW": {rows}}}')
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "args ['--x', '1']" in lines
    assert f"gpu {split} {group}" in lines and f"gpu_wide {split} {group}" in lines
    assert f"rows {rows}" in lines
    bad = run('{"grad_logits.NO_SUCH_KEY": 1}')
    assert bad.returncode != 0 and "grad_logits.NO_SUCH_KEY" in bad.stderr
    assert "args" not in bad.stdout


@pytest.mark.parametrize("low_memory", [False, True])
def test_ab_in_process_steps_compute_the_same_loss_in_both_trees(low_memory, monkeypatch):
    """tools/ab_in_process.py: a renamed copy of this tree (the "old" side) imported beside
    fused_ce, and both trees' steps (``--low-memory``: low_memory=True) give float64 PyTorch's
    loss and gradients, so an A/B times the same computation on both sides."""
    import sys
    monkeypatch.setattr(sys, "path", list(sys.path))  # the tool adds its folders and the copy's
    ab = _load("ab_in_process", "tools")
    old = ab.import_renamed(ROOT)
    assert old.__name__ == "fused_ce_old" and old.linear_cross_entropy.__module__.startswith(
        "fused_ce_old")
    x, w, b, t = _inputs(7)
    ref = _loss64(x, w, b, t)
    ref_grads = torch.autograd.grad(ref, (x, w, b))  # float64 sums, rounded to fp32
    for pkg in (old, ab.fused_ce):
        loss = ab.stepper(pkg, x, w, b, t, "ce", low_memory=low_memory)()
        torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
        for p, g in zip((x, w, b), ref_grads):
            torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)


def test_steps_back_to_back_prepared_step_uses_one_scan_per_step(monkeypatch):
    """tools/steps_back_to_back.py's ``fused_ce_prepared``: each step takes one of the scans
    ``prepare`` made (fused_ce.prepare_targets) and gives float64 PyTorch's loss and gradients;
    a step beyond them fails instead of reusing one; ``timed_steps`` prepares as many as it
    times."""
    import sys
    monkeypatch.setattr(sys, "path", list(sys.path))  # the tool adds its folders
    tool = _load("steps_back_to_back", "tools")
    x, w, b, t = _inputs(int(torch.randint(0, 2**31, ())))
    ref = _loss64(x, w, b, t)
    ref_grads = torch.autograd.grad(ref, (x, w, b))
    step = tool.make_step("fused_ce_prepared", "ce", x, w, b, t, [x, w, b])
    step.prepare(2)
    for _ in range(2):
        loss = step()
        torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
        for p, g in zip((x, w, b), ref_grads):
            torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
    with pytest.raises(IndexError):
        step()
    assert tool.timed_steps(step, 3) > 0  # makes its own three scans, uses them all
    with pytest.raises(IndexError):
        step()


def test_steps_back_to_back_clock_means_keep_samples_inside_the_windows(monkeypatch):
    """tools/steps_back_to_back.py's ``--clocks``: the mean SM clock and power of nvidia-smi's
    samples inside a method's timed windows, samples outside them, headers and "[N/A]" fields
    left out; no sample in a window gives None."""
    import datetime
    import sys
    monkeypatch.setattr(sys, "path", list(sys.path))
    tool = _load("steps_back_to_back", "tools")
    t = datetime.datetime(2026, 12, 7, 17, 0, 0)
    s = datetime.timedelta(seconds=1)
    lines = ["timestamp, clocks.current.sm [MHz], power.draw [W]\n",
             "2026/12/07 17:00:00.500, 1980, 600.0\n",   # in window 1
             "2026/12/07 17:00:02.000, 1500, 700.0\n",   # between the windows
             "2026/12/07 17:00:03.250, 1780, 650.5\n",   # in window 2
             "2026/12/07 17:00:03.300, [N/A], 650.0\n",  # no clock: left out
             "2026/12/07 17:00:03.4"]                    # cut off: left out
    mhz, watts, n = tool.clock_means(lines, [(t, t + s), (t + 3 * s, t + 4 * s)])
    assert n == 2 and mhz == (1980 + 1780) / 2 and watts == (600.0 + 650.5) / 2
    assert tool.clock_means(lines, [(t + 10 * s, t + 11 * s)]) is None
