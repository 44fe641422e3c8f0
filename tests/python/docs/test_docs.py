"""The README and docs/ say what works: their Python blocks run here, and their links lead
somewhere. The convention for which blocks run is in docs/README.md, "Code blocks that run";
the parsing and the preambles are in docs_blocks.py."""

import importlib.util
import subprocess
import sys

import pytest

from tests.python.docs import docs_blocks
from tests.python.docs.docs_blocks import ROOT, Block

# A block trains a few steps of a small model; on 2 ranks under torchrun it takes about 10 s
# on 2 busy cores (start-up and imports). The limit only proves that nothing hangs.
TIMEOUT_S = 240

BLOCKS = docs_blocks.python_blocks()
RUNNABLE = [b for b in BLOCKS if b.no_run is None]


def command(block: Block, script: str) -> list[str]:
    if block.ranks is None:
        return [sys.executable, script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={block.ranks}", script]


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.name)
def test_block_runs(block: Block, tmp_path) -> None:
    if block.requires and importlib.util.find_spec(block.requires) is None:
        pytest.skip(f"{block.requires} is not installed (make deps-stacks installs the stacks)")
    script = tmp_path / "block.py"
    script.write_text(docs_blocks.program(block))
    done = subprocess.run(command(block, str(script)), cwd=tmp_path, env=docs_blocks.environment(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, (
        f"the block at {block.name} failed ({done.returncode}):\n{block.code}\n"
        f"{done.stdout[-4000:]}\n{done.stderr[-6000:]}")


def test_every_python_block_is_found_and_well_marked() -> None:
    # The parser against a plain count of opening fences: a block it missed would never run.
    for path in docs_blocks.doc_files():
        fences = sum(1 for line in path.read_text().split("\n") if line.startswith("```python"))
        parsed = [b for b in BLOCKS if b.path == path]
        assert len(parsed) == fences, f"{docs_blocks.relative(path)}: {fences} python fences, " \
                                      f"{len(parsed)} parsed"
    problems = [f"{b.name}: {p}" for b in BLOCKS for p in b.problems]
    assert not problems, "\n".join(problems)
    # The README's own example is one that runs.
    assert any(b.path.name == "README.md" for b in RUNNABLE)


def test_links_lead_somewhere() -> None:
    broken = [f"{docs_blocks.relative(path)}:{line}: ({target}) {why}"
              for path in docs_blocks.doc_files()
              for line, target in docs_blocks.links(path)
              if (why := docs_blocks.broken_link(path, target))]
    assert not broken, "\n".join(broken)


def test_every_page_is_linked_from_both_indexes() -> None:
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages, "docs/ has no pages"
    for index, prefix in ((ROOT / "README.md", "docs/"), (ROOT / "docs" / "README.md", "")):
        targets = {t.partition("#")[0] for _, t in docs_blocks.links(index)}
        missing = sorted(p for p in pages if prefix + p not in targets)
        assert not missing, f"{docs_blocks.relative(index)} does not link {missing}"
