"""torch_job.py LIB - PyTorch 2.11 through libgmb-torch.so on a cuda broker
(tests/gpu/run.sh).  Checks: tensors computed in broker memory, the OOM path
(a refusal is a RuntimeError naming the reason, never a tensor at address 0),
a CUDA graph capture and replay, frees after it.  Prints PASS/FAIL lines;
exit 0 when all passed."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..",
                                "client", "python"))
import torch  # noqa: E402
import gmb_torch  # noqa: E402

fails = 0


def check(ok, what):
    global fails
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    fails += 0 if ok else 1


gmb_torch.enable(sys.argv[1])
a = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
b = (a * 2).sum().item()
check(b == float((1 << 20) * ((1 << 20) - 1)), "tensor math in broker memory")
del a
try:
    big = torch.empty(1 << 40, dtype=torch.uint8, device="cuda")  # 1 TiB
    check(False, "OOM path: 1TiB allocated?")
except RuntimeError as e:
    # torch.OutOfMemoryError subclasses RuntimeError: whichever PyTorch
    # raised, the text starts as PyTorch's own and carries gmb's reason.
    check(str(e).startswith("CUDA out of memory.") and "gmb:" in str(e),
          "OOM path raises %s: %s" % (type(e).__name__,
                                      str(e).splitlines()[0][:160]))
    check(torch.cuda.memory_stats()["num_ooms"] >= 1,
          "the refusal counts in torch.cuda.memory_stats()['num_ooms']")
x = torch.ones(4096, device="cuda")
check(x.sum().item() == 4096.0, "allocations work after a refusal")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    y = x * 3
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    y = x * 3
    tmp = y + 1  # noqa: F841
    del tmp      # freed during capture: kept, see docs/pytorch.md
g.replay()
torch.cuda.synchronize()
check(y.sum().item() == 3 * 4096.0, "graph capture and replay")
del g, y, x
torch.cuda.synchronize()
check(True, "frees after the graph")
sys.exit(1 if fails else 0)
