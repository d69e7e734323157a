"""gmb_torch - PyTorch's CUDA memory from the gmb broker.

    import gmb_torch
    gmb_torch.enable()        # before the first CUDA tensor

enable() loads libgmb-torch.so and makes it PyTorch's CUDA allocator
(torch.cuda.memory.CUDAPluggableAllocator).  Every tensor's memory is then a
block of this process's gmb cache, in memory of its tenant ($GMB_TENANT,
$GMB_ENDPOINT as for any gmb client).  Beyond allocation and free, the
pluggable allocator's hooks are given gmb's functions where PyTorch has them
(HOOKS): torch.cuda.empty_cache(), set_per_process_memory_fraction() and
Tensor.record_stream() then reach gmb.  PyTorch's statistics, which the
pluggable allocator cannot give, come from gmb: memory_stats() and the rest
here, under PyTorch's key names, and (unless enable(patch_torch=False))
torch.cuda.memory_stats(), memory_allocated(), max_memory_allocated(),
memory_reserved(), max_memory_reserved(), reset_peak_memory_stats() and
mem_get_info() answer with them.  See docs/pytorch.md.
"""
import collections
import ctypes
import os

__all__ = ["enable", "library_path", "last_error", "empty_cache", "hooks",
           "HOOKS", "memory_stats", "memory_stats_as_nested_dict",
           "memory_allocated", "max_memory_allocated", "memory_reserved",
           "max_memory_reserved", "reset_peak_memory_stats", "mem_get_info",
           "record_history", "memory_snapshot", "snapshot", "PATCHED", "tag",
           "pause", "resume", "LEVELS"]

_LIB_NAME = "libgmb-torch.so"
_enabled_path = None
_wired = {}

# PyTorch's setter on the pluggable allocator -> the function of
# libgmb-torch.so it is given (C signatures as PyTorch calls them:
# void(int), void(), void(double, int), void(void *, cudaStream_t)).
HOOKS = (
    ("set_init_fn", "gmb_torch_init"),
    ("set_reset_fn", "gmb_torch_reset"),
    ("set_memory_fraction_fn", "gmb_torch_set_memory_fraction"),
    ("set_record_stream_fn", "gmb_torch_record_stream"),
)


def library_path():
    """Where libgmb-torch.so is: $GMB_TORCH_LIB, else next to this module,
    else PREFIX/lib for the usual prefixes.  Raises FileNotFoundError."""
    env = os.environ.get("GMB_TORCH_LIB")
    if env:
        if not os.path.isfile(env):
            raise FileNotFoundError("GMB_TORCH_LIB=%s: no such file" % env)
        return os.path.abspath(env)
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.path.join(here, _LIB_NAME),
                  # PREFIX/share/gmb/python -> PREFIX/lib (make install)
                  os.path.normpath(os.path.join(here, "..", "..", "..", "lib",
                                                _LIB_NAME)),
                  "/usr/local/lib/" + _LIB_NAME, "/usr/lib/" + _LIB_NAME]
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise FileNotFoundError("%s not found (looked in: %s); set GMB_TORCH_LIB"
                            % (_LIB_NAME, ", ".join(candidates)))


def enable(path=None, patch_torch=True):
    """Makes gmb PyTorch's CUDA allocator for this process.  Call it before
    any CUDA tensor exists: PyTorch cannot change allocators afterwards.
    With patch_torch (the default), torch.cuda's statistics functions
    (PATCHED) answer with gmb's figures instead of raising.  Calling it
    again with the same library does nothing.  Returns the library's
    path."""
    global _enabled_path
    try:
        import torch
    except ImportError as e:
        raise ImportError("gmb_torch needs PyTorch (import torch failed: %s)"
                          % e) from e
    path = os.path.abspath(path) if path else library_path()
    if _enabled_path is not None:
        if _enabled_path == path:
            return path
        raise RuntimeError("gmb_torch is already enabled with %s"
                           % _enabled_path)
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "gmb_torch.enable() must run before CUDA is initialised (before "
            "the first CUDA tensor, torch.cuda.init() or a CUDA call); "
            "call it right after `import torch`")
    alloc = torch.cuda.memory.CUDAPluggableAllocator(
        path, "gmb_torch_alloc", "gmb_torch_free")
    wired = _wire_hooks(alloc, path)
    _register_oom_type(torch, path)
    torch.cuda.memory.change_current_allocator(alloc)
    _enabled_path = path
    if patch_torch:
        _patch_torch(torch)
    _wired.clear()
    _wired.update(wired)
    return path


