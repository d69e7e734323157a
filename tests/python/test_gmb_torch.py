"""test_gmb_torch.py - what client/python/gmb_torch.py does, including when a
program calls the PyTorch features a CUDAPluggableAllocator cannot provide
(docs/pytorch.md, "What the pluggable allocator cannot do").

    python3 tests/python/test_gmb_torch.py BUILD_DIR

Without PyTorch only the tests that need none run (enable() raises
ImportError, library_path() honours GMB_TORCH_LIB); the others are skipped
and the reason printed.  With PyTorch and a GPU the test starts its own
broker (BUILD_DIR/gmb-broker --device cuda:0 in a run dir of its own),
enables the allocator once, makes a tensor in broker memory and calls each
feature: the statistics (memory_stats, memory_allocated,
max_memory_allocated, reset_peak_memory_stats, memory_snapshot,
_record_memory_history) must raise RuntimeError naming what the pluggable
allocator does not support, sharing a CUDA tensor the way
torch.multiprocessing does (reduce_tensor) must raise RuntimeError; after
each the tensor's bytes are intact.  The hooks gmb_torch.enable() wires
are used as PyTorch users do: torch.cuda.empty_cache() gives the cache's
free slabs back (the tenant's bytes in use, read through libgmb.so, drop),
set_per_process_memory_fraction(0) refuses an allocation and 1 allows it
again, and Tensor.record_stream() records no error and leaks nothing.
Without PyTorch, the library must still export every function HOOKS names.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.normpath(os.path.join(HERE, "..", ".."))
BUILD = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                        os.environ.get("GMB_BUILD_DIR", "build"))
sys.path.insert(0, os.path.join(TOP, "client", "python"))
import gmb_torch  # noqa: E402

try:
    import torch
    HAVE_TORCH = True
    WHY_NOT = None
    if not torch.cuda.is_available():
        WHY_NOT = "PyTorch has no CUDA device here"
except ImportError as e:
    torch = None
    HAVE_TORCH = False
    WHY_NOT = "PyTorch is not installed (%s)" % e


class WithoutTorch(unittest.TestCase):
    @unittest.skipIf(HAVE_TORCH, "PyTorch is installed")
    def test_enable_needs_torch(self):
        with self.assertRaises(ImportError) as cm:
            gmb_torch.enable(os.path.join(BUILD, "libgmb-torch.so"))
        self.assertIn("gmb_torch needs PyTorch", str(cm.exception))

    def test_library_exports_every_hook(self):
        import subprocess
        lib_path = os.path.join(BUILD, "libgmb-torch.so")
        if not os.path.isfile(lib_path):
            self.skipTest("%s is not built" % lib_path)
        # The dynamic symbol table, read without loading the library: a
        # sanitizer build (make check SAN=1) cannot be loaded into a
        # python3 that was not started with the sanitizer's runtime.
        out = subprocess.run(["nm", "-D", "--defined-only", lib_path],
                             capture_output=True, text=True,
                             check=True).stdout
        exported = {line.split()[-1] for line in out.splitlines()
                    if line.strip()}
        for name in ["gmb_torch_alloc", "gmb_torch_free",
                     "gmb_torch_empty_cache", "gmb_torch_last_error"] + \
                [sym for _, sym in gmb_torch.HOOKS]:
            self.assertIn(name, exported)
        self.assertEqual(gmb_torch.hooks(), {})

    def test_library_path_env(self):
        old = os.environ.get("GMB_TORCH_LIB")
        try:
            os.environ["GMB_TORCH_LIB"] = "/nonexistent/libgmb-torch.so"
            with self.assertRaises(FileNotFoundError):
                gmb_torch.library_path()
            lib = os.path.join(BUILD, "libgmb-torch.so")
            if os.path.isfile(lib):
                os.environ["GMB_TORCH_LIB"] = lib
                self.assertEqual(gmb_torch.library_path(), lib)
        finally:
            if old is None:
                os.environ.pop("GMB_TORCH_LIB", None)
            else:
                os.environ["GMB_TORCH_LIB"] = old


@unittest.skipIf(WHY_NOT is not None, WHY_NOT or "")
class UnsupportedFeatures(unittest.TestCase):
    broker = None
    run_dir = None

    @classmethod
    def setUpClass(cls):
        cls.run_dir = tempfile.mkdtemp(prefix="gmbpy-")
        os.chmod(cls.run_dir, 0o755)
        cls.log = open(os.path.join(cls.run_dir, "broker.log"), "w")
        cls.broker = subprocess.Popen(
            [os.path.join(BUILD, "gmb-broker"), "--device", "cuda:0",
             "--run-dir", cls.run_dir], stdout=cls.log, stderr=cls.log)
        sock = os.path.join(cls.run_dir, "broker.sock")
        for _ in range(200):  # a bounded wait for a condition
            if os.path.exists(sock) or cls.broker.poll() is not None:
                break
            time.sleep(0.05)
        if not os.path.exists(sock):
            raise unittest.SkipTest("no broker on cuda:0 came up; see %s"
                                    % cls.log.name)
        os.environ["GMB_ENDPOINT"] = "ipc://" + sock
        os.environ.setdefault("GMB_TENANT", "pytest")
        gmb_torch.enable(os.path.join(BUILD, "libgmb-torch.so"))
        cls.x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")

    @classmethod
    def tearDownClass(cls):
        if cls.broker is not None:
            cls.broker.terminate()
            cls.broker.wait(timeout=30)
        if cls.run_dir:
            shutil.rmtree(cls.run_dir, ignore_errors=True)

    def intact(self):
        self.assertEqual(float(self.x[-1].item()), float((1 << 20) - 1))

    def refused(self, fn):
        with self.assertRaises(RuntimeError) as cm:
            fn()
        msg = str(cm.exception)
        self.assertTrue("CUDAPluggableAllocator" in msg or
                        "does not yet support" in msg or
                        "not supported" in msg, msg)
        print("  %s: RuntimeError: %s" % (getattr(fn, "__name__", fn),
                                          msg.splitlines()[0]))
        self.intact()

    def test_memory_stats(self):
        self.refused(torch.cuda.memory_stats)

    def test_memory_allocated(self):
        self.refused(torch.cuda.memory_allocated)

    def test_max_memory_allocated(self):
        self.refused(torch.cuda.max_memory_allocated)

    def test_reset_peak_memory_stats(self):
        self.refused(torch.cuda.reset_peak_memory_stats)

    def test_memory_snapshot(self):
        self.refused(torch.cuda.memory_snapshot)

    def test_record_memory_history(self):
        self.refused(lambda: torch.cuda.memory._record_memory_history())

    def test_multiprocessing_sharing(self):
        from torch.multiprocessing.reductions import reduce_tensor
        self.refused(lambda: reduce_tensor(self.x))

    def used(self):
        """The tenant's bytes in use, as the broker counts them."""
        import ctypes

        class Stats(ctypes.Structure):
            _fields_ = [(n, ctypes.c_uint64) for n in
                        ("quota", "used", "peak", "segments", "cached")]
        lib = ctypes.CDLL(os.path.join(BUILD, "libgmb.so"))
        c = ctypes.c_void_p()
        self.assertEqual(lib.gmb_connect(
            os.environ["GMB_ENDPOINT"].encode(),
            os.environ["GMB_TENANT"].encode(), ctypes.byref(c)), 0)
        st = Stats()
        rc = lib.gmb_tenant_stats(c, ctypes.byref(st))
        lib.gmb_disconnect(c)
        self.assertEqual(rc, 0)
        return st.used

    def test_hooks_wired(self):
        wired = gmb_torch.hooks()
        self.assertEqual(sorted(wired), sorted(s for s, _ in gmb_torch.HOOKS))
        print("  hooks: %s" % wired)
        self.assertTrue(wired["set_reset_fn"], wired)

    def test_empty_cache_gives_back(self):
        y = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        before = self.used()
        del y
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.assertLess(self.used(), before)
        self.intact()

    def test_memory_fraction(self):
        torch.cuda.set_per_process_memory_fraction(0.0)
        try:
            with self.assertRaises(RuntimeError) as cm:
                torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
            self.assertIn("memory fraction", str(cm.exception))
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        z = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        del z
        self.intact()

    def test_record_stream(self):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = self.used()
        s2 = torch.cuda.Stream()
        y = torch.ones(16 << 20, dtype=torch.uint8, device="cuda")
        s2.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s2):
            w = y * 2
        y.record_stream(s2)
        del y
        self.assertNotIn("record_stream", gmb_torch.last_error())
        s2.synchronize()
        del w
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.assertLessEqual(self.used(), base)
        self.intact()


if __name__ == "__main__":
    if WHY_NOT is not None:
        print("test_gmb_torch: the tests that need PyTorch with CUDA are "
              "skipped: %s" % WHY_NOT, flush=True)
    r = unittest.main(argv=[sys.argv[0], "-v"], exit=False).result
    sys.exit(0 if r.wasSuccessful() else 1)
