"""The whole GPU check of NEZHA's Triton engine in one run of at most 9 minutes, a short table printed last.

    python3 benchmarks/gpu/gpu_check.py               # on the GPU machine (docs/performance.md: the device `run` call)
    python3 benchmarks/gpu/gpu_check.py --rehearse    # here: everything but the GPU (Triton's interpreter, tiny sizes)

It sets itself up on the machine's own packages and runs each step in a fresh process within its time budget:

1. setup: the wheels `make gpu-prepare` put in .gpu/wheels/ (transformers >= 5.24, which the machine lacks) are
   installed with `pip install --no-index --no-deps --target` into a scratch folder that goes first on PYTHONPATH,
   then the checkout (nezha_hf is not installed: it declares torch>=2.13); Triton's cache from an earlier run is
   unpacked when it was carried back as .gpu/triton-cache.tar.gz (`--cache`);
2. environment: the versions, and whether PyTorch, Triton and transformers have what nezha_hf uses
   (gpu_environment.py); a missing piece ends the run, said in words;
3. correctness against the float64 formula (gpu_correctness.py): a failed case ends the run before any timing;
4. the attention op against SDPA's FlashAttention (gpu_attention.py), with the plain FlashAttention-2 Triton kernel
   (the yardstick) on the same tensors and blocks, and the decoding step eager and under torch.compile;
4b. host time against wall time per call, NEZHA's and SDPA's, and a cProfile of NEZHA's training step
   (gpu_host_time.py);
5. a 12-layer base-width model at 2,048 tokens, bfloat16, forward and forward+backward, against BERT-SDPA
   (attention.py --device cuda), with both models' error against float64;
6. the model profiled: host time against kernel time per layer, batch 1 and 8 at 2,048 tokens, NEZHA against
   BERT-SDPA (gpu_profile.py);
7. each `--variant` (environment settings, e.g. `NEZHA_CHECK_BLOCKS=forward=64x64x4x3`, gpu_attention.py's switch
   that pins a kernel's blocks): the attention op's bfloat16 forward and training rows again in a fresh process
   with those settings, written to `gpu-attention-<name>.json` row by row.

The steps run in that order, which is their order of importance: a step is given at most its own budget and what
is left of the run's, and one that would get less than 10 seconds is not run (the summary says so). `--only` runs
some of them. The summary prints, beside the timed rows, the CPU gate counts (registers, spills, blocks per SM,
wgmma / mma.sync, instructions per pair; `make gpu-gates`, which writes `--gates`) of each kernel configuration the
autotuner chose, so that a slot's timings sit beside the counts that should explain them.

Every step runs with `NEZHA_HF_KERNEL=0` (the CPU kernel is not built) and Triton's cache in the scratch folder; the
speed steps also keep Triton's autotuning choices there (`TRITON_CACHE_AUTOTUNING=1`), so that a second run neither
recompiles nor retunes. A step that runs past its budget is stopped and the next one runs (a correctness step cut
short is reported as incomplete); the run fits `--budget` seconds (default 510) whatever the steps take.

The results folder (`--results`; default $OUT, where the device tool looks, else gpu-check-results/) gets at most
5 files (the device tool brings back 8, of at most 16 MiB each): `gpu-check.log` (everything printed, written as it
comes), `summary.md` (the table printed last), `results.tar.gz` (the results files: unpack into
benchmarks/gpu/results/) and `triton-cache.tar.gz` (the compiled kernels and autotuning choices; in two parts of
15 MiB at most, `.00` and `.01`, if larger; copy them into .gpu/ to carry them into the next run, which unpacks them).
"""

import argparse
import gzip
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.gpu.gpu_script import attention_cells, write_staged  # noqa: E402

CARRIED = ROOT / ".gpu"  # what travels with the checkout to the GPU machine (ignored by git)
PART_SIZE = 15 * 2**20  # the device tool brings back files of at most 16 MiB
MAX_CACHE_PARTS = 2  # 30 MiB: with the checkout (4 MB) and the wheel (14 MB) it travels back within 64 MiB
PACK_RESERVE = 20  # seconds kept for packing the results
GATES = ROOT / "benchmarks" / "gpu" / "results" / "gates.json"  # what `make gpu-gates` writes


