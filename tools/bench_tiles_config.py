"""benchmarks/bench.py (or another script) with the tile configuration changed (both GPU configs):

    python tools/bench_tiles_config.py '{"split": 1}' --shapes bert8k --methods fused_ce
    python tools/bench_tiles_config.py '{"grad_logits.GROUP_M": 8}' tools/profile_kernels.py ...

The first argument is a JSON object of ``config.CONFIG[...]["logits_tiles"]`` keys, of
"section.key" names (``config.CONFIG[...][section][key]``: "logits.num_stages"), or of
``config`` module names prefixed "config." ('{"config.ROW_CHUNKS_FEW": 2}'); the rest go to
bench.py, or to the script named next. For A/B runs of a variant against the default in one
device call."""
import importlib.util
import json
import os
import runpy
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
_spec = importlib.util.spec_from_file_location("_bench", os.path.join(ROOT, "benchmarks",
                                                                      "bench.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

overrides = json.loads(sys.argv[1])
# as bench.config_switches names them: "config.X" the module's X, "section.key" as it is, a
# bare key the logits_tiles entry
switches = {k[7:] if k.startswith("config.") else k if "." in k else "logits_tiles." + k: v
            for k, v in overrides.items()}
print(f"tile configuration overrides: {overrides}", flush=True)
script = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2].endswith(".py") else None
sys.argv = ([script, *sys.argv[3:]] if script
            else [os.path.join(ROOT, "benchmarks", "bench.py"), *sys.argv[2:]])
with bench.config_switches(switches):
    runpy.run_path(sys.argv[0], run_name="__main__")