def _wire_hooks(alloc, path):
    """Gives each of PyTorch's hooks in HOOKS its libgmb-torch.so function,
    before the allocator is installed (the init hook runs at CUDA's lazy
    initialisation, after that).  A PyTorch without a setter skips it.
    Returns {setter: True when wired, False when this PyTorch lacks it}."""
    raw = alloc.allocator()
    lib = ctypes.CDLL(path)
    wired = {}
    for setter, symbol in HOOKS:
        fn = getattr(raw, setter, None)
        if fn is None:
            wired[setter] = False
            continue
        fn(ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value)
        wired[setter] = True
    return wired


_oom_type = None


def _register_oom_type(torch, path):
    """Tells libgmb-torch.so which Python class an out-of-memory raises:
    torch.OutOfMemoryError (torch.cuda.OutOfMemoryError in older
    releases), so that `except torch.OutOfMemoryError` catches gmb's
    refusals as it catches PyTorch's own.  A PyTorch without either keeps
    a RuntimeError.  The class is kept referenced here for the library."""
    global _oom_type
    cls = getattr(torch, "OutOfMemoryError", None) or \
        getattr(torch.cuda, "OutOfMemoryError", None)
    if cls is None:
        return
    lib = ctypes.CDLL(path)
    fn = getattr(lib, "gmb_torch_set_oom_type", None)
    if fn is None:
        return
    fn.argtypes = [ctypes.py_object]
    fn.restype = None
    _oom_type = cls
    fn(cls)


def hooks():
    """Which of PyTorch's allocator hooks enable() wired in this process:
    {setter name: True, or False when this PyTorch lacks the setter}; empty
    before enable()."""
    return dict(_wired)


def last_error():
    """The last refusal libgmb-torch.so recorded in this process ("no error"
    when none), e.g. after an allocation failed over the tenant's quota."""
    lib = ctypes.CDLL(_enabled_path or library_path())
    lib.gmb_torch_last_error.restype = ctypes.c_char_p
    return lib.gmb_torch_last_error().decode("utf-8", "replace")


def empty_cache():
    """Gives the free memory this process's gmb cache holds back to the
    broker (gmb_trim(c, 0) on each device's session), for other jobs.
    torch.cuda.empty_cache() does the same through the reset hook once
    enable() wired it; this call also works without PyTorch's CUDA
    initialised, and tells the outcome.  Returns 0, or a negative GMB_E_*
    code when a session's trim failed."""
    lib = ctypes.CDLL(_enabled_path or library_path())
    return lib.gmb_torch_empty_cache()


# --- sleep and wake (docs/sleep.md) ----------------------------------------

# vLLM's sleep levels as presets: level 1 keeps the weights in host memory
# and drops the KV cache; level 2 drops both (the server reloads weights).
LEVELS = {
    1: {"weights": "offload", "kv_cache": "discard"},
    2: {"weights": "discard", "kv_cache": "discard"},
}
_MODES = {"offload": 0, "discard": 1}


def _device_arg(device):
    return _device_index(device)


