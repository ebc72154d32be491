"""What the GPU check runs on, printed first, and whether it has what nezha_hf uses: said plainly, not as a crash later.

    python benchmarks/gpu/gpu_environment.py             # part of benchmarks/gpu/gpu_check.py
    python benchmarks/gpu/gpu_environment.py --rehearse  # on the CPU, Triton's interpreter

The GPU machines this project is lent hold their own PyTorch, Triton and transformers, and nothing can be installed
there but what travels with the repository (`make gpu-prepare`). This prints the Python, PyTorch, CUDA, driver,
Triton, transformers, huggingface_hub, tokenizers, safetensors and accelerate versions and the GPU, then checks:

- the PyTorch and Triton interfaces nezha_hf and the check call (`torch.library`'s op registration, SDPA's backend
  pinning, PyTorch's NaN filling of new tensors, `triton.knobs`, `triton.testing.do_bench`);
- transformers against the floor nezha_hf states (its import refuses an older one), and each of transformers' own
  requirements against what is installed (a carried transformers may need a newer huggingface_hub than the machine's);
- nezha_hf's declared requirements (pyproject.toml): the ones not met are listed; nezha_hf declares torch>=2.13, which
  a machine with an older PyTorch does not meet, and the check runs there all the same when nothing above is missing;
- `import nezha_hf` from the checkout, its version, and whether the Triton engine can run on the device.

Exits 2 with one line per problem when something the check needs is missing; writes `gpu-environment.json` to
`--results`.
"""

import argparse
import importlib
import importlib.metadata
import json
import platform
import sys
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu.gpu_script import rehearsing, write_staged  # noqa: E402

rehearsing(sys.argv)  # before anything imports Triton

import torch  # noqa: E402
from packaging.requirements import Requirement  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("triton", "transformers", "huggingface_hub", "tokenizers", "safetensors", "accelerate")
# What nezha_hf or the check calls that an older PyTorch or Triton may lack: (what, where it is looked up).
INTERFACES = [
    ("torch.library.register_fake (the engines' ops, PyTorch 2.4+)", "torch.library", "register_fake"),
    ("torch.library.register_autograd (the engines' gradients, PyTorch 2.4+)", "torch.library", "register_autograd"),
    ("torch.nn.attention.sdpa_kernel (SDPA pinned to FlashAttention)", "torch.nn.attention", "sdpa_kernel"),
    ("torch.utils.deterministic.fill_uninitialized_memory (NaN-filled outputs)", "torch.utils.deterministic",
     "fill_uninitialized_memory"),
    ("torch.compiler.is_compiling (tracing checks)", "torch.compiler", "is_compiling"),
    ("triton.knobs (how triton_kernels.py asks whether it is interpreted)", "triton", "knobs"),
    ("triton.testing.do_bench (the timings)", "triton.testing", "do_bench"),
]


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def unmet(requirements: list[str]) -> list[str]:
    """The requirements (PEP 508 strings, markers applied to this Python) the installed packages do not meet."""
    missing = []
    for text in requirements:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        version = installed(requirement.name)
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            missing.append(f"{text} (installed: {version or 'none'})")
    return missing


def has_interface(module: str, name: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rehearse", action="store_true", help="on the CPU: no GPU expected")
    parser.add_argument("--results", type=Path, help="folder to write gpu-environment.json to")
    args = parser.parse_args(argv)
    device = "cpu" if args.rehearse else "cuda"
    report = {"python": platform.python_version(), "executable": sys.executable, "torch": torch.__version__,
              "cuda": torch.version.cuda, "gpu": None, "packages": {name: installed(name) for name in PACKAGES}}
    problems = []
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name()
    elif not args.rehearse:
        problems.append("PyTorch sees no CUDA GPU")
    from benchmarks.machine import software_versions  # the driver, as the results files name it

    report["driver"] = software_versions()["driver"]
    for name in ("transformers", "triton"):
        try:
            report[f"{name}_from"] = str(Path(importlib.import_module(name).__file__).parent)
        except ImportError:
            problems.append(f"{name} is not installed")
    report["interfaces"] = {what: has_interface(module, name) for what, module, name in INTERFACES}
    problems += [f"missing: {what}" for what, present in report["interfaces"].items() if not present]
    if report["packages"]["transformers"]:
        report["transformers_requirements_unmet"] = unmet(importlib.metadata.requires("transformers") or [])
        problems += [f"transformers needs {text}" for text in report["transformers_requirements_unmet"]]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    report["nezha_hf_requirements_unmet"] = unmet(project["dependencies"])
    try:
        import nezha_hf
        from nezha_hf.triton_attention import unusable_reason

        report["nezha_hf"] = {"version": nezha_hf.__version__, "from": str(Path(nezha_hf.__file__).parent),
                              "triton_unusable": unusable_reason(device)}
        if report["nezha_hf"]["triton_unusable"]:
            problems.append(f"the Triton engine cannot run on {device}: {report['nezha_hf']['triton_unusable']}")
    except ImportError as error:  # an older transformers is refused here, in words
        problems.append(f"import nezha_hf failed: {error}")
    print(f"Python {report['python']} ({report['executable']}); torch {report['torch']}, CUDA {report['cuda']}, "
          f"driver {report['driver']}; GPU: {report['gpu'] or 'none'}")
    print("; ".join(f"{name} {version or 'not installed'}" for name, version in report["packages"].items()))
    for name in ("transformers", "triton"):
        if f"{name}_from" in report:
            print(f"{name} imported from {report[name + '_from']}")
    if "nezha_hf" in report:
        print(f"nezha_hf {report['nezha_hf']['version']} from {report['nezha_hf']['from']}")
    for text in report["nezha_hf_requirements_unmet"]:
        print(f"note: nezha_hf declares {text}; the GPU check runs without it where nothing below is missing")
    if args.results:
        args.results.mkdir(parents=True, exist_ok=True)
        write_staged(args.results / "gpu-environment.json", json.dumps({**report, "problems": problems}, indent=1))
    for problem in problems:
        print(f"gpu_environment.py: {problem}", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
