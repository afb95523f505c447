"""Markdown table from one or more bench.py results.json files (later files override rows of
the same shape and method):  python tools/results_table.py a.json b.json"""
import json
import sys

ORDER = ["bert8k", "bert16k", "mlm", "llama3", "gemma2", "logsoftmax"]
METHODS = ["floor", "fused_ce", "fused_ce_stats", "fused_ce_again", "kernels", "fused_ce_sweep", "fused_ce_lowmem", "eager",
           "compile", "liger", "cce"]


def main(paths):
    rows = {}
    for path in paths:
        for r in json.load(open(path))["rows"]:
            rows[(r["shape"], r["method"])] = r
    print("| shape | " + " | ".join(METHODS) + " |")
    print("|---|" + "---|" * len(METHODS))
    for shape in ORDER:
        cells = []
        for m in METHODS:
            r = rows.get((shape, m))
            if r is None:
                cells.append("")
            elif "error" in r:
                cells.append("n/a")
            else:
                e = r["errors"]
                err = ""
                if e:
                    worst = max(v for k, v in e.items() if k != "loss")
                    err = f"<br>loss {e.get('loss', 0):.1e}, grads ≤ {worst:.1e}" if "loss" in e \
                        else f"<br>err {worst:.1e}"
                cells.append(f"{r['ms']:.2f} / {r['peak_mib']:.0f}{err}")
        print(f"| {shape} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
