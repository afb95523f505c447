"""The README's CUDA-graph snippet (section "CUDA graphs"), run as written, plus its inputs and a
check of the replayed loss and gradients against fp64 (CUDA only):

    PYTHONPATH=. python tools/readme_graph_snippet.py
"""
import torch
import torch.nn.functional as F
import fused_ce

torch.manual_seed(0)
head = torch.nn.Linear(1024, 30522).cuda().to(torch.bfloat16)
hidden = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
labels = torch.randint(0, 30522, (4096,), device="cuda")
labels[torch.rand(4096, device="cuda") < 0.85] = -100
new_hidden = torch.randn_like(hidden)
new_labels = torch.randint(0, 30522, (4096,), device="cuda")
new_labels[torch.rand(4096, device="cuda") < 0.85] = -100

static = dict(x=hidden.clone(), y=labels.clone())
s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):          # eager warm-up: compiles the kernels
    for _ in range(2):
        fused_ce.linear_cross_entropy(static["x"], head.weight, static["y"], linear_bias=head.bias).backward()
torch.cuda.current_stream().wait_stream(s)
head.zero_grad(set_to_none=True)    # the graph's own .grad tensors, written by each replay
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    loss = fused_ce.linear_cross_entropy(static["x"], head.weight, static["y"], linear_bias=head.bias)
    loss.backward()
static["x"].copy_(new_hidden); static["y"].copy_(new_labels); graph.replay()   # loss, .grad
torch.cuda.synchronize()

w = head.weight.detach().double().requires_grad_()
b = head.bias.detach().double().requires_grad_()
ref = F.cross_entropy(F.linear(new_hidden.double(), w, b), new_labels)
ref.backward()
rel = lambda a, r: ((a.double() - r).norm() / r.norm()).item()
print("README graph snippet: loss", loss.item(), "ref", ref.item(),
      "dW", rel(head.weight.grad, w.grad), "db", rel(head.bias.grad, b.grad))
assert abs(loss.item() - ref.item()) <= 1e-5 * ref.item()
assert rel(head.weight.grad, w.grad) <= 2.5e-3 and rel(head.bias.grad, b.grad) <= 2.5e-3
print("OK")
