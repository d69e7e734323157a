"""torch_job.py LIB - PyTorch through libgmb-torch.so on a cuda broker
(tests/gpu/run.sh).  Checks: tensors computed in broker memory; the OOM
path (a refusal is a RuntimeError naming the reason, never a tensor at
address 0); a CUDA graph capture whose allocation misses the cache (the
cache emptied first, then torch.empty of 256 MiB inside torch.cuda.graph:
the allocator must get new memory from the broker during the capture) and
its replay; two streams sharing a tensor with record_stream, the tensor
freed while the other stream still works on it.  Prints PASS/FAIL lines
and a FIGURE line (what this process holds on the GPU besides gmb's
memory: its context and kernels); exit 0 when all passed."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..",
                                "client", "python"))
import torch  # noqa: E402
import gmb_torch  # noqa: E402

MIB = 1 << 20
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

# What the process holds on the device that is not gmb's: its context and
# the kernels PyTorch loaded (device_reserve auto counts contexts).
try:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory",
         "--format=csv,noheader,nounits"], capture_output=True, text=True,
        timeout=30).stdout
    mine = [ln.split(",")[1].strip() for ln in out.splitlines()
            if ln.split(",")[0].strip() == str(os.getpid())]
    print("FIGURE torch_process_MiB %s (nvidia-smi used_memory of this "
          "process: context and kernels, gmb's memory counted in the "
          "broker)" % (mine[0] if mine else "?"), flush=True)
except (OSError, subprocess.SubprocessError) as e:
    print("FIGURE torch_process_MiB ? (%s)" % e, flush=True)

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

# A capture that misses the cache: nothing cached may serve 256 MiB.
torch.cuda.synchronize()
torch.cuda.empty_cache()
reserved0 = gmb_torch.memory_reserved(0)
g = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(g):
        big = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
        big.fill_(7)
        y = x * 3
    grew = gmb_torch.memory_reserved(0) - reserved0
    check(grew >= 256 * MIB, "the capture's 256 MiB missed the cache "
          "(reserved grew by %d MiB during the capture)" % (grew // MIB))
    big.zero_()
    y.zero_()
    g.replay()
    torch.cuda.synchronize()
    check(big[0].item() == 7 and big[-1].item() == 7 and
          int((big == 7).sum().item()) == 256 * MIB and
          y.sum().item() == 3 * 4096.0,
          "graph replay wrote the 256 MiB captured allocation and y")
    del g, y, big
    torch.cuda.synchronize()
    check(True, "frees after the graph")
except RuntimeError as e:
    check(False, "graph capture with a cache miss: %s" % str(e)[:300])

# Two streams: a tensor made on the current stream is used on s2, marked
# with record_stream, and freed while s2 still works; its memory must not
# be handed out before s2 is done with it.
s2 = torch.cuda.Stream()
t = torch.ones(16 * MIB // 4, device="cuda")
s2.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s2):
    acc = torch.zeros_like(t)
    for _ in range(50):
        acc += t
    t.record_stream(s2)
del t
u = torch.full((16 * MIB // 4,), 5.0, device="cuda")  # may reuse t's memory
torch.cuda.current_stream().wait_stream(s2)
torch.cuda.synchronize()
check(acc.sum().item() == 50.0 * (16 * MIB // 4) and
      u.sum().item() == 5.0 * (16 * MIB // 4),
      "two streams with record_stream: s2's sum intact, the new tensor too")
del acc, u, x
torch.cuda.synchronize()
sys.exit(1 if fails else 0)
