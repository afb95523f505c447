"""Vocab-parallel loss (fused_ce.distributed), DDP and FSDP2 on CPU with gloo.

The multi-process cases run in ONE subprocess (tests/_distributed_worker.py forks 4 gloo ranks;
the 2- and 3-rank vocab-parallel cases use sub-groups), never inside pytest's own process; each
case is then reported here as its own test. Every numeric case compares with the fp64 oracle (tests/oracle.py)
on fresh random inputs; the seed is printed on failure.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import fused_ce
from fused_ce import distributed as fdist
from tests import _distributed_worker as worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = int.from_bytes(os.urandom(3), "little")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed") / "results.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "_distributed_worker.py"), "--seed", str(SEED), "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"distributed worker failed (seed {SEED}, exit {proc.returncode}):\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", worker.case_names())
def test_distributed_case(results, case):
    assert case in results, f"case {case} did not run (seed {SEED})"
    r = results[case]
    assert r["ok"], f"seed {SEED}: {r['msg']}"


def test_every_case_ran(results):
    assert set(results) == set(worker.case_names())


def test_needs_initialized_process_group():
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="process_group: .*init_process_group"):
        fused_ce.linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4),
                                      torch.tensor([0, 1, 2]), process_group=object())


def test_shard_bounds_cover_the_vocabulary():
    for vocab, world in ((10, 3), (7, 4), (128256, 2), (3, 5)):
        bounds = [fdist.shard_bounds(vocab, world, r) for r in range(world)]
        assert bounds[0][0] == 0 and bounds[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        chunks = torch.arange(vocab).chunk(world)
        assert [b - a for a, b in bounds][:len(chunks)] == [len(c) for c in chunks]
