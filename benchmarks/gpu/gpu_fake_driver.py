"""A fake H100 for Triton on a machine without a GPU: Triton's own launch path runs, only the launch itself does not.

    with fake_hopper() as gpu:      # Triton now sees one sm_90 GPU; launches compile and stop at the driver
        kernel[grid](...)           # on CPU tensors (their addresses stand for device pointers)
        gpu.launches()              # how many kernel launches reached the driver

Triton launches a kernel through its JIT binder (argument specialisation), the autotuner (its key, cache and pruning),
the compiler (for the GPU's architecture, here sm_90) and a launcher of C code that reads each argument and calls
the CUDA driver's `cuLaunchKernelEx`. `fake_hopper` keeps every one of those steps and replaces only the CUDA driver
(`libcuda.so.1`): a small C library built here with the system's C compiler and loaded under that name, whose
`cuLaunchKernelEx` counts the launch and returns, whose `cuPointerGetAttribute` takes any address for a device
pointer, and which reports an H100's properties (132 multiprocessors, 227 KiB of shared memory a block). Triton's
real `CudaDriver` and `CudaLauncher` are built against it, so the host work of a launch is Triton's own, measured or
compiled exactly as on a GPU machine; nothing runs on a device. The autotuner's benchmark runs each configuration
once (compiling it) and ranks them in their order (`Benchmark`): the first configuration pruning leaves wins.

Used by `gpu_gates.py` (what the launchers compile), `host_overhead.py` (Triton's host time on the CPU) and
`gpu_profile.py --fake-gpu`. Needs a C compiler (`cc`) and Triton's NVIDIA backend (its `cuda.h`). `run_under` runs a
script under another Python's Triton (the GPU machine's 3.6, in a venv that has Triton only) with this Python's
packages, PyTorch among them, after its own.
"""

PACKAGES = "--packages"  # the argument `run_under` adds: where this Python's packages are


def run_under(python: str, script: str, arguments: list[str]) -> int:
    """Run `script arguments` with `python` (a venv of the same Python version with another Triton), this Python's
    packages appended to its path (`PACKAGES`, which the script hands to `append_packages`); its exit status."""
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    return subprocess.run([python, script, *arguments, PACKAGES, sysconfig.get_paths()["purelib"]],
                          env=environment).returncode


def append_packages(packages: str | None) -> None:
    """In a script `run_under` started: this Python's Triton first, then `packages` (PyTorch and the rest) after it."""
    if packages:
        import triton  # noqa: F401  (this Python's, before the packages appended)

        sys.path.append(packages)


import contextlib
import ctypes
import hashlib
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

# The driver functions Triton's `driver.c` and launchers (Triton 3.6 and 3.9) call, as an H100 would answer them.
STUB_SOURCE = r"""
#include <string.h>
#include "cuda.h"

static unsigned long long launches = 0;
unsigned long long nezha_fake_launches(void) { return launches; }

static int fake_object;  /* the address every handle (context, module, function) points to */

CUresult cuInit(unsigned int flags) { return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int *version) { *version = 12080; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int *count) { *count = 1; return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *device, int ordinal) { *device = 0; return CUDA_SUCCESS; }
CUresult cuGetErrorString(CUresult error, const char **text) { *text = "fake CUDA driver"; return CUDA_SUCCESS; }
CUresult cuCtxGetCurrent(CUcontext *context) { *context = (CUcontext)&fake_object; return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext context) { return CUDA_SUCCESS; }
CUresult cuCtxGetDevice(CUdevice *device) { *device = 0; return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *context, CUdevice device) {
  *context = (CUcontext)&fake_object;
  return CUDA_SUCCESS;
}
CUresult cuCtxSetLimit(CUlimit limit, size_t value) { return CUDA_SUCCESS; }
CUresult cuCtxGetLimit(size_t *value, CUlimit limit) { *value = 0; return CUDA_SUCCESS; }
CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attribute, CUdevice device) {
  switch (attribute) {
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *value = 232448; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *value = 49152; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: *value = 65536; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = 132; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *value = 32; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: *value = 1980000; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: *value = 2619000; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *value = 5120; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = 0; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = 1024; break;
    default: *value = 0;
  }
  return CUDA_SUCCESS;
}
CUresult cuModuleLoadData(CUmodule *module, const void *image) {
  *module = (CUmodule)&fake_object;
  return CUDA_SUCCESS;
}
CUresult cuModuleUnload(CUmodule module) { return CUDA_SUCCESS; }
CUresult cuModuleGetFunction(CUfunction *function, CUmodule module, const char *name) {
  *function = (CUfunction)&fake_object;
  return CUDA_SUCCESS;
}
CUresult cuFuncGetAttribute(int *value, CUfunction_attribute attribute, CUfunction function) {
  *value = attribute == CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK ? 1024 : 0;
  return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(CUfunction function, CUfunction_attribute attribute, int value) { return CUDA_SUCCESS; }
CUresult cuFuncSetCacheConfig(CUfunction function, CUfunc_cache config) { return CUDA_SUCCESS; }
CUresult cuOccupancyMaxActiveClusters(int *count, CUfunction function, const CUlaunchConfig *config) {
  *count = 1;
  return CUDA_SUCCESS;
}
CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr pointer) {
  *(CUdeviceptr *)data = pointer;  /* a host address stands for a device pointer */
  return CUDA_SUCCESS;
}
CUresult cuPointerGetAttributes(unsigned int count, CUpointer_attribute *attributes, void **data,
                                CUdeviceptr pointer) {
  for (unsigned int i = 0; i < count; i++) {
    if (attributes[i] == CU_POINTER_ATTRIBUTE_DEVICE_POINTER) *(CUdeviceptr *)data[i] = pointer;
    else if (attributes[i] == CU_POINTER_ATTRIBUTE_MEMORY_TYPE) *(unsigned int *)data[i] = CU_MEMORYTYPE_DEVICE;
    else memset(data[i], 0, sizeof(int));
  }
  return CUDA_SUCCESS;
}
CUresult cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus *status) {
  *status = CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}
CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction function, void **parameters, void **extra) {
  launches++;  /* the one step a GPU would take from here: none */
  return CUDA_SUCCESS;
}
"""


