"""Probe (H200): how DDP's reducer survives a capture that fails in forward, loss, backward or the
optimizer; whether find_unused_parameters=True captures; HF models with masks under capture."""
import json, os, sys, traceback
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29511")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
torch.cuda.set_device(0)
out = {}
s = torch.cuda.Stream()

def build(find_unused=False):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).cuda()
    with torch.cuda.stream(s):
        d = DDP(m, device_ids=[0], gradient_as_bucket_view=True, find_unused_parameters=find_unused)
    d._set_ddp_runtime_logging_sample_rate(2**31 - 1)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, capturable=True)
    return d, opt

x = torch.randn(32, 64, device="cuda"); y = torch.randint(10, (32,), device="cuda")

def body(d, opt, fail=None):
    opt.zero_grad(set_to_none=False)
    if fail == "forward":
        out = d(x); out.sum().item()
    out = d(x)
    loss = nn.functional.cross_entropy(out, y)
    if fail == "loss":
        loss.item()
    if fail == "backward":
        class F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t): return t.clone()
            @staticmethod
            def backward(ctx, g): g.sum().item(); return g
        loss = F.apply(loss)
    loss.backward()
    if fail == "optimizer":
        next(iter(d.parameters())).grad.sum().item()
    opt.step()
    return loss

def eager(d, opt, n):
    for _ in range(n):
        with torch.cuda.stream(s):
            body(d, opt)
    torch.cuda.synchronize()

for fail in ["forward", "loss", "backward", "optimizer"]:
    rec = {}
    d, opt = build()
    eager(d, opt, 12)
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    try:
        with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
            body(d, opt, fail)
        rec["capture"] = "ok?!"
    except Exception as e:
        rec["capture_error"] = str(e).splitlines()[0][:200]
    torch.cuda.synchronize()
    # release rng capture
    g2 = torch.cuda.CUDAGraph(); z = torch.zeros(1, device="cuda")
    with torch.cuda.graph(g2, stream=s): z.add_(1)
    try:
        d.reducer._check_reducer_finalized(); rec["finalized"] = True
    except Exception as e:
        rec["finalized"] = str(e).splitlines()[0][:200]
    try:
        eager(d, opt, 1); rec["eager_after"] = "ok"
    except Exception as e:
        rec["eager_after"] = str(e).splitlines()[0][:200]
        d.reducer._reset_state()
        try:
            eager(d, opt, 3); rec["eager_after_reset"] = "ok"
        except Exception as e2:
            rec["eager_after_reset"] = str(e2).splitlines()[0][:200]
    # can we capture again afterwards?
    try:
        g3 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g3, stream=s, capture_error_mode="thread_local"):
            body(d, opt)
        g3.replay(); torch.cuda.synchronize(); rec["recapture"] = "ok"
    except Exception as e:
        rec["recapture"] = str(e).splitlines()[0][:200]
    out[f"fail_{fail}"] = rec
    print(fail, rec, flush=True)

# find_unused_parameters=True
rec = {}
try:
    d, opt = build(find_unused=True)
    eager(d, opt, 12)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
        loss = body(d, opt)
    for _ in range(3): g.replay()
    torch.cuda.synchronize(); rec["capture"] = "ok"
    # compare with eager
    d2, opt2 = build(find_unused=True); eager(d2, opt2, 15)
    rec["max_diff_vs_eager"] = max((a - b).abs().max().item() for a, b in zip(d.parameters(), d2.parameters()))
except Exception as e:
    rec["error"] = str(e).splitlines()[0][:300]
out["find_unused_parameters"] = rec
print("find_unused", rec, flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe.json"), "w"), indent=1)
dist.destroy_process_group()
