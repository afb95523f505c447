"""Probe (twenty-fifth session): db of the fp32-logits row-chunk path (MLM: 2458 valid rows,
one chunk), the column sums of D, a bf16 view over the first half of each fp32 row of Z (row
stride 2 * v_pad), rounded up to k = 2464 rows (zero rows). GPU microseconds per variant
(median of 50, CUDA events):

    python tools/probe_db_strided.py
"""
import statistics

import torch

k, v, vp = 2464, 30522, 30528
z = torch.randn(k, vp, device="cuda")
d = z.view(torch.bfloat16)
ones = torch.ones(8, k, device="cuda", dtype=torch.bfloat16)
db = torch.empty(8, vp, device="cuda")


def timed(f, reps=50):
    for _ in range(5):
        f()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        b.synchronize()
        ts.append(1e3 * a.elapsed_time(b))
    return statistics.median(ts)


cases = {
    "ones(1, k) @ D[:, :V] (now)": lambda: torch.addmm(db[:1, :v], ones[:1], d[:, :v], beta=0.0,
                                                       out_dtype=torch.float32, out=db[:1, :v]),
    "ones(1, k) @ D[:, :v_pad]": lambda: torch.addmm(db[:1], ones[:1], d[:, :vp], beta=0.0,
                                                     out_dtype=torch.float32, out=db[:1]),
    "ones(8, k) @ D[:, :V]": lambda: torch.addmm(db[:, :v], ones, d[:, :v], beta=0.0,
                                                 out_dtype=torch.float32, out=db[:, :v]),
    "ones(8, k) @ D[:, :v_pad]": lambda: torch.addmm(db, ones, d[:, :vp], beta=0.0,
                                                     out_dtype=torch.float32, out=db),
    "sum(D[:, :V], 0, fp32)": lambda: torch.sum(d[:, :v], 0, dtype=torch.float32, out=db[0, :v]),
}
ref = d[:, :v].float().sum(0)
for name, f in cases.items():
    us = timed(f)
    err = ((db[0, :v] - ref).abs().max() / ref.abs().max()).item()
    print(f"{us:8.1f} us  {name}  (max err {err:.1e})")