@dataclass(frozen=True)
class Step:
    """One step: its name, its command (after the Python that runs it), its budget in seconds, whether it is a
    speed step (Triton's autotuning choices cached), and the environment settings it adds (a variant's)."""

    name: str
    command: list[str]
    seconds: int
    timed: bool = False
    settings: dict | None = None  # environment settings of a variant


@dataclass(frozen=True)
class Variant:
    """A variant of the attention op's timing: its name (letters, digits, '-', '_', '.') and the environment
    settings it runs with."""

    name: str
    settings: dict

    @classmethod
    def parse(cls, text: str) -> "Variant":
        """`NAME VAR=VALUE [VAR=VALUE ...]` (as `--variant` takes it); a malformed one raises ValueError in words."""
        name, *pairs = text.split()
        if not name.replace("-", "").replace("_", "").replace(".", "").isalnum() or "=" in name:
            raise ValueError(f"variant {text!r}: its first word is its name (letters, digits, '-', '_', '.')")
        if not pairs or not all("=" in pair and pair.split("=", 1)[0].isidentifier() for pair in pairs):
            raise ValueError(f"variant {text!r}: after its name come VAR=VALUE settings")
        return cls(name, dict(pair.split("=", 1) for pair in pairs))


STEP_NAMES = ["environment", "correctness", "attention op", "host time", "model", "model profile", "variants"]


def steps(rehearse: bool, work: Path, variants: list[Variant] = ()) -> list[Step]:
    """The steps after setup in their order of importance, with their budgets in seconds (the run's `--budget` cuts
    the later ones: a first run, which compiles every kernel, rarely reaches the profile or the variants; one with the
    carried cache does); rehearsing under the interpreter on 2 shared cores, each is slower."""
    mode = ["--rehearse"] if rehearse else []
    results = ["--results", str(work)]
    model = (["--device", "cpu", "--attention", "nezha_triton", "--layers", "1", "--lengths", "32", "--repeats", "1",
              "--accuracy-length", "32", "--memory-lengths"] if rehearse else
             ["--device", "cuda", "--layers", "12", "--lengths", "2048", "--repeats", "5", "--accuracy-length", "512",
              "--memory-lengths", "2048", "--memory-runs", "1"])
    scale = 4 if rehearse else 1
    # Rehearsing, lengths of whole 16-token blocks, so that the yardstick (which takes no mask) runs too.
    lengths = ["--lengths", "32", "--cache", "32"] if rehearse else []
    return [
        Step("environment", ["benchmarks/gpu/gpu_environment.py", *mode, *results], 60 * scale),
        Step("correctness", ["benchmarks/gpu/gpu_correctness.py", *mode, *results], 170 * scale),
        # bfloat16 only (the targets' dtype; with float16 too the first run's compilation ran past the budget)
        Step("attention op", ["benchmarks/gpu/gpu_attention.py", *mode, *results, *lengths, "--dtypes", "bfloat16",
                              "--yardstick", "--compile", "--profile"], 180 * scale, timed=True),
        # host against wall time per call, NEZHA's and SDPA's (the attention op's kernels compiled and tuned by now)
        Step("host time", ["benchmarks/gpu/gpu_host_time.py", *mode, *results], 60 * scale, timed=True),
        Step("model", ["benchmarks/attention.py", *model, "--dtype", "bfloat16", "--eager-up-to", "0", *results,
                       "--output", "attention-cuda-bfloat16"], 150 * scale, timed=True),
        Step("model profile", ["benchmarks/gpu/gpu_profile.py", *mode, *results], 90 * scale, timed=True),
        *(Step(f"variant {variant.name}", ["benchmarks/gpu/gpu_attention.py", *mode, *results, *lengths, "--dtypes",
                                           "bfloat16", "--yardstick", "--cases", "forward", "forward+backward",
                                           "--output", f"gpu-attention-{variant.name}"],
               90 * scale, timed=True, settings=variant.settings) for variant in variants),
    ]


class Log:
    """Everything printed, also written to `gpu-check.log` in the results folder as it comes (so a run cut short
    still brings it back)."""

    def __init__(self, path: Path):
        self.file = path.open("a", encoding="utf-8")

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.file.write(text + "\n")
        self.file.flush()


