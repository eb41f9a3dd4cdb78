"""Every Python block in the README and the docs runs as pasted.

A block is run unless the line before its fence says why not (``<!-- not run: REASON
-->``: a fragment, or one that needs an engine and a model). The blocks of one file run
in order in one fresh interpreter (a later block may use an earlier one's names), in an
empty working directory, so a relative ``root`` lands there.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(
    [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *ROOT.glob("docs/**/*.md"),
     *ROOT.glob("examples/**/README.md")]
)  # fmt: skip
FENCE = re.compile(r"^```python\s*$")
NOT_RUN = re.compile(r"^<!-- not run: (\S.*\S) -->$")


def blocks(path: Path) -> list[tuple[int, str | None, str]]:
    """``(line, reason not run or None, code)`` of each Python block of ``path``."""
    lines = path.read_text().splitlines()
    out = []
    i = 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            before = next((x for x in reversed(lines[:i]) if x.strip()), "")
            why = NOT_RUN.match(before.strip())
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            out.append((i + 1, why.group(1) if why else None, "\n".join(lines[i + 1 : end])))
            i = end
        i += 1
    return out


WITH_BLOCKS = [p for p in DOCS if any(why is None for _, why, _ in blocks(p))]


def test_the_docs_have_python_blocks_and_most_run() -> None:
    found = [(p, b) for p in WITH_BLOCKS for b in blocks(p)]
    run = [b for _, b in found if b[1] is None]
    assert len(found) >= 8 and len(run) >= len(found) - 3  # (a fence regex that broke)


@pytest.mark.parametrize("path", WITH_BLOCKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_runs_as_pasted(path: Path, tmp_path: Path) -> None:
    parts = []
    for line, why, code in blocks(path):
        if why is None:
            parts.append(f"# --- {path.name}:{line}\n__block__ = {line}\n{code}\n")
    script = tmp_path / "blocks.py"
    script.write_text("\n".join(parts))
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        [sys.executable, str(script)], cwd=work, capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{path.name}: a block failed\n{done.stderr[-3000:]}"


def test_the_readme_lists_every_extra_of_the_package() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| extra | brings | for |") :].split("\n\n")[0]
    listed = set(
        re.findall(r"`([a-z0-9-]+)`", " ".join(ln.split("|")[1] for ln in table.splitlines()[2:]))
    )
    assert listed == set(extras)
