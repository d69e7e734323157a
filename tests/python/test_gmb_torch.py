"""test_gmb_torch.py - what client/python/gmb_torch.py does, including when a
program calls the PyTorch features a CUDAPluggableAllocator cannot provide
(docs/pytorch.md, "What the pluggable allocator cannot do").

    python3 tests/python/test_gmb_torch.py BUILD_DIR

Without PyTorch only the tests that need none run (enable() raises
ImportError, library_path() honours GMB_TORCH_LIB); the others are skipped
and the reason printed.  With PyTorch and a GPU the test starts its own
broker (BUILD_DIR/gmb-broker --device cuda:0 in a run dir of its own),
enables the allocator once, makes a tensor in broker memory and calls each
feature: the statistics gmb_torch.enable() replaced (memory_stats,
memory_allocated, max_memory_allocated, reset_peak_memory_stats,
mem_get_info, and the snapshot in PyTorch's format) answer with gmb's
figures; an allocation past the quota raises torch.OutOfMemoryError
("CUDA out of memory. ..."); _record_memory_history must raise
RuntimeError naming what the pluggable allocator does not support, sharing a CUDA tensor the way
torch.multiprocessing does (reduce_tensor) must raise RuntimeError; after
each the tensor's bytes are intact.  The hooks gmb_torch.enable() wires
are used as PyTorch users do: torch.cuda.empty_cache() gives the cache's
free slabs back (the tenant's bytes in use, read through libgmb.so, drop),
set_per_process_memory_fraction(0) refuses an allocation and 1 allows it
again, and Tensor.record_stream() records no error and leaks nothing.
Without PyTorch, the library must still export every function HOOKS names,
and gmb_torch.memory_stats() is checked on a host broker with the
allocator driven through ctypes as PyTorch drives it.
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
                     "gmb_torch_empty_cache", "gmb_torch_last_error",
                     "gmb_torch_tag", "gmb_torch_pause",
                     "gmb_torch_resume"] + \
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


def _start_broker(cls, prefix, args):
    """A broker (BUILD/gmb-broker ARGS --run-dir DIR) in a run dir of its
    own, kept on cls; the path of its socket once it is there, else None
    (its log says why)."""
    cls.run_dir = tempfile.mkdtemp(prefix=prefix)
    os.chmod(cls.run_dir, 0o755)
    cls.log = open(os.path.join(cls.run_dir, "broker.log"), "w")
    cls.broker = subprocess.Popen(
        [os.path.join(BUILD, "gmb-broker")] + args +
        ["--run-dir", cls.run_dir], stdout=cls.log, stderr=cls.log)
    sock = os.path.join(cls.run_dir, "broker.sock")
    for _ in range(400):  # a bounded wait for a condition
        if os.path.exists(sock) or cls.broker.poll() is not None:
            break
        time.sleep(0.05)
    return sock if os.path.exists(sock) else None


def _sanitized(lib_path):
    """A sanitizer build cannot be loaded into a plain python3."""
    out = subprocess.run(["nm", "-D", lib_path], capture_output=True,
                         text=True).stdout
    return "__asan_init" in out or "__ubsan_handle" in out


class StatisticsWithoutTorch(unittest.TestCase):
    """gmb_torch.memory_stats() and the rest, with the allocator driven
    through ctypes as PyTorch drives it, on a host broker (no PyTorch, no
    GPU needed): PyTorch's key names, the figures of what was allocated,
    peaks and their reset, OOMs, and mem_get_info as the tenant's quota."""
    MIB = 1 << 20

    @classmethod
    def setUpClass(cls):
        cls.lib_path = os.path.join(BUILD, "libgmb-torch.so")
        if not os.path.isfile(cls.lib_path):
            raise unittest.SkipTest("%s is not built" % cls.lib_path)
        if _sanitized(cls.lib_path):
            raise unittest.SkipTest("a sanitizer build of the library")
        cls.conf_dir = tempfile.mkdtemp(prefix="gmbpyc-")
        conf = os.path.join(cls.conf_dir, "gmb.ini")
        with open(conf, "w") as f:
            f.write("[tenant:pystats]\nquota = 8MiB\n")
        sock = _start_broker(cls, "gmbpys-",
                             ["--device", "host:64MiB", "--config", conf])
        if sock is None:
            raise AssertionError("no broker came up; see %s" % cls.log.name)
        os.environ["GMB_ENDPOINT"] = "ipc://" + sock
        os.environ["GMB_TENANT"] = "pystats"
        os.environ["GMB_SHIM_ALLOW_HOST"] = "1"
        os.environ["GMB_TORCH_LIB"] = cls.lib_path
        import ctypes
        cls.lib = ctypes.CDLL(cls.lib_path)
        cls.lib.gmb_torch_alloc_nothrow.restype = ctypes.c_void_p
        cls.lib.gmb_torch_alloc_nothrow.argtypes = [
            ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        cls.lib.gmb_torch_free.argtypes = [
            ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]

    @classmethod
    def tearDownClass(cls):
        cls.broker.terminate()
        cls.broker.wait(timeout=30)
        cls.log.close()
        shutil.rmtree(cls.run_dir, ignore_errors=True)
        shutil.rmtree(cls.conf_dir, ignore_errors=True)
        for k in ("GMB_ENDPOINT", "GMB_TENANT", "GMB_SHIM_ALLOW_HOST",
                  "GMB_TORCH_LIB"):
            os.environ.pop(k, None)

    def alloc(self, n):
        p = self.lib.gmb_torch_alloc_nothrow(n, 0, None)
        return p

    def test_tag_pause_resume(self):
        # gmb_torch.tag/pause/resume: the tag's memory goes back to the
        # broker and comes back at the same address with its bytes.
        import ctypes
        mib = self.MIB
        with gmb_torch.tag("weights"):
            p = self.alloc(2 * mib)
        self.assertTrue(p, gmb_torch.last_error())
        ctypes.memset(p, 0x5A, 2 * mib)
        free_before = gmb_torch.mem_get_info(0)[0]
        gmb_torch.pause(level=1)  # weights offloaded; no kv_cache: skipped
        self.assertGreaterEqual(gmb_torch.mem_get_info(0)[0],
                                free_before + 2 * mib)
        gmb_torch.resume(level=1)
        self.assertEqual(ctypes.string_at(p, 16), b"\x5a" * 16)
        self.assertEqual(ctypes.string_at(p + 2 * mib - 16, 16),
                         b"\x5a" * 16)
        gmb_torch.pause({"weights": "discard"})
        gmb_torch.resume("weights")
        with self.assertRaises(ValueError):
            gmb_torch.pause(level=3)
        with self.assertRaises(ValueError):
            gmb_torch.pause({"weights": "nap"})
        with self.assertRaises(RuntimeError):
            gmb_torch.pause(["never-used"], missing_ok=False)
        self.lib.gmb_torch_free(p, 2 * mib, 0, None)

    def test_stats_as_pytorch_names_them(self):
        mib = self.MIB
        base = gmb_torch.memory_stats(0)
        p1, p2 = self.alloc(1000), self.alloc(mib + 1)
        self.assertTrue(p1 and p2, gmb_torch.last_error())
        st = gmb_torch.memory_stats(0)
        rounded = 1024 + mib + 512
        self.assertEqual(st["allocated_bytes.all.current"],
                         base["allocated_bytes.all.current"] + rounded)
        self.assertEqual(st["requested_bytes.all.current"],
                         base["requested_bytes.all.current"] + 1000 + mib + 1)
        self.assertEqual(st["allocation.all.current"],
                         base["allocation.all.current"] + 2)
        self.assertEqual(st["active_bytes.all.current"],
                         st["allocated_bytes.all.current"])
        self.assertGreaterEqual(st["reserved_bytes.all.current"],
                                st["allocated_bytes.all.current"])
        self.assertGreaterEqual(st["reserved_bytes.all.peak"],
                                st["reserved_bytes.all.current"])
        self.assertEqual(list(st), sorted(st))
        self.assertEqual(gmb_torch.memory_allocated(0),
                         st["allocated_bytes.all.current"])
        self.assertEqual(gmb_torch.memory_reserved(0),
                         st["reserved_bytes.all.current"])
        # The tenant's quota as total, what it can still get as free.
        free, total = gmb_torch.mem_get_info(0)
        self.assertEqual(total, 8 * mib)
        self.assertEqual(free, 8 * mib - st["reserved_bytes.all.current"])
        self.lib.gmb_torch_free(p2, mib + 1, 0, None)
        self.assertEqual(gmb_torch.max_memory_allocated(0),
                         st["allocated_bytes.all.peak"])
        gmb_torch.reset_peak_memory_stats(0)
        after = gmb_torch.memory_stats(0)
        self.assertEqual(after["allocated_bytes.all.peak"],
                         after["allocated_bytes.all.current"])
        self.assertEqual(after["allocated_bytes.all.freed"],
                         st["allocated_bytes.all.freed"] + mib + 512)
        # A refusal counts as an OOM.
        self.assertFalse(self.alloc(9 * mib))
        self.assertIn("GMB_E_QUOTA", gmb_torch.last_error())
        self.assertEqual(gmb_torch.memory_stats(0)["num_ooms"],
                         st["num_ooms"] + 1)
        self.lib.gmb_torch_free(p1, 1000, 0, None)
        end = gmb_torch.memory_stats(0)
        self.assertEqual(end["allocated_bytes.all.current"],
                         base["allocated_bytes.all.current"])
        self.assertEqual(end["allocation.all.freed"],
                         base["allocation.all.freed"] + 2)
        nested = gmb_torch.memory_stats_as_nested_dict(0)
        self.assertEqual(nested["allocated_bytes"]["all"]["current"],
                         end["allocated_bytes.all.current"])

    def test_snapshot_while_recording(self):
        mib = self.MIB
        before = self.alloc(4096)  # not recorded: before record_history()
        gmb_torch.record_history(True)
        try:
            p1, p2 = self.alloc(1000), self.alloc(mib)
            snap = gmb_torch.memory_snapshot()
            self.assertEqual([b["address"] for b in snap], sorted([p1, p2]))
            by = {b["address"]: b for b in snap}
            self.assertEqual((by[p1]["size"], by[p1]["requested_size"]),
                             (1024, 1000))
            self.assertEqual(by[p2]["size"], mib)
            self.assertEqual(by[p2]["device"], 0)
            self.lib.gmb_torch_free(p1, 1000, 0, None)
            self.assertEqual([b["address"] for b in
                              gmb_torch.memory_snapshot()], [p2])
        finally:
            gmb_torch.record_history(False)
        self.assertEqual(gmb_torch.memory_snapshot(), [])
        self.lib.gmb_torch_free(p2, mib, 0, None)
        self.lib.gmb_torch_free(before, 4096, 0, None)

    def test_snapshot_pytorch_format(self):
        """gmb_torch.snapshot() as torch.cuda.memory._snapshot() gives it:
        segments of mapped pages tiled by their blocks, live ones
        active_allocated, the rest inactive, sizes that add up."""
        mib = self.MIB
        gmb_torch.record_history(True)
        try:
            p1, p2 = self.alloc(1000), self.alloc(3 * mib + 100)
            self.assertTrue(p1 and p2, gmb_torch.last_error())
            snap = gmb_torch.snapshot(0)
        finally:
            gmb_torch.record_history(False)
        self.assertEqual(set(snap), {"segments", "device_traces",
                                     "allocator_settings"})
        self.assertEqual(snap["device_traces"], [[]])
        blocks = {}
        for seg in snap["segments"]:
            self.assertEqual(seg["device"], 0)
            self.assertTrue(seg["is_expandable"])
            self.assertEqual(seg["total_size"] % (2 * mib), 0)
            at = seg["address"]
            for b in seg["blocks"]:  # the blocks tile the segment
                self.assertEqual(b["address"], at)
                at += b["size"]
                self.assertIn(b["state"], ("active_allocated", "inactive",
                                           "active_pending_free"))
                blocks[b["address"]] = (b, seg)
            self.assertEqual(at, seg["address"] + seg["total_size"])
            self.assertEqual(seg["allocated_size"], sum(
                b["size"] for b in seg["blocks"]
                if b["state"] == "active_allocated"))
        b1, _ = blocks[p1]
        self.assertEqual((b1["size"], b1["requested_size"], b1["state"]),
                         (1024, 1000, "active_allocated"))
        b2, seg2 = blocks[p2]
        self.assertEqual((b2["requested_size"], b2["state"]),
                         (3 * mib + 100, "active_allocated"))
        self.assertGreaterEqual(b2["size"], 3 * mib + 512)
        self.assertEqual(seg2["segment_type"], "large")
        self.assertEqual(sum(s["total_size"] for s in snap["segments"]),
                         gmb_torch.memory_reserved(0))
        # Freed: inactive where it was, in the same pages (the cache keeps
        # them until empty_cache()).
        self.lib.gmb_torch_free(p2, 3 * mib + 100, 0, None)
        after = gmb_torch.snapshot()
        states = {b["address"]: b["state"] for s in after["segments"]
                  for b in s["blocks"]}
        self.assertEqual(states.get(p1), "active_allocated")
        self.assertNotEqual(states.get(p2), "active_allocated")
        self.lib.gmb_torch_free(p1, 1000, 0, None)
        self.assertFalse(any(b["state"] == "active_allocated"
                             for s in gmb_torch.snapshot()["segments"]
                             for b in s["blocks"]))

    def test_device_arguments(self):
        self.assertEqual(gmb_torch._device_index(None), 0)
        self.assertEqual(gmb_torch._device_index("cuda:3"), 3)
        self.assertEqual(gmb_torch._device_index(2), 2)
        with self.assertRaises(ValueError):
            gmb_torch.memory_stats(-1)


@unittest.skipIf(WHY_NOT is not None, WHY_NOT or "")
class UnsupportedFeatures(unittest.TestCase):
    broker = None
    run_dir = None

    @classmethod
    def setUpClass(cls):
        sock = _start_broker(cls, "gmbpy-", ["--device", "cuda:0"])
        if sock is None:
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
        # gmb_torch.enable() replaced torch.cuda's statistics with gmb's.
        st = torch.cuda.memory_stats()
        self.assertGreaterEqual(st["allocated_bytes.all.current"], 4 << 20)
        self.assertGreaterEqual(st["reserved_bytes.all.current"],
                                st["allocated_bytes.all.current"])
        self.intact()

    def test_memory_allocated(self):
        self.assertEqual(torch.cuda.memory_allocated(),
                         gmb_torch.memory_allocated())
        self.assertGreaterEqual(torch.cuda.memory_allocated(), 4 << 20)

    def test_max_memory_allocated(self):
        self.assertGreaterEqual(torch.cuda.max_memory_allocated(),
                                torch.cuda.memory_allocated())

    def test_reset_peak_memory_stats(self):
        y = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
        del y
        torch.cuda.reset_peak_memory_stats()
        self.assertEqual(torch.cuda.max_memory_allocated(),
                         torch.cuda.memory_allocated())
        self.intact()

    def test_mem_get_info(self):
        free, total = torch.cuda.mem_get_info()
        self.assertEqual((free, total), gmb_torch.mem_get_info())
        self.assertLessEqual(free, total)

    def test_memory_snapshot(self):
        # gmb_torch.enable() replaced PyTorch's snapshot with gmb's, in
        # PyTorch's format: the tensor's block is in it.
        segs = torch.cuda.memory_snapshot()
        snap = torch.cuda.memory._snapshot()
        self.assertEqual(segs, snap["segments"])
        addr = self.x.data_ptr()
        self.assertTrue(any(b["address"] == addr and
                            b["state"] == "active_allocated"
                            for s in segs for b in s["blocks"]), segs)
        self.intact()

    def test_out_of_memory_error(self):
        # A refusal is torch.OutOfMemoryError, with PyTorch's words first.
        oom = getattr(torch, "OutOfMemoryError", None) or \
            torch.cuda.OutOfMemoryError
        with self.assertRaises(oom) as cm:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        msg = str(cm.exception)
        self.assertTrue(msg.startswith("CUDA out of memory. Tried to "
                                       "allocate"), msg)
        self.assertIn("gmb: ", msg)
        self.intact()

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
