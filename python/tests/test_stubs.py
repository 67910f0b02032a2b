"""The committed type stubs (python/cascade/_cascade.pyi) are what nanobind's stubgen makes of the module
now: a change to the bindings that leaves them stale fails here (regenerate them with scripts/stubs.sh)."""

import difflib
import os
import pathlib
import re
import subprocess
import sys

import pytest

import cascade
from conftest import ROOT

pytest.importorskip("nanobind.stubgen", reason="nanobind is not installed: the stubs are not checked")


def test_stubs_match_the_module(tmp_path):
    # As scripts/stubs.sh makes them: nanobind's stubgen on the imported module.
    out = tmp_path / "_cascade.pyi"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "cascade._cascade", "-p",
                    str(ROOT / "python" / "stubs.pat"), "-o", str(out)],
                   check=True, env=env)
    committed = (ROOT / "python" / "cascade" / "_cascade.pyi").read_text()
    fresh = out.read_text()
    if fresh != committed:
        diff = "".join(difflib.unified_diff(committed.splitlines(True), fresh.splitlines(True), "committed",
                                            "from the module", n=1))
        pytest.fail("python/cascade/_cascade.pyi differs from the module: run bash scripts/stubs.sh\n" + diff[:4000])


def test_package_is_marked_typed():
    assert (ROOT / "python" / "cascade" / "py.typed").exists()
    # The built package (build tree or installed) carries them too, next to the module.
    pkg = pathlib.Path(cascade.__file__).parent
    assert (pkg / "py.typed").exists() and (pkg / "_cascade.pyi").exists(), pkg



def test_readme_example_type_checks(tmp_path, monkeypatch):
    # The README's kernel example under mypy --strict, against these stubs: array arguments accept NumPy arrays
    # (the stubs' Array protocol), results are the caller's own arrays.
    mypy_api = pytest.importorskip("mypy.api", reason="mypy is not installed: the stubs are not type-checked")
    block = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)[0]
    src = tmp_path / "readme_example.py"
    src.write_text(block)
    monkeypatch.setenv("MYPYPATH", str(pathlib.Path(cascade.__file__).parent.parent))
    out, err, status = mypy_api.run(["--strict", "--no-incremental", "--cache-dir", str(tmp_path / "cache"),
                                     str(src)])
    assert status == 0, out + err
