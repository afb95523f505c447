"""benchmarks/bench.py with the epilogue GEMM's tile configuration changed (both GPU configs):

    python tools/bench_tiles_config.py '{"split": 1}' --shapes bert8k --methods fused_ce

The first argument is a JSON object of ``config.CONFIG[...]["logits_tiles"]`` keys, or of
``config`` module names prefixed "config." ('{"config.ROW_CHUNKS_FEW": 2}'); the rest go to
bench.py. For A/B runs of a variant against the default in one device call."""
import json
import os
import runpy
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from fused_ce.kernels import config  # noqa: E402

overrides = json.loads(sys.argv[1])
for key in [k for k in overrides if k.startswith("config.")]:
    if not hasattr(config, key[7:]):
        raise SystemExit(f"unknown config name: {key}")
    setattr(config, key[7:], overrides.pop(key))
for name in ("gpu", "gpu_wide"):
    unknown = set(overrides) - set(config.CONFIG[name]["logits_tiles"])
    if unknown:
        raise SystemExit(f"unknown logits_tiles keys: {sorted(unknown)}")
    config.CONFIG[name]["logits_tiles"].update(overrides)
print(f"logits_tiles overrides: {overrides}", flush=True)
sys.argv = [os.path.join(ROOT, "benchmarks", "bench.py"), *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