def _triton_nvidia_include() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "include"


def build_stub(directory: Path | None = None) -> Path:
    """The fake `libcuda.so.1`, built once per source and Triton (its `cuda.h`) in `directory` (default: a folder
    under the system's temporary directory)."""
    include = _triton_nvidia_include()
    digest = hashlib.sha256(STUB_SOURCE.encode() + str(include).encode()).hexdigest()[:16]
    folder = (directory or Path(tempfile.gettempdir()) / "nezha-fake-libcuda") / digest
    library = folder / "libcuda.so.1"
    if not library.exists():
        folder.mkdir(parents=True, exist_ok=True)
        source = folder / "fake_libcuda.c"
        source.write_text(STUB_SOURCE)
        scratch = folder / f"libcuda.so.1.{os.getpid()}"
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", f"-I{include}", str(source),
                        "-o", str(scratch)], check=True, capture_output=True, text=True)
        scratch.replace(library)  # atomically: another process may be building the same
    return library


class Benchmark:
    """The autotuner's benchmark under the fake GPU: each configuration runs once (Triton compiles it and launches
    it into the stub) and is timed by its order, so that the first configuration pruning leaves is chosen."""

    def __init__(self):
        self.order = 0

    def __call__(self, kernel_call, quantiles=None, **_):
        kernel_call()
        self.order += 1
        return [float(self.order)] * (len(quantiles) if quantiles else 1)


class _FakeHopper:
    """What `fake_hopper` yields: the count of launches that reached the fake driver."""

    def __init__(self, library: ctypes.CDLL):
        self._count = library.nezha_fake_launches
        self._count.restype = ctypes.c_ulonglong

    def launches(self) -> int:
        return self._count()


@contextlib.contextmanager
def fake_hopper():
    """Triton sees one H100 (sm_90) whose driver launches nothing (module docstring), while inside; on CPU tensors.
    Kernels compile into Triton's cache as for that GPU (set `TRITON_CACHE_DIR` to keep them apart)."""
    import triton
    from triton import knobs
    from triton.backends.nvidia import driver as nvidia

    library_path = build_stub()
    library = ctypes.CDLL(str(library_path), mode=ctypes.RTLD_GLOBAL)  # the soname Triton's modules link against
    previous_path = knobs.nvidia.libcuda_path
    knobs.nvidia.libcuda_path = str(library_path.parent)
    nvidia.libcuda_dirs.cache_clear()
    nvidia.library_dirs.cache_clear()

    class FakeHopperDriver(nvidia.CudaDriver):
        def __init__(self):
            super().__init__()  # builds Triton's `driver.c` against the fake library
            self.get_device_capability = lambda device=None: (9, 0)
            self.get_current_device = lambda: 0
            self.set_current_device = lambda device: None
            self.get_current_stream = lambda device=None: 0
            self.benchmark = Benchmark()

        def get_benchmarker(self):
            return self.benchmark

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

    drivers = triton.runtime.driver
    previous = drivers._active  # None where no driver was made yet (`reset_active` would make the default: none here)
    drivers.set_active(FakeHopperDriver())
    try:
        yield _FakeHopper(library)
    finally:
        drivers._active = previous
        knobs.nvidia.libcuda_path = previous_path
        nvidia.libcuda_dirs.cache_clear()
        nvidia.library_dirs.cache_clear()