class tag:
    """Allocations of this thread in the block go to `name`'s own part of
    the cache, so that they can be paused together:

        with gmb_torch.tag("weights"):
            model = load_model()

    Nested blocks restore the outer tag; None: untagged."""
    _current = {}

    def __init__(self, name, device=None):
        self.name, self.device = name, _device_arg(device)

    def __enter__(self):
        import threading
        key = (threading.get_ident(), self.device)
        self.outer = tag._current.get(key)
        _set_tag(self.name, self.device)
        tag._current[key] = self.name
        return self

    def __exit__(self, *exc):
        import threading
        _set_tag(self.outer, self.device)
        tag._current[(threading.get_ident(), self.device)] = self.outer
        return False


def _set_tag(name, device):
    lib = _lib()
    lib.gmb_torch_tag.argtypes = [ctypes.c_int, ctypes.c_char_p]
    rc = lib.gmb_torch_tag(device, name.encode() if name else None)
    if rc:
        raise RuntimeError("gmb_torch.tag: " + last_error())


def _plan(tags, level):
    if level is not None:
        if level not in LEVELS:
            raise ValueError("level must be one of %s" % sorted(LEVELS))
        return dict(LEVELS[level])
    if tags is None:
        raise ValueError("name the tags, or a level")
    if isinstance(tags, str):
        tags = [tags]
    if isinstance(tags, dict):
        plan = dict(tags)
    else:
        plan = {t: "offload" for t in tags}
    for t, mode in plan.items():
        if mode not in _MODES:
            raise ValueError("tag %s: mode %r is neither 'offload' nor "
                             "'discard'" % (t, mode))
    return plan


def pause(tags=None, level=None, device=None, missing_ok=True):
    """Gives the device memory of `tags` back to the broker: a list of tag
    names (offloaded to host memory), a {tag: "offload"|"discard"} dict, or
    a vLLM `level` (1: weights offloaded, KV cache dropped; 2: both
    dropped).  The addresses stay reserved: tensors in a paused tag must
    not be touched until resume().  A tag never used is skipped when
    missing_ok.  Raises RuntimeError with the library's reason otherwise
    (e.g. the host quota)."""
    lib = _lib()
    lib.gmb_torch_pause.argtypes = [ctypes.c_int, ctypes.c_char_p,
                                    ctypes.c_int]
    dev = _device_arg(device)
    for t, mode in _plan(tags, level).items():
        rc = lib.gmb_torch_pause(dev, t.encode(), _MODES[mode])
        if rc == -5 and missing_ok:  # GMB_E_NOENT: no such tag here
            continue
        if rc:
            raise RuntimeError("gmb_torch.pause(%s): %s" % (t, last_error()))


def resume(tags=None, level=None, device=None, missing_ok=True):
    """Maps the device memory of paused `tags` again at the same addresses
    and copies back what was offloaded (tags or level as for pause()).
    Raises RuntimeError when the broker has no room now; the tags stay
    paused with their bytes, and a later call may succeed."""
    lib = _lib()
    lib.gmb_torch_resume.argtypes = [ctypes.c_int, ctypes.c_char_p]
    dev = _device_arg(device)
    for t in _plan(tags, level):
        rc = lib.gmb_torch_resume(dev, t.encode())
        if rc == -5 and missing_ok:
            continue
        if rc:
            raise RuntimeError("gmb_torch.resume(%s): %s" % (t, last_error()))


# --- PyTorch's view of memory ---------------------------------------------

class _Stats(ctypes.Structure):
    """struct gmb_torch_stats (client/shim/torch.c), field for field."""
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "allocated_current", "allocated_peak", "allocated_total",
        "freed_total",
        "requested_current", "requested_total", "requested_freed",
        "allocs_current", "allocs_total", "frees_total",
        "reserved_current", "reserved_peak",
        "segments_current", "segments_total", "segments_freed",
        "num_ooms", "inactive_current", "kept")]


def _lib():
    return ctypes.CDLL(_enabled_path or library_path())


