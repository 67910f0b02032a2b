"""What `pip install .` relies on: the version pyproject.toml reads from include/cascade/version.hpp (the
project's one statement of it, which CMakeLists.txt reads too) is the module's."""

import re
import sys

import pytest

import cascade
from conftest import ROOT


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_version_comes_from_the_cmake_project():
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    meta = cfg["tool"]["scikit-build"]["metadata"]["version"]
    match = re.search(meta["regex"], (ROOT / meta["input"]).read_text())
    assert match, "pyproject.toml's version regex no longer matches include/cascade/version.hpp"
    assert match.group("value") == cascade.__version__
    for pkg in cfg["tool"]["scikit-build"]["wheel"]["packages"]:
        assert (ROOT / pkg / "__init__.py").exists()


def test_the_namespace_holds_only_its_own_names():
    """What the package imports for itself (os, warnings, typing, dataclasses) stays out of `cascade.`."""
    public = {name for name in vars(cascade) if not name.startswith("_")}
    assert public == {name for name in cascade.__all__ if not name.startswith("_")}
    assert cascade.Model.__module__ == cascade.Generation.__module__ == "cascade"
