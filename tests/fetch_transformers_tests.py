"""Fetch transformers' common test files for the installed transformers version (run by `make`'s install step).

    python tests/fetch_transformers_tests.py            # -> <the environment>/transformers-tests/<version>/

`pip download` gets the transformers source distribution of exactly the installed version from
PyPI (a package registry, not the model hub); `tests/test_modeling_common.py` and
`tests/test_configuration_common.py` are extracted from it. Nothing is copied into this repository:
`tests/transformers_common.py` imports them from there.
"""

import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import version
from pathlib import Path

FILES = ("tests/test_modeling_common.py", "tests/test_configuration_common.py")


def target_directory() -> Path:
    """Where the files of the installed transformers version go: inside the running Python's environment."""
    return Path(sys.prefix) / "transformers-tests" / version("transformers")


def fetch() -> Path:
    target = target_directory()
    if all((target / Path(name).name).is_file() for name in FILES) and (target / "__init__.py").is_file():
        return target
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"transformers=={version('transformers')}", "--dest", work], check=True)
        archive = next(Path(work).glob("transformers-*.tar.gz"))
        with tarfile.open(archive) as sdist:
            root = sdist.getnames()[0].split("/")[0]
            for name in FILES:
                member = sdist.extractfile(f"{root}/{name}")
                if member is None:
                    raise SystemExit(f"{name} is not in {archive.name}")
                target.mkdir(parents=True, exist_ok=True)
                (target / Path(name).name).write_bytes(member.read())
    # test_configuration_common imports "transformers" from its own folder's __init__.py (empty is enough).
    (target / "__init__.py").touch()
    return target


if __name__ == "__main__":
    print(f"transformers' common tests in {fetch()}")