def _device_index(device):
    """PyTorch's device argument (None, an int, "cuda:1", torch.device) as
    an ordinal; None is the current device when PyTorch has CUDA up."""
    if device is None:
        try:
            import torch
            if torch.cuda.is_initialized():
                return torch.cuda.current_device()
        except ImportError:
            pass
        return 0
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        if device.startswith("cuda:"):
            return int(device[5:])
        return 0 if device == "cuda" else int(device)
    index = getattr(device, "index", None)  # a torch.device
    return 0 if index is None else int(index)


def _raw_stats(device):
    st = _Stats()
    lib = _lib()
    lib.gmb_torch_memory_stats.argtypes = [ctypes.c_int, ctypes.c_void_p,
                                           ctypes.c_size_t]
    rc = lib.gmb_torch_memory_stats(_device_index(device),
                                    ctypes.byref(st), ctypes.sizeof(st))
    if rc != 0:
        raise ValueError("gmb_torch: no statistics for device %r (error %d)"
                         % (device, rc))
    return st


def memory_stats_as_nested_dict(device=None):
    """This process's memory through gmb on `device`, nested as PyTorch's
    torch.cuda.memory_stats_as_nested_dict() nests it.  Only the "all"
    pool (gmb's cache has no large and small pools).  docs/pytorch.md
    says which key is which gmb figure."""
    st = _raw_stats(device)

    def stat(current, peak, allocated, freed):
        return {"all": {"current": current, "peak": peak,
                        "allocated": allocated, "freed": freed}}
    allocated = stat(st.allocated_current, st.allocated_peak,
                     st.allocated_total, st.freed_total)
    # No peak of counts or of requested bytes: keeping them exact would
    # cost every allocation an atomic read-modify-write more.
    counts = {"all": {"current": st.allocs_current,
                      "allocated": st.allocs_total,
                      "freed": st.frees_total}}
    return {
        "allocated_bytes": allocated,
        # A block is active from its allocation to its free, as in PyTorch
        # (its reuse after the free waits for the stream, not the count).
        "active_bytes": {"all": dict(allocated["all"])},
        "requested_bytes": {"all": {"current": st.requested_current,
                                    "allocated": st.requested_total,
                                    "freed": st.requested_freed}},
        "allocation": counts,
        "active": {"all": dict(counts["all"])},
        "reserved_bytes": {"all": {"current": st.reserved_current,
                                   "peak": st.reserved_peak}},
        "segment": {"all": {"current": st.segments_current,
                            "allocated": st.segments_total,
                            "freed": st.segments_freed}},
        "inactive_split_bytes": {"all": {"current": st.inactive_current}},
        "num_ooms": st.num_ooms,
        "num_device_alloc": st.segments_total,
        "num_device_free": st.segments_freed,
        # gmb's own: bytes kept for CUDA graphs until the process ends.
        "gmb_graph_kept_bytes": st.kept,
    }


def memory_stats(device=None):
    """torch.cuda.memory_stats() as gmb counts it: PyTorch's flat key names
    ("allocated_bytes.all.current", "reserved_bytes.all.peak",
    "num_ooms", ...), sorted, in an OrderedDict.  Works without PyTorch
    too (device 0 by default)."""
    flat = []

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(prefix + "." + k if prefix else k, v)
        else:
            flat.append((prefix, obj))
    walk("", memory_stats_as_nested_dict(device))
    flat.sort()
    return collections.OrderedDict(flat)


def memory_allocated(device=None):
    """Bytes of tensors alive through gmb on the device (each rounded to
    512), as torch.cuda.memory_allocated()."""
    return _raw_stats(device).allocated_current


def max_memory_allocated(device=None):
    return _raw_stats(device).allocated_peak


def memory_reserved(device=None):
    """Bytes of the pages gmb's cache holds mapped for this process on the
    device (the tenant's at the broker), as torch.cuda.memory_reserved()."""
    return _raw_stats(device).reserved_current


def max_memory_reserved(device=None):
    return _raw_stats(device).reserved_peak