def run_step(command: list[str], environment: dict, seconds: float, log: Log) -> int:
    """Run `command` in its own process group, its output into `log` line by line; stopped (the whole group: the
    correctness workers too) after `seconds`, which returns 124, as `timeout` does."""
    process = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, errors="replace", start_new_session=True)
    expired = threading.Event()

    def stop():
        expired.set()
        for sent in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sent)
            except ProcessLookupError:
                return
            time.sleep(5)

    timer = threading.Timer(max(seconds, 1), stop)
    timer.daemon = True
    timer.start()
    for line in process.stdout:
        log(line.rstrip("\n"))
    process.wait()
    timer.cancel()
    return 124 if expired.is_set() else process.returncode


def carried_cache(folder: Path) -> list[Path]:
    """The carried Triton cache in `folder`: `triton-cache.tar.gz`, else its parts `.00`, `.01` in order."""
    whole = folder / "triton-cache.tar.gz"
    return [whole] if whole.is_file() else sorted(folder.glob("triton-cache.tar.gz.[0-9][0-9]"))


def unsafe_member(member: tarfile.TarInfo, cache: Path) -> str | None:
    """Why `member` of a carried Triton cache is not unpacked into `cache`, or None: only regular files and folders
    whose names stay inside it are (a cache holds nothing else). No link of any kind, device or FIFO is made, so no
    chain of links can lead a later member out (CVE-2025-4517 got past `extractall(filter="data")`)."""
    if not (member.isfile() or member.isdir()):
        kind = ("a symbolic link" if member.issym() else "a hard link" if member.islnk() else "a device"
                if member.ischr() or member.isblk() else "a FIFO" if member.isfifo() else "no plain file or folder")
        return f"{member.name!r} is {kind}"
    name = Path(member.name)
    if not member.name or name.is_absolute() or ".." in name.parts or not (cache / name).resolve().is_relative_to(
            cache.resolve()):
        return f"{member.name!r} lies outside the cache"
    return None


def _read_part(part: Path) -> bytes:
    """A part of the carried cache, read as nezha_hf reads any file (a regular file: a FIFO would hang the check);
    `regular_files` is loaded by its path, as the check runs before the package's requirements are installed."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("regular_files", ROOT / "nezha_hf" / "regular_files.py")
    regular_files = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regular_files)
    with regular_files.open_regular_file(part) as file:
        return file.read()


def restore_cache(cache: Path, parts: list[Path], log: Log) -> None:
    """Unpack a carried Triton cache (one archive, or its parts in order) into `cache`: its regular files and folders,
    member by member, by name; an archive holding anything else (`unsafe_member`) is refused whole."""
    if not parts:
        log("setup: no Triton cache carried (.gpu/triton-cache.tar.gz): kernels compile in this run")
        return
    names = ", ".join(part.name for part in parts)
    try:
        data = b"".join(_read_part(part) for part in parts)
        # Decompressed whole first: gzip's checksum is at its end, which a tar reader need not reach (a changed byte
        # would be unpacked as a damaged kernel).
        with tarfile.open(fileobj=io.BytesIO(gzip.decompress(data)), mode="r:") as archive:
            members = archive.getmembers()
            problem = next((why for member in members if (why := unsafe_member(member, cache))), None)
            if problem:
                log(f"setup: the carried Triton cache ({names}) is refused ({problem}): kernels compile in this run")
                return
            for member in members:
                target = cache / member.name
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                # O_NOFOLLOW: a file is written where its name says, never through a link.
                descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
                with os.fdopen(descriptor, "wb") as file, archive.extractfile(member) as source:
                    shutil.copyfileobj(source, file)
    except (tarfile.TarError, EOFError, OSError, ValueError, zlib.error) as error:
        log(f"setup: the carried Triton cache ({names}) could not be unpacked ({error}): kernels compile in this run")
        return
    log(f"setup: Triton cache restored from {', '.join(part.name for part in parts)} ({len(data) / 2**20:.1f} MiB)")


def install_wheels(wheels: list[Path], site: Path, log: Log) -> bool:
    """`pip install --no-index --no-deps --target site` of the carried wheels (the machine's own packages untouched)."""
    if not wheels:
        log("setup: no wheels in .gpu/wheels/ (`make gpu-prepare`): the machine's own transformers is used")
        return True
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                           "--disable-pip-version-check", "--target", str(site), *map(str, wheels)],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        log(f"setup: installing {', '.join(w.name for w in wheels)} failed: {done.stderr.strip()[-1000:]}")
        return False
    log(f"setup: installed {', '.join(w.name for w in wheels)} into {site}")
    return True


