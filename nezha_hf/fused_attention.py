"""The fused NEZHA attention kernel (`csrc/fused_attention.cpp`): building it, and calling it as an op.

The kernel computes the whole relative attention in one flash-style pass, forward and backward,
for float32, bfloat16 and float16 tensors on CPU, with any padding, causal or UniLM prefix mask, a KV
cache (queries offset against longer keys) and attention dropout (a counter-based hash of a seed, so
the backward regenerates the forward's mask). It is built with `torch.utils.cpp_extension` the first time it is
needed and cached on disk, and registered as the `torch.library` ops `nezha_hf::fused_forward`
and `nezha_hf::fused_backward` (`attention_ops.engine_op`).

This module is an engine: it takes tensors and key flags and knows nothing of models;
`relative_attention.py` decides when it runs.
"""

import contextlib
import hashlib
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch
from packaging.version import Version
from transformers.utils import logging

from .attention_ops import AttentionProblem, Engine, engine_op, fallback_words

logger = logging.get_logger(__name__)

KERNEL_SOURCE = Path(__file__).with_name("csrc") / "fused_attention.cpp"
# Query rows and keys per block of the kernel; 0 lets it choose (as PyTorch's flash kernel does).
KERNEL_BLOCK_SIZES = (0, 0)
# How long to wait for another process's build before giving up; seconds.
LOCK_TIMEOUT_VARIABLE = "NEZHA_HF_KERNEL_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 300.0
# What runs where the kernel is not built, in the words of the warning that says so.
WITHOUT_KERNEL = fallback_words(Engine.FUSED)
# PyTorch before 2.14 marks a build in progress by the mere existence of `lock` in the build folder, which a killed
# build leaves behind and every later load waits on. From 2.14 on that file is an advisory lock the system releases
# when its holder dies, and it stays after every build: its presence then says nothing.
TORCH_WAITS_WHILE_ITS_LOCK_FILE_EXISTS = Version(torch.__version__).release < (2, 14)


def compiler() -> str:
    """The C++ compiler `torch.utils.cpp_extension` builds with: `$CXX`, else `c++` (`cl` on Windows)."""
    return os.environ.get("CXX") or ("cl" if sys.platform == "win32" else "c++")


