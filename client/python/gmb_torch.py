"""gmb_torch - PyTorch's CUDA memory from the gmb broker.

    import gmb_torch
    gmb_torch.enable()        # before the first CUDA tensor

enable() loads libgmb-torch.so and makes it PyTorch's CUDA allocator
(torch.cuda.memory.CUDAPluggableAllocator).  Every tensor's memory is then a
block of this process's gmb cache, in memory of its tenant ($GMB_TENANT,
$GMB_ENDPOINT as for any gmb client).  Beyond allocation and free, the
pluggable allocator's hooks are given gmb's functions where PyTorch has them
(HOOKS): torch.cuda.empty_cache(), set_per_process_memory_fraction() and
Tensor.record_stream() then reach gmb.  See docs/pytorch.md.
"""
import os

__all__ = ["enable", "library_path", "last_error", "empty_cache", "hooks",
           "HOOKS"]

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


def enable(path=None):
    """Makes gmb PyTorch's CUDA allocator for this process.  Call it before
    any CUDA tensor exists: PyTorch cannot change allocators afterwards.
    Calling it again with the same library does nothing.  Returns the
    library's path."""
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
    torch.cuda.memory.change_current_allocator(alloc)
    _enabled_path = path
    _wired.clear()
    _wired.update(wired)
    return path


def _wire_hooks(alloc, path):
    """Gives each of PyTorch's hooks in HOOKS its libgmb-torch.so function,
    before the allocator is installed (the init hook runs at CUDA's lazy
    initialisation, after that).  A PyTorch without a setter skips it.
    Returns {setter: True when wired, False when this PyTorch lacks it}."""
    import ctypes
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


def hooks():
    """Which of PyTorch's allocator hooks enable() wired in this process:
    {setter name: True, or False when this PyTorch lacks the setter}; empty
    before enable()."""
    return dict(_wired)


def last_error():
    """The last refusal libgmb-torch.so recorded in this process ("no error"
    when none), e.g. after an allocation failed over the tenant's quota."""
    import ctypes
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
    import ctypes
    lib = ctypes.CDLL(_enabled_path or library_path())
    return lib.gmb_torch_empty_cache()