def reset_peak_memory_stats(device=None):
    """The peak of allocated bytes starts again from the current figure
    (the cache's reserved peak is the session's and is not reset)."""
    rc = _lib().gmb_torch_reset_peak(_device_index(device))
    if rc != 0:
        raise ValueError("gmb_torch: no statistics for device %r (error %d)"
                         % (device, rc))


def mem_get_info(device=None):
    """(free, total) as torch.cuda.mem_get_info() gives them, for the
    tenant: its quota as total and what it can still get as free (without
    a quota, the broker's capacity and room).  Raises RuntimeError when no
    broker serves the device."""
    lib = _lib()
    fr, tot = ctypes.c_ulonglong(), ctypes.c_ulonglong()
    rc = lib.gmb_torch_mem_get_info(_device_index(device), ctypes.byref(fr),
                                    ctypes.byref(tot))
    if rc != 0:
        raise RuntimeError("gmb_torch.mem_get_info: %s" % last_error())
    return fr.value, tot.value


class _Block(ctypes.Structure):
    """struct gmb_torch_block (client/shim/torch.c)."""
    _fields_ = [("address", ctypes.c_uint64), ("size", ctypes.c_uint64),
                ("requested_size", ctypes.c_uint64),
                ("stream", ctypes.c_uint64), ("device", ctypes.c_int32),
                ("reserved", ctypes.c_uint32)]


def record_history(enabled=True):
    """Starts (or stops) keeping every allocation from now on for
    memory_snapshot(), as torch.cuda.memory._record_memory_history() does
    for PyTorch's own allocator.  Off by default: it costs a lock and a
    tree insertion per allocation.  Stopping forgets what was kept."""
    _lib().gmb_torch_record_history(1 if enabled else 0)


def memory_snapshot():
    """The live blocks allocated while record_history() was on, by address:
    a list of {"device", "address", "size" (rounded to 512),
    "requested_size", "stream", "state": "active_allocated"}.  gmb's own
    format: the pages under the blocks (PyTorch's "segments") are the
    cache's, which does not list them."""
    lib = _lib()
    lib.gmb_torch_snapshot.restype = ctypes.c_long
    lib.gmb_torch_snapshot.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    while True:
        n = lib.gmb_torch_snapshot(None, 0)
        buf = (_Block * max(n, 1))()
        got = lib.gmb_torch_snapshot(buf, n)
        if got <= n:  # else more arrived meanwhile: again
            break
    return [{"device": b.device, "address": b.address, "size": b.size,
             "requested_size": b.requested_size, "stream": b.stream,
             "state": "active_allocated"} for b in buf[:got]]


class _SegBlock(ctypes.Structure):
    """struct gmb_torch_seg_block (client/shim/torch.c)."""
    _fields_ = [("seg_address", ctypes.c_uint64),
                ("seg_size", ctypes.c_uint64), ("address", ctypes.c_uint64),
                ("size", ctypes.c_uint64),
                ("requested_size", ctypes.c_uint64),
                ("stream", ctypes.c_uint64), ("device", ctypes.c_int32),
                ("state", ctypes.c_uint32)]


# GMB_BLOCK_FREE, _LIVE, _PENDING -> PyTorch's block states.
_STATES = ("inactive", "active_allocated", "active_pending_free")