def pack(results: Path, work: Path, cache: Path, log: Log) -> None:
    """`results.tar.gz` of the results files, and Triton's cache as `triton-cache.tar.gz` (in parts if larger than
    one file the device tool brings back), each written beside its name and renamed in."""
    with tarfile.open(results / ".results.tar.gz.tmp", "w:gz") as archive:
        for path in sorted(work.iterdir()):
            archive.add(path, arcname=path.name)
    os.replace(results / ".results.tar.gz.tmp", results / "results.tar.gz")
    if not cache.is_dir():
        return
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as archive:
        archive.add(cache, arcname=".")
    data = buffer.getvalue()
    parts = [data[start:start + PART_SIZE] for start in range(0, len(data), PART_SIZE)]
    if len(parts) > MAX_CACHE_PARTS:
        log(f"Triton's cache is {len(data) / 2**20:.0f} MiB packed, more than {MAX_CACHE_PARTS} files of 15 MiB: "
            "not kept (a next run compiles again)")
        return
    names = ["triton-cache.tar.gz"] if len(parts) == 1 else [f"triton-cache.tar.gz.{i:02d}" for i in range(len(parts))]
    for name, part in zip(names, parts):
        (results / f".{name}.tmp").write_bytes(part)
        os.replace(results / f".{name}.tmp", results / name)
    log(f"Triton's cache: {len(data) / 2**20:.1f} MiB packed into {', '.join(names)}")


