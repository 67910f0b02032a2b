"""The README's Python examples, run as written from the repository's root (the generation one where the
model is present)."""

import re

import pytest

from conftest import MODEL, ROOT


def test_readme_examples_run(capsys, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert len(blocks) == 2, "the README's Python section changed: update this test"
    monkeypatch.chdir(ROOT)
    scope = {}
    exec(compile(blocks[0], "README.md (kernels)", "exec"), scope)
    assert "max |cascade - reference|" in capsys.readouterr().out
    if not MODEL.exists():
        pytest.skip(f"{MODEL} is missing (bash scripts/setup.sh fetches it): the generation example is not run")
    exec(compile(blocks[1], "README.md (generation)", "exec"), scope)
    assert capsys.readouterr().out.strip()