def snapshot(device=None):
    """This process's gmb memory in the format of PyTorch's
    torch.cuda.memory._snapshot(): {"segments": [...], "device_traces":
    [...], "allocator_settings": {...}}.  A segment is a run of consecutive
    pages the cache has mapped (2 MiB pages in a reserved range, as
    PyTorch's expandable segments: "is_expandable" is True), with
    "device", "address", "total_size", "allocated_size", "active_size",
    "requested_size", "stream" (0), "segment_type" ("small" for one page,
    else "large"), "segment_pool_id" ((0, 0)), "frames" ([]) and "blocks":
    each {"address", "size", "requested_size", "state" ("active_allocated",
    "active_pending_free" or "inactive"), "frames": []}, tiling the
    segment in address order.  requested_size is what PyTorch asked for
    when record_history() was on at the allocation, else the size rounded
    to 512.  gmb records no trace of events: "device_traces" holds an
    empty list per device.  device: an index, "cuda:N", or None for
    every device with a session."""
    lib = _lib()
    lib.gmb_torch_blocks.restype = ctypes.c_long
    lib.gmb_torch_blocks.argtypes = [ctypes.c_int, ctypes.c_void_p,
                                     ctypes.c_size_t]
    dev = -1 if device is None else _device_index(device)
    while True:
        n = lib.gmb_torch_blocks(dev, None, 0)
        if n < 0:
            raise RuntimeError("gmb_torch.snapshot: %s" % last_error())
        buf = (_SegBlock * max(n, 1))()
        got = lib.gmb_torch_blocks(dev, buf, n)
        if got < 0:
            raise RuntimeError("gmb_torch.snapshot: %s" % last_error())
        if got <= n:  # else more arrived meanwhile: again
            break
    segments = []
    by_key = {}
    for b in buf[:got]:
        key = (b.device, b.seg_address)
        seg = by_key.get(key)
        if seg is None:
            seg = {"device": b.device, "address": b.seg_address,
                   "total_size": b.seg_size, "allocated_size": 0,
                   "active_size": 0, "requested_size": 0, "stream": 0,
                   "segment_type": "small" if b.seg_size <= 2 << 20
                   else "large",
                   "segment_pool_id": (0, 0), "is_expandable": True,
                   "frames": [], "blocks": []}
            by_key[key] = seg
            segments.append(seg)
        state = _STATES[b.state] if b.state < len(_STATES) else "inactive"
        seg["blocks"].append({"address": b.address, "size": b.size,
                              "requested_size": b.requested_size
                              if state != "inactive" else 0,
                              "state": state, "frames": []})
        if state != "inactive":
            seg["active_size"] += b.size
        if state == "active_allocated":
            seg["allocated_size"] += b.size
            seg["requested_size"] += b.requested_size
    segments.sort(key=lambda s: (s["device"], s["address"]))
    for seg in segments:
        seg["blocks"].sort(key=lambda b: b["address"])
    ndev = max([s["device"] for s in segments] + [dev, 0]) + 1
    return {"segments": segments,
            "device_traces": [[] for _ in range(ndev)],
            "allocator_settings": {"allocator": "gmb",
                                   "expandable_segments": True}}


def _torch_memory_snapshot(mempool_id=None):
    """torch.cuda.memory_snapshot() under gmb: the segments of
    snapshot()."""
    return snapshot()["segments"]


def _torch_snapshot(device=None):
    """torch.cuda.memory._snapshot() under gmb (what _dump_snapshot() and
    the memory visualiser read): snapshot()."""
    return snapshot(device)


# torch.cuda.memory's functions enable() replaces, and with what.  PyTorch's
# memory_stats(), memory_allocated(), max_memory_allocated(),
# memory_reserved() and max_memory_reserved() all read
# memory_stats_as_nested_dict() (a global of torch.cuda.memory), so they
# answer with gmb's figures once it is replaced.
PATCHED = ("memory_stats_as_nested_dict", "reset_peak_memory_stats",
           "mem_get_info", "memory_snapshot", "_snapshot")


def _patch_torch(torch):
    mod = torch.cuda.memory
    ours = {"memory_stats_as_nested_dict": memory_stats_as_nested_dict,
            "reset_peak_memory_stats": reset_peak_memory_stats,
            "mem_get_info": mem_get_info,
            "memory_snapshot": _torch_memory_snapshot,
            "_snapshot": _torch_snapshot}
    for name in PATCHED:
        if hasattr(mod, name):
            setattr(mod, name, ours[name])
        if hasattr(torch.cuda, name):
            setattr(torch.cuda, name, ours[name])