def attention_lines(rows: list[dict]) -> list[str]:
    """The attention op's rows as a short table: NEZHA, SDPA and the yardstick, the ratios, the target, NEZHA's
    blocks."""
    lines = ["| op | dtype | keys | NEZHA ms | SDPA ms | ratio | target | yardstick ms | NEZHA / yardstick | "
             "yardstick / SDPA | NEZHA's blocks |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    for row in rows:
        goal = "-" if row["target"] is None else f"<= {row['target']} {'met' if row['met'] else 'NOT met'}"
        cells = attention_cells(row)
        lines.append(f"| {row['case']} | {row['dtype']} | {row['keys']:,} | {cells['nezha']} | {cells['sdpa']} | "
                     f"{cells['ratio']} | {goal} | {cells['yardstick']} | {cells['blocks']} |")
    return lines


def gate_lines(timed: list[dict], gates_file: Path, triton_version: str | None) -> list[str]:
    """The CPU gate counts (`gates_file`, written by `make gpu-gates`) of each kernel configuration the timed rows
    ran (`configs` of each row of gpu-attention*.json), with the yardstick's at the same configuration."""
    chosen = {}  # (gates kernel, case, configuration) in order of first use
    for row in timed:
        case = "no mask, dropout" if row.get("dropout") else "no mask"  # the op's rows have no mask
        for kernel, config in row.get("configs", {}).items():
            chosen.setdefault((kernel, case, config), None)
    if not chosen:
        return []
    if not gates_file.is_file():
        return ["", f"Gate counts: none ({gates_file.name} not found: `make gpu-gates` writes it before a slot)."]
    from benchmarks.gpu import gpu_gates

    gates = json.loads(gates_file.read_text())
    counted = {(gpu_gates.SHORT[row["kernel"]], row["case"], row["config_name"]): row for row in gates["rows"]}
    made = f"Triton {gates.get('triton')}" + ("" if triton_version in (None, gates.get("triton")) else
                                               f", NOT this run's Triton {triton_version}")
    lines = ["", f"CPU gate counts of the configurations timed ({gates_file.name}, {made}; sm_90; instructions per "
             "(query, key) pair of the costliest tail loop; `-`: not in the counts, e.g. a configuration they do not "
             "compile):", "",
             "| kernel | case | block, warps, stages | registers | stack bytes | blocks/SM | wgmma / mma.sync | "
             "tail per pair (x yardstick) | band tile (tail tiles) |", "|---|---|---|---|---|---|---|---|---|"]
    for kernel, case, config in chosen:
        row = counted.get((kernel, case, config))
        if row is None:
            lines.append(f"| {kernel} | {case} | {config} | - | - | - | - | - | - |")
            continue
        tail, band = gpu_gates._tail(row), gpu_gates._band(row)
        plain = counted.get((f"yardstick {kernel}", gpu_gates.YARDSTICK, config))
        plain_tail = gpu_gates._tail(plain) if plain else None
        tail_text = "-" if not tail else f"{tail['per_pair']:.2f}" + (
            f" ({tail['per_pair'] / plain_tail['per_pair']:.2f}x)" if plain_tail else "") + (
            f", {tail['spills']} LDL/STL" if tail["spills"] else "")
        band_text = f"{band['instructions'] / tail['instructions']:.2f}" if band and tail else "-"
        lines.append(f"| {kernel} | {case} | {config} | {row['registers']} | {row['stack']} | {row['blocks_per_sm']} | "
                     f"{row['wgmma']} / {row['mma_sync']} | {tail_text} | {band_text} |")
    return lines


def summary_table(work: Path, statuses: dict, gates_file: Path = GATES) -> str:
    """The short table: each step's outcome, the correctness cases passed, the speed ratios with the targets (the
    yardstick's beside them), the variants' rows, the model's profile, and the gate counts of what was timed."""
    lines = ["| step | outcome |", "|---|---|"]
    lines += [f"| {name} | {status} |" for name, status in statuses.items()]

    def read(name):
        path = work / name
        return json.loads(path.read_text()) if path.is_file() else None

    correctness = read("gpu-correctness.json")
    if correctness:
        cases = correctness["cases"]
        failed = [case["case"] for case in cases if case["failure"]]
        lines += ["", f"Correctness: {len(cases) - len(failed)} of {len(cases)} cases passed"
                  + (f"; FAILED: {', '.join(failed)}" if failed else "")
                  + ("" if correctness["complete"] else " (incomplete)") + "."]
        goal = ", target <= 1" if correctness["machine"]["gpu"] else ""
        lines += [f"- {row['dtype']} {row['quantity']}: error {row['nezha']:.1e}, SDPA's {row['sdpa']:.1e} "
                  f"(ratio {row['ratio']:.2f}{goal})" for row in correctness["against_sdpa"]]
    timed, triton_version = [], None
    # the attention op's rows first, then each variant's
    for path in sorted(work.glob("gpu-attention*.json"), key=lambda path: (path.stem != "gpu-attention", path.name)):
        attention = json.loads(path.read_text())
        variant = path.stem.removeprefix("gpu-attention").removeprefix("-")
        lines += ["", f"Variant {variant}:" if variant else "The attention op:", "",
                  *attention_lines(attention["rows"])]
        timed += attention["rows"]
        triton_version = attention["machine"].get("software", {}).get("triton", triton_version)
    model = read("attention-cuda-bfloat16.json")
    if model:
        goal = " (target <= 1.15)" if model["machine"]["gpu"] else ""
        for row in model["time"]:
            lines.append(f"\nModel, {row['tokens']:,} tokens: forward {row['ratio_fwd']:.2f}x BERT-SDPA, "
                         f"forward+backward {row.get('ratio_train', float('nan')):.2f}x{goal}")
        for entry in model["memory"]:
            lines.append(f"Model memory, {entry['tokens']:,} tokens: forward+backward "
                         f"{entry.get('ratio_train', float('nan')):.2f}x BERT-SDPA's")
        for kind, error in model["accuracy"].items():
            lines.append(f"Model error against float64 ({kind}): {error['relative']:.2e}")
    host = read("gpu-host-time.json")
    if host:
        lines += ["", "Host time per call (ms): NEZHA host / wall, SDPA host / wall", ""]
        lines += [f"- {row['call']}: NEZHA {row['NEZHA_host_ms']:.3f} / {row['NEZHA_wall_ms']:.3f}, SDPA "
                  f"{row['SDPA_host_ms']:.3f} / {row['SDPA_wall_ms']:.3f}" for row in host["rows"]]
    profile = read("gpu-profile.json")
    if profile:
        lines += ["", "Model profile, per layer (forward): host ms / kernel ms", ""]
        lines += [f"- {row['model']}, batch {row['batch']} x {row['tokens']:,}: host {row['host_ms']:.3f}, kernels "
                  f"{row['kernel_ms']:.3f}" for row in profile["rows"]]
    lines += gate_lines(timed, gates_file, triton_version)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rehearse", action="store_true", help="on the CPU under Triton's interpreter, tiny sizes")
    parser.add_argument("--results", type=Path, help="folder for what comes back (default: $OUT, else gpu-check-results/)")
    parser.add_argument("--budget", type=float, help="seconds the whole run may take (default 510; rehearsing, 1800)")
    parser.add_argument("--cache", type=Path, default=CARRIED, help="folder holding a carried triton-cache.tar.gz")
    parser.add_argument("--only", nargs="+", choices=STEP_NAMES, help="run these steps only (default: all)")
    parser.add_argument("--variant", action="append", default=[], metavar="'NAME VAR=VALUE ...'",
                        help="time the attention op again with these environment settings, in a fresh process "
                             "(repeatable), e.g. 'fwd64 NEZHA_CHECK_BLOCKS=forward=64x64x4x3'")
    parser.add_argument("--gates", type=Path, default=GATES,
                        help="the gate counts `make gpu-gates` wrote (default benchmarks/gpu/results/gates.json)")
    args = parser.parse_args(argv)
    try:
        variants = [Variant.parse(text) for text in args.variant]
    except ValueError as error:
        parser.error(str(error))
    deadline = time.monotonic() + (args.budget or (1800 if args.rehearse else 510))
    results = (args.results or Path(os.environ.get("OUT") or ROOT / "gpu-check-results")).resolve()
    results.mkdir(parents=True, exist_ok=True)
    log = Log(results / "gpu-check.log")
    scratch = Path(tempfile.mkdtemp(prefix="nezha-gpu-check-"))
    work, site, cache = scratch / "results", scratch / "site", scratch / "triton-cache"
    work.mkdir()
    log(f"NEZHA GPU check{' (rehearsal: CPU, Triton interpreter, tiny sizes)' if args.rehearse else ''}: "
        f"checkout {ROOT}, results in {results}, scratch {scratch}")
    statuses = {}
    try:
        restore_cache(cache, carried_cache(args.cache), log)
        statuses["setup"] = ("done" if install_wheels(sorted((CARRIED / "wheels").glob("*.whl")), site, log)
                             else "FAILED")
        environment = {**os.environ, "NEZHA_HF_KERNEL": "0", "TRITON_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1",
                       "PYTHONPATH": os.pathsep.join(filter(None, [str(site), str(ROOT),
                                                                   os.environ.get("PYTHONPATH")]))}
        if args.rehearse:
            environment["TRITON_INTERPRET"] = "1"
        for step in steps(args.rehearse, work, variants) if statuses["setup"] == "done" else []:
            variant = step.settings is not None
            if args.only and ("variants" if variant else step.name) not in args.only:
                continue
            seconds = min(step.seconds, deadline - time.monotonic() - PACK_RESERVE)
            if seconds < 10:
                statuses[step.name] = "not run: out of time"
                continue
            settings = " ".join(f"{name}={value}" for name, value in (step.settings or {}).items())
            log(f"\n=== {step.name}{f' ({settings})' if settings else ''} (budget {seconds:.0f} s) ===")
            started = time.monotonic()
            code = run_step([sys.executable, *step.command], {**environment, **(
                {"TRITON_CACHE_AUTOTUNING": "1"} if step.timed else {}), **(step.settings or {})}, seconds, log)
            took = f"{time.monotonic() - started:.0f} s"
            if code == 0:
                statuses[step.name] = f"passed ({took})"
            elif code == 124:
                statuses[step.name] = f"INCOMPLETE: stopped at its budget ({took})"
            else:
                statuses[step.name] = f"FAILED (exit {code}, {took}): see the log above"
                # A missing piece, a wrong result or an engine that did not run: nothing after it is trustworthy. A
                # variant fails alone (a switch it sets may be refused); the others still run.
                if not variant:
                    break
    finally:
        pack(results, work, cache, log)
        table = summary_table(work, statuses, args.gates)
        write_staged(results / "summary.md", table)
        shutil.rmtree(scratch, ignore_errors=True)
        log("\n=== summary ===")
        log(table)
    return 0 if all(status.startswith(("done", "passed")) for status in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
