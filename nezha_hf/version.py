"""nezha_hf's version, read without importing the package (which loads PyTorch): `nezha_hf.__version__` and the
command line's `--version` both come from `package_version`.

pyproject.toml holds the version, once. An installed package has it in its metadata; a checkout that was never
pip-installed (on `PYTHONPATH`, as on a GPU machine whose packages cannot be changed) has only pyproject.toml.
"""

import tomllib
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "nezha_hf"
# What a copy with neither pyproject.toml nor metadata reports: a valid PEP 440 version that says so.
UNKNOWN_VERSION = "0+unknown"


def package_version(package_directory: Path = Path(__file__).resolve().parent) -> str:
    """The version of the nezha_hf whose package folder is `package_directory`: the `pyproject.toml` beside it when
    that folder is a nezha_hf source checkout (editable install or `PYTHONPATH`: the code being imported, even where
    another copy is installed), else the installed distribution's metadata, else `UNKNOWN_VERSION`."""
    try:
        project = tomllib.loads((package_directory.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]
        if project["name"] == DISTRIBUTION:
            return project["version"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        pass  # not a checkout (an installed copy has no pyproject.toml)
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return UNKNOWN_VERSION
