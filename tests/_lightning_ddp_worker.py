"""Multi-process Lightning run for tests/test_lightning.py, launched as its own script (never from
inside pytest's process: ``strategy="ddp"`` relaunches the command line).

    python tests/_lightning_ddp_worker.py OUT_DIR STRATEGY NAMESPACE BUILD_IN FUSED [PRECISION]

Trains the tiny BERT of tests/_lightning_models.py for 4 steps on 2 CPU processes (gloo) and
writes, per rank, ``OUT_DIR/rank{r}.json`` (per-step losses of that rank, the callback's report)
and, from rank 0, ``OUT_DIR/weights.pt`` (the final state dict, the same on every rank).
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    out, strategy, namespace, build_in, fused = sys.argv[1:6]
    precision = sys.argv[6] if len(sys.argv) > 6 else "32-true"
    Path(out).mkdir(parents=True, exist_ok=True)
    from tests import _lightning_models as models

    models.train(namespace, fused=fused == "1", build_in=build_in, steps=4, strategy=strategy,
                 devices=2, precision=precision, result_dir=out)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
