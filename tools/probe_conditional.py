"""Whether this torch captures CUDA-graph IF nodes (``CUDAGraph.begin_capture_to_if_node``) and
what they cost: a body with a cuBLAS product, a Triton kernel, an allocation and a side-stream
fork, run or skipped on replay by a predicate computed on the device (the count of valid rows
that a captured MLM step's later row chunks would test). Prints one line per check."""
import torch
import triton
import triton.language as tl


@triton.jit
def _add_one(ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + i, tl.load(ptr + i, mask=i < n) + 1, mask=i < n)


def if_body(pred):
    g = torch.cuda.CUDAGraph.get_currently_capturing_graph()
    g.begin_capture_to_if_node(pred)
    return g


def main():
    g_cls = torch.cuda.CUDAGraph
    has = all(hasattr(g_cls, a) for a in ("get_currently_capturing_graph",
                                          "begin_capture_to_if_node",
                                          "end_capture_to_conditional_node"))
    print("torch", torch.__version__, "triton", triton.__version__, "IF nodes:", has)
    if not has:
        return
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    out = torch.zeros(4096, 4096, device=dev, dtype=torch.float32)
    v = torch.zeros(1000, device=dev)
    count = torch.zeros((), dtype=torch.int32, device=dev)
    side = torch.cuda.Stream()

    def body(with_side):
        out.copy_(a @ b)  # cuBLAS, and an allocation in the body
        _add_one[(triton.cdiv(1000, 256),)](v, 1000, BLOCK=256)
        tmp = torch.empty(1000, device=dev)
        tmp.fill_(2.0)
        v.add_(tmp)
        if with_side:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                v.mul_(1.0)
            torch.cuda.current_stream().wait_stream(side)

    for with_side in (False, True):
        # warm-up eagerly (Triton compile, cuBLAS handles)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            body(with_side)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                pred = count > 100
                cg = if_body(pred)
                try:
                    body(with_side)
                finally:
                    cg.end_capture_to_conditional_node()
        except Exception as e:  # noqa: BLE001 (a probe: print what failed)
            print(f"side={with_side}: capture failed: {type(e).__name__}: {e}"[:400])
            continue
        for c, expect_run in ((5, False), (500, True), (50, False)):
            v.zero_()
            count.fill_(c)
            graph.replay()
            torch.cuda.synchronize()
            ran = bool(v[0].item() == 3.0)
            print(f"side={with_side} count={c}: body ran {ran} (expected {expect_run})"
                  f" {'ok' if ran == expect_run else 'WRONG'}")
        # cost: replay with the body skipped vs run (a 4096^3 bf16 product ~0.2 ms)
        for c in (5, 500):
            count.fill_(c)
            for _ in range(10):
                graph.replay()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(100):
                graph.replay()
            e1.record()
            torch.cuda.synchronize()
            print(f"side={with_side} count={c}: {e0.elapsed_time(e1) / 100 * 1000:.1f} us/replay")


if __name__ == "__main__":
    main()
