"""Selection for PyTorch's DDP tests (test_torch_ddp.py).

- Only the tests that exercise DDP are kept (selection.selects); the rest of torch's
  distributed suite (collectives, barriers, ...) is deselected.
- stock_excluded.txt: tests that fail or skip on stock torch on this kind of machine (no
  GPU, gloo); deselected in both columns unless FASTDDP_TORCH_DDP_ALL=1.
- known_failures.txt: tests fastddp does not pass yet; in the fastddp column they are
  strict xfails, so a test that starts passing fails the run until its line is removed.
  FASTDDP_TORCH_DDP_RAW=1 drops the marks (to see the plain results).
The selected tests are listed in the header of the run.
"""

import sys
import unittest
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import selection  # noqa: E402


def _test_id(item: pytest.Item) -> str:
    return f"{item.cls.__name__}::{item.name}" if item.cls is not None else item.name


def _all_ddp_tests(module: object) -> set[str]:
    """Every DDP test of the runner module, whatever this run collects (-k, node ids)."""
    return {f"{cls.__name__}::{name}"
            for cls in vars(module).values()
            if isinstance(cls, type) and issubclass(cls, unittest.TestCase)
            and cls.__module__ == module.__name__
            for name in dir(cls) if selection.selects(cls, name)}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [i for i in items if Path(str(i.fspath)).parent == selection.HERE]
    if not ours:
        return
    our_set = set(ours)
    run_all = selection.env_flag("FASTDDP_TORCH_DDP_ALL")
    raw = selection.env_flag("FASTDDP_TORCH_DDP_RAW")
    fastddp_column = selection.column() == "fastddp"
    stock_excluded = selection.read_list(selection.STOCK_EXCLUDED)
    known = selection.read_list(selection.KNOWN_FAILURES)

    keep, drop = [], []
    for item in items:
        if item not in our_set:
            keep.append(item)
            continue
        test = _test_id(item)
        if item.cls is None or not selection.selects(item.cls, item.name):
            drop.append(item)
            continue
        if test in stock_excluded and not run_all:
            drop.append(item)
            continue
        if test in known and fastddp_column and not raw:
            item.add_marker(pytest.mark.xfail(reason=known[test], strict=True))
        keep.append(item)

    # A listed test that is not a DDP test of this torch is a stale or mistyped line.
    ddp_tests = _all_ddp_tests(ours[0].module)
    for path, entries in ((selection.STOCK_EXCLUDED, stock_excluded),
                          (selection.KNOWN_FAILURES, known)):
        stale = sorted(set(entries) - ddp_tests)
        if stale:
            raise pytest.UsageError(f"{path.name} lists tests that are not selected DDP tests "
                                    f"of this torch: {', '.join(stale)}")
    both = sorted(set(stock_excluded) & set(known))
    if both:
        raise pytest.UsageError(f"{', '.join(both)}: listed both as a stock failure/skip and "
                                "as a fastddp known failure; a test that does not pass on "
                                "stock torch is only excluded")
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    selected = [_test_id(i) for i in items if Path(str(i.fspath)).parent == selection.HERE]
    if not selected:
        return []
    lines = [f"torch DDP suite, {selection.column()} column: {len(selected)} tests selected"]
    return lines + [f"  {t}" for t in selected]