def compiler_family(command: str) -> str | None:
    """`"msvc"`, `"apple-clang"`, `"clang"` or `"gcc"` for the compiler `command`; None when it is not found."""
    program = shutil.which(shlex.split(command)[0]) if command.strip() else None
    if program is None:
        return None
    if Path(program).stem.lower() in ("cl", "clang-cl"):
        return "msvc"
    try:
        version = subprocess.run([program, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    if "Apple clang" in version:
        return "apple-clang"
    return "clang" if "clang" in version.lower() else "gcc"


def kernel_flags(family: str, machine: str | None = None) -> tuple[list[str], list[str]]:
    """`(compile flags, link flags)` of the kernel for a compiler family on a machine (`platform.machine()`).

    GCC and Clang: optimised for the CPU it runs on, 512-bit vectors on x86 (the kernel's AVX-512 passes), OpenMP.
    Apple's Clang has no OpenMP (without libomp): the kernel then runs on one thread. MSVC: OpenMP, and AVX-512 code
    where PyTorch detects AVX-512; the kernel's vector passes are plain loops otherwise."""
    machine = (machine or platform.machine()).lower()
    x86 = machine in ("x86_64", "amd64", "i686", "x86")
    if family == "msvc":
        avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        return ["/O2", "/openmp", *(["/arch:AVX512"] if avx512 else [])], []
    native = ["-march=native", "-mprefer-vector-width=512"] if x86 else ["-mcpu=native"]
    if family == "apple-clang":
        return ["-O3", *native], []
    return ["-O3", *native, "-fopenmp"], ["-fopenmp"]


def _cpu_signature() -> str:
    """What `-march=native` compiles for: PyTorch's CPU capability and the CPU's feature flags."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):  # x86, ARM
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    return f"{torch.backends.cpu.get_cpu_capability()} {flags}"


def kernel_name() -> str:
    """The extension's name: it changes with the source, PyTorch, the compiler flags, the CPU's instruction set
    and the environment's headers (PyTorch's and Python's, the compiler), and with nothing else. A cache shared
    between machines is never reused on another instruction set; two environments get one build each instead of
    rebuilding each other's; two checkouts of the same source share one (it is compiled from a copy in the
    build folder, so the build command does not name the checkout)."""
    import sysconfig

    from torch.utils import cpp_extension

    digest = hashlib.sha1()
    flags = kernel_flags(compiler_family(compiler()) or "gcc")
    for part in (KERNEL_SOURCE.read_bytes(), torch.__version__, " ".join(flags[0] + flags[1]), _cpu_signature(),
                 *cpp_extension.include_paths(), sysconfig.get_paths()["include"], compiler()):
        digest.update(part if isinstance(part, bytes) else part.encode())
    return f"nezha_hf_fused_attention_{digest.hexdigest()[:12]}"


def build_directory() -> Path:
    """Where the kernel is built and cached: `$TORCH_EXTENSIONS_DIR/<kernel_name()>` (PyTorch's default root,
    `~/.cache/torch_extensions`, when the variable is not set)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / kernel_name()


SWITCH_VARIABLE = "NEZHA_HF_KERNEL"
_OFF, _ON = {"0", "false", "no", "off"}, {"1", "true", "yes", "on", ""}


def kernel_switched_on() -> bool:
    """`NEZHA_HF_KERNEL`: 0 / false / no / off (any case) keep the kernel off; 1 / true / yes / on or unset, on.
    Anything else is a warning and leaves it on."""
    value = os.environ.get(SWITCH_VARIABLE, "1").strip().lower()
    if value not in _OFF | _ON:
        logger.warning(f"{SWITCH_VARIABLE}={value!r} is not one of 1/true/yes/on or 0/false/no/off: the kernel stays on.")
    return value not in _OFF


def lock_timeout() -> float:
    """`NEZHA_HF_KERNEL_LOCK_TIMEOUT` in seconds: finite and not negative, else a warning and the default (300)."""
    text = os.environ.get(LOCK_TIMEOUT_VARIABLE)
    if text is None:
        return DEFAULT_LOCK_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        logger.warning(f"{LOCK_TIMEOUT_VARIABLE}={text!r} is not a number of seconds (finite, 0 or more): waiting "
                       f"{DEFAULT_LOCK_TIMEOUT:.0f} s instead.")
        return DEFAULT_LOCK_TIMEOUT
    return value


def _source_in(directory: Path, source: bytes) -> Path:
    """`source`, the kernel's C++ text, copied into the build folder (atomically, and only when it differs, so that
    ninja's record of what it built stays valid)."""
    copy = directory / KERNEL_SOURCE.name
    if not copy.is_file() or copy.read_bytes() != source:
        staging = directory / f".{KERNEL_SOURCE.name}.{os.getpid()}"
        staging.write_bytes(source)
        os.replace(staging, copy)
    return copy


def compile_kernel(directory: Path, source: bytes, family: str):
    """Builds the kernel's C++ text `source` into `directory` (an existing folder; the module is named after it)
    with the flags of `kernel_flags(family)` and this environment's ninja, and loads it. `fused_kernel()` calls it
    under its build lock; `benchmarks/kernel_ab.py` builds another revision's source with it."""
    from torch.utils.cpp_extension import load

    copy = _source_in(directory, source)
    cflags, ldflags = kernel_flags(family)
    with _environment_ninja_first():
        return load(name=directory.name, sources=[str(copy)], build_directory=str(directory), extra_cflags=cflags,
                    extra_ldflags=ldflags)


@contextlib.contextmanager
def _environment_ninja_first():
    """PATH with this environment's `ninja` (the package's dependency) first while PyTorch builds. PyTorch runs
    whichever `ninja` PATH finds first, and ninja 1.12 changed how its log records a command: with a system ninja of
    another version on PATH, a process with the environment activated and one without took each other's builds for
    changed commands and compiled the kernel again (a minute each time, the build lock held)."""
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja", path=scripts) is None:
        yield
        return
    path = os.environ.get("PATH")
    os.environ["PATH"] = scripts + os.pathsep + path if path else scripts
    try:
        yield
    finally:
        if path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path


_loaded = {}  # "kernel": the extension, or None, once loading it was tried


def fused_kernel():
    """The fused NEZHA attention kernel, built on first use and then cached; None if unavailable.

    It is built with PyTorch's `torch.utils.cpp_extension.load` (a C++ compiler, `kernel_flags` for its family, and
    `ninja`) into `build_directory()`, for the CPU it runs on. It is not used (the engines after it in the chain,
    `attention_ops.Engine`, take its calls) when the environment variable `NEZHA_HF_KERNEL=0` is set, the source file is absent (remote-code checkpoints copy
    only the Python files), no C++ compiler is found, the build fails, or another process's build of the same kernel
    is still going after `NEZHA_HF_KERNEL_LOCK_TIMEOUT` seconds (default 300); each of these is logged once.
    `forget_fused_kernel()` forgets the result, so the next call tries again.
    """
    if "kernel" not in _loaded:
        _loaded["kernel"] = _load_kernel()
    return _loaded["kernel"]


def forget_fused_kernel() -> None:
    """Forget whether the kernel loaded, so that `fused_kernel()` tries again (e.g. after changing `NEZHA_HF_KERNEL`)."""
    _loaded.clear()


def fused_kernel_loaded() -> bool:
    """Whether the kernel is loaded, without trying to load it (what compiled code may ask)."""
    return _loaded.get("kernel") is not None


def _load_kernel():
    if not kernel_switched_on():
        return None
    if not KERNEL_SOURCE.is_file():
        logger.info("NEZHA's fused attention kernel has no source here (remote code copies Python files only).")
        return None
    family = compiler_family(compiler())
    if family is None:
        logger.warning(f"NEZHA's attention kernel is not built: no C++ compiler ({compiler()!r}; set CXX to one) was "
                       f"found, so {WITHOUT_KERNEL}.")
        return None
    from filelock import FileLock, Timeout

    directory = build_directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # One build at a time, through a lock the system releases if its holder dies: while it is held, an older
        # torch's lock file (`lock`) can only be what a killed build left, and is removed rather than waited on.
        with FileLock(directory / "nezha_build.lock", timeout=lock_timeout()):
            if TORCH_WAITS_WHILE_ITS_LOCK_FILE_EXISTS and (directory / "lock").exists():
                logger.warning(f"Removing {directory / 'lock'}, left by a build that was killed.")
                (directory / "lock").unlink(missing_ok=True)
            problem = built_kernel_problem(directory)
            if problem:
                logger.warning(f"NEZHA's attention kernel is built again: {problem}.")
                _built_library(directory).unlink(missing_ok=True)
            if not _built_library(directory).is_file():  # a pause of a minute deserves a word
                logger.warning(f"Compiling NEZHA's attention kernel into {directory}: once per environment, about a "
                               "minute on 2 cores.")
            kernel = compile_kernel(directory, KERNEL_SOURCE.read_bytes(), family)
            _record_build(directory)
            return kernel
    except Timeout:
        reason = (f"another process has been building it for {lock_timeout():.0f} s ({directory / 'nezha_build.lock'}"
                  f" is held; {LOCK_TIMEOUT_VARIABLE} sets the wait)")
    except Exception as error:  # an unusable folder, a compiler that rejects the flags, no ninja: the engines still work
        text = " ".join(str(error).split())  # a compiler's complaint comes last in torch's message
        reason = f"{type(error).__name__}: {text if len(text) <= 600 else text[:200] + ' ... ' + text[-400:]}"
    logger.warning(
        f"NEZHA's fused attention kernel is unavailable ({reason}), so {WITHOUT_KERNEL}. Set TORCH_EXTENSIONS_DIR to "
        f"a writable folder, CXX to another compiler, or {SWITCH_VARIABLE}=0 to skip the kernel."
    )
    return None


# Beside the built library, what it was when this environment built it: a library damaged or replaced since (a
# copy from another machine, a disk error) is built again rather than loaded.
BUILD_RECORD = "nezha_build.json"


def _built_library(directory: Path) -> Path:
    return directory / f"{directory.name}.so"


def built_kernel_problem(directory: Path) -> str | None:
    """Why the kernel library built in `directory` may not be loaded, naming the file, or None: none is built yet,
    or it is the library this environment built (its SHA-256 is the one `BUILD_RECORD` holds)."""
    from .json_files import Object, String, read_json
    from .readers import file_digest

    library, record = _built_library(directory), directory / BUILD_RECORD
    if not os.path.lexists(library):
        return None
    try:
        expected = read_json(record, Object({"sha256": String(max_length=64)}, required=["sha256"]))["sha256"]
        if file_digest(library) != expected:
            return f"{library} is not the library built here ({record} records other contents)"
    except (OSError, ValueError) as error:  # no record (an older nezha_hf's build), or a damaged one
        return f"{library} cannot be checked against {record.name} ({error})"
    return None


def _record_build(directory: Path) -> None:
    """Record the library just built (or loaded) in `directory`, unless its record already says so: a build folder
    another checkout shares is left as it is."""
    from .readers import file_digest
    from .safe_output import write_text_atomically

    if built_kernel_problem(directory) is None:
        return
    write_text_atomically(directory / BUILD_RECORD,
                          json.dumps({"sha256": file_digest(_built_library(directory))}) + "\n")


def product_routine(dtype: torch.dtype) -> str | None:
    """How the kernel multiplies the blocks of `dtype` inputs on this CPU: `"reduced-precision packed"` (bfloat16 or
    float16 blocks through oneDNN's brgemm on packed operands, float32 accumulation: bfloat16 where the CPU has AMX or
    AVX512-BF16, float16 where it has AMX-FP16, and oneDNN is on) or `"float32"` (everything else); None when the
    kernel is not built."""
    kernel = fused_kernel()
    if kernel is None:
        return None
    return kernel.routine_for({torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32"))


# --- the kernel as torch.library ops ------------------------------------------------------------


def _forward(query, key, value, table, problem: AttentionProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """`(output [batch, queries, heads, head_size], lse [batch, heads, queries])`; see `attention_ops.engine_op`.

    bfloat16 and float16 inputs are multiplied in their own type (float32 accumulation) where the CPU has instructions
    for it, and computed in float32 elsewhere (`product_routine`, and the kernel source's header)."""
    kernel = fused_kernel()
    if kernel is None:
        raise RuntimeError("NEZHA's fused attention kernel is unavailable here (see the logged warning).")
    return kernel.forward(query, key, value, table.float(), problem, *KERNEL_BLOCK_SIZES)


def _forward_fake(query, key, value, table, problem):
    batch, heads, length, size = query.shape
    return query.new_empty(batch, length, heads, size), query.new_empty(batch, heads, length, dtype=torch.float32)


def _backward(grad_output, query, key, value, table, problem: AttentionProblem, output, lse):
    """Gradients of query, key and value, `[batch, heads, length, head_size]` views of `[batch, length, heads, ...]`."""
    grads = fused_kernel().backward(grad_output, query, key, value, output, lse, table.float(), problem,
                                    *KERNEL_BLOCK_SIZES)
    return tuple(grad.to(query.dtype).transpose(1, 2) for grad in grads)


def _backward_fake(grad_output, query, key, value, table, problem, output, lse):
    def like(x):
        return x.new_empty(x.shape[0], x.shape[2], x.shape[1], x.shape[3]).transpose(1, 2)

    return like(query), like(key), like(value)


fused_attention = engine_op(Engine.FUSED, _forward, _forward_fake, _backward, _backward_fake, device_types="cpu")
fused_attention.__doc__ = """NEZHA attention by the fused kernel, `[batch, queries, heads, head_size]`.

    Args:
        query: `[batch, heads, queries, head_size]` on CPU; key, value: `[batch, heads, keys, head_size]`.
        table: the `(2K + 1) x head_size` table.
        problem: the mask, scaling and dropout (`attention_ops.AttentionProblem`).

    Call only when `fused_kernel()` is not None.
    """


__all__ = ["KERNEL_SOURCE", "compiler", "compiler_family", "forget_fused_kernel", "fused_attention", "fused_kernel",
           "fused_kernel_loaded", "kernel_flags", "product_routine"]
