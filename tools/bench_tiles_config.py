"""benchmarks/bench.py (or another script) with the tile configuration changed (both GPU configs):

    python tools/bench_tiles_config.py '{"split": 1}' --shapes bert8k --methods fused_ce
    python tools/bench_tiles_config.py '{"grad_logits.GROUP_M": 8}' tools/profile_kernels.py ...

The first argument is a JSON object of ``config.CONFIG[...]["logits_tiles"]`` keys, of
"section.key" names (``config.CONFIG[...][section][key]``: "logits.num_stages"), or of
``config`` module names prefixed "config." ('{"config.ROW_CHUNKS_FEW": 2}'); the rest go to
bench.py, or to the script named next. For A/B runs of a variant against the default in one
device call."""
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
    cfg = config.CONFIG[name] = {k: dict(v) if isinstance(v, dict) else v
                                 for k, v in config.CONFIG[name].items()}
    for key, value in overrides.items():
        section, _, sub = key.rpartition(".")
        part = cfg[section or "logits_tiles"] if (section or "logits_tiles") in cfg else None
        if part is None or sub not in part:
            raise SystemExit(f"unknown tile configuration key: {key}")
        part[sub] = value
print(f"tile configuration overrides: {overrides}", flush=True)
script = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2].endswith(".py") else None
sys.argv = ([script, *sys.argv[3:]] if script
            else [os.path.join(ROOT, "benchmarks", "bench.py"), *sys.argv[2:]])
runpy.run_path(sys.argv[0], run_name="__main__")
