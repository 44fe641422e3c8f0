"""The code blocks and links of README.md and docs/*.md, for tests/python/docs/test_docs.py.

Which fenced blocks run, and how, is said by the words after ``python`` in the block's info
string (the convention is documented in docs/README.md, "Code blocks that run"):
``ranks=N`` (under torchrun on N gloo ranks), ``setup=NAME`` (a preamble of SETUPS before
the block, its check after it), ``requires=MODULE`` and ``no-run: REASON``."""

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


@dataclass
class Block:
    path: Path
    line: int  # the first line of code (1-based), after the opening fence
    end: int  # the closing fence's line
    language: str
    info: str  # the info string's words after the language
    code: str
    ranks: int | None = None
    setup: str | None = None
    requires: str | None = None
    no_run: str | None = None  # the reason
    problems: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{relative(self.path)}:{self.line}"


def _parse_info(block: Block) -> None:
    """Reads ranks=, setup=, requires= and no-run: from the info string; anything else is a
    problem (a misspelt word must not silently turn a block into another kind)."""
    rest = block.info
    if "no-run" in rest:
        before, _, reason = rest.partition("no-run")
        block.no_run = reason.lstrip(":").strip()
        if not reason.startswith(":") or not block.no_run:
            block.problems.append("no-run needs a reason: `no-run: REASON`")
        rest = before
    for word in rest.split():
        key, sep, value = word.partition("=")
        if key == "ranks" and sep and value.isdigit() and int(value) >= 1:
            block.ranks = int(value)
        elif key == "setup" and sep and value in SETUPS:
            block.setup = value
        elif key == "requires" and sep and value:
            block.requires = value
        else:
            block.problems.append(f"unknown word {word!r} in the info string (ranks=N, "
                                  f"setup={'|'.join(SETUPS)}, requires=MODULE, no-run: REASON)")
    if block.setup and not block.ranks:
        block.problems.append("setup= preambles start a process group: give ranks= too")


def blocks(path: Path) -> list[Block]:
    """Every fenced code block of a Markdown file."""
    found: list[Block] = []
    lines = path.read_text().split("\n")
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, info = opening.group(1), opening.group(2).strip()
        end = i + 1
        while end < len(lines) and not re.match(
                rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        language, _, rest = info.partition(" ")
        block = Block(path, i + 2, end + 1, language, rest.strip(),
                      "\n".join(lines[i + 1:end]) + "\n")
        if language == "python":
            _parse_info(block)
        found.append(block)
        i = end + 1
    return found


def python_blocks() -> list[Block]:
    return [b for path in doc_files() for b in blocks(path) if b.language == "python"]


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    inside = {n for b in blocks(path) for n in range(b.line - 1, b.end + 1)}
    return [(n, text) for n, text in enumerate(path.read_text().split("\n"), start=1)
            if n not in inside]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, text in prose_lines(path):
        heading = HEADING.match(text)
        if not heading:
            continue
        base = slug(heading.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")  # GitHub numbers repeated headings
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link in the prose (code spans left out)."""
    out = []
    for n, text in prose_lines(path):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", text)):
            out.append((n, target))
    return out


def broken_link(path: Path, target: str) -> str | None:
    """Why `target` (a link in `path`) leads nowhere, or None."""
    if re.match(r"^[a-z]+:", target):
        return None  # http(s), mailto: not checked here (no network in the suite)
    file_part, _, anchor = target.partition("#")
    dest = (path.parent / file_part).resolve() if file_part else path
    if not dest.exists():
        return f"{file_part} does not exist"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{relative(dest)} has no heading with anchor #{anchor}"
    return None


# Preambles for blocks that continue a program (setup=NAME): what the block uses, and a check
# after it. The check trains one step through `model` on different data per rank and asserts
# that every rank then holds the same gradients: the block's model really reduces.
_COMMON = '''\
import torch
import torch.distributed as dist
import fastddp

dist.init_process_group("gloo")
torch.manual_seed(0)


def make_module():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def train_step(model):
    data = torch.randn(16, 32, generator=torch.Generator().manual_seed(dist.get_rank()))
    model.zero_grad()
    model(data).square().mean().backward()


def step_and_check(model):
    train_step(model)
    for name, p in model.module.named_parameters():
        grads = [torch.empty_like(p.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(grads, p.grad)
        assert all(torch.equal(g, grads[0]) for g in grads), f"ranks disagree on {name}'s grad"
    print(f"rank {dist.get_rank()}: the gradients agree on every rank")
'''

_PATH = 'path = f"checkpoint_rank{dist.get_rank()}.pt"  # one file per rank\n'

SETUPS: dict[str, tuple[str, str]] = {
    # A module to wrap.
    "module": (_COMMON + "module = make_module()\n", "step_and_check(model)\n"),
    # torch's PowerSGD recipe: a model without a hook, its optimizer, a second model to resume
    # on, the process group.
    "powersgd_state": (
        _COMMON + "from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd\n"
        "model = fastddp.DistributedDataParallel(make_module())\n"
        "optim = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "new_model = fastddp.DistributedDataParallel(make_module())\n"
        "group = dist.group.WORLD\n" + _PATH,
        "step_and_check(new_model)\n"),
    # fastddp's PowerSGD, past its allreduce warm-up (start_powerSGD_iter=2), with error
    # feedback and Q to save.
    "powersgd_model": (
        _COMMON + "model = fastddp.DistributedDataParallel(make_module())\n"
        "model.register_comm_hook(None, fastddp.hooks.powersgd(matrix_approximation_rank=2, "
        "start_powerSGD_iter=2))\n"
        "optim = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    train_step(model)\n"
        "    optim.step()\n"
        "assert model.comm_hook_state_dict()['error'], 'PowerSGD has no error feedback yet'\n"
        + _PATH,
        "step_and_check(model)\n"),
}


# After the block: the teardown of tests/python/scripts/train_tiny.py. A process that exits
# with its gloo group alive aborts now and then ("terminate called without an active
# exception": a gloo thread frees a work holding a Python tensor while the interpreter
# finalizes; benchmarks/results/step_time.md, "Exit race"), a torch/gloo hazard, not the block's.
_TEARDOWN = """
namespace.clear()
gc.collect()
if dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
"""


def program(block: Block) -> str:
    """The script that runs `block`: its code compiled under the Markdown file's name and line
    numbers (a traceback points into the doc), between its setup's preamble and check."""
    preamble, check = SETUPS[block.setup] if block.setup else ("", "")
    code = "\n" * (block.line - 1) + block.code
    return ("import gc\n"
            "import torch.distributed as dist\n"
            "namespace = {'__name__': '__main__'}\n"
            f"exec(compile({preamble!r}, 'setup={block.setup}', 'exec'), namespace)\n"
            f"exec(compile({code!r}, {relative(block.path)!r}, 'exec'), namespace)\n"
            f"exec(compile({check!r}, 'check of setup={block.setup}', 'exec'), namespace)\n"
            + _TEARDOWN)


def environment() -> dict[str, str]:
    """A clean environment for a block: no torchrun variables or fastddp switches inherited
    from the test's own process, one thread per rank (the machine's cores are shared)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "FASTDDP_DISABLE", "FASTDDP_WORLD1_REDUCER",
                "FASTDDP_BUCKET_ALIGN"):
        env.pop(key, None)
    return env
