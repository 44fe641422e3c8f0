"""Which of PyTorch's own distributed tests exercise DistributedDataParallel, and the two
exception lists (stock failures, fastddp's known failures).

Shared by conftest.py (pytest selection and xfail marks) and compare_columns.py (the
side-by-side table). Tests are named ``Class::test_name`` as pytest's node ids end.
"""

import inspect
import os
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
KNOWN_FAILURES = HERE / "known_failures.txt"
STOCK_EXCLUDED = HERE / "stock_excluded.txt"

# Test names that say DDP (or a DDP-only feature: comm hooks, join, static graph, ...).
NAME_PATTERN = re.compile(
    r"ddp|DistributedDataParallel|comm_hook|join|static_graph|powerSGD|no_sync|sync_bn|"
    r"SyncBatchNorm|localSGD|post_local|uneven|gradient_as_bucket|find_unused",
    re.IGNORECASE,
)
# Tests whose own body builds a DDP model although their name does not say so
# (test_output_unused_in_loss_*, test_skip_all_reduce_unused_parameters, ...).
SOURCE_PATTERN = re.compile(r"DistributedDataParallel\(|\bDDP\(|_ddp\w*\(|SyncBatchNorm")
# Named like DDP but construct none: the control run of the DDP-under-RPC suite, and a
# test of torch's env-var dump helper.
NOT_DDP = {"test_backward_no_ddp", "test_dump_DDP_relevant_env_vars"}


def column() -> str:
    """``"stock"`` with FASTDDP_DISABLE=1, else ``"fastddp"`` (fastddp.patch's reading of the
    variable, repeated here so that the stock column runs without importing fastddp)."""
    value = os.environ.get("FASTDDP_DISABLE", "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return "stock"
    if value in ("", "0", "false", "no", "off"):
        return "fastddp"
    raise ValueError(f"FASTDDP_DISABLE={value!r}: use 1 for the stock torch column, 0 or unset "
                     "for fastddp")


def selects(cls: type, name: str) -> bool:
    """Whether test method ``name`` of ``cls`` exercises DDP (by its name or its body)."""
    if not name.startswith("test_") or name in NOT_DDP:
        return False
    if NAME_PATTERN.search(name):
        return True
    try:
        source = inspect.getsource(inspect.unwrap(getattr(cls, name)))
    except (OSError, TypeError):
        return False
    return bool(SOURCE_PATTERN.search(source))


def read_list(path: Path) -> dict[str, str]:
    """``{"Class::test_name": reason}`` from a list file: one test and its reason a line,
    separated by whitespace; ``#`` starts a comment. A test without a reason is an error."""
    entries: dict[str, str] = {}
    if not path.exists():
        return entries
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        test, _, reason = line.partition(" ")
        if "::" not in test or not reason.strip():
            raise ValueError(f"{path.name}:{number}: expected 'Class::test_name  reason', "
                             f"got {raw!r}")
        if test in entries:
            raise ValueError(f"{path.name}:{number}: {test} is listed twice")
        entries[test] = reason.strip()
    return entries


def env_flag(name: str) -> bool:
    """An on/off switch of this suite (1/true/yes/on)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
