"""The hooks' catalog (fastddp/hooks/catalog.py) against what it describes: the C++ registry
(nothing registered on one side only), the constructors' defaults, the launcher's --hook, the
tuner's names, and the tables of docs/hooks.md."""

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fastddp
from fastddp.hooks import catalog
from fastddp.launch.hook_spec import fastddp_hook, parse_hook_spec
from fastddp.tuning import advise, candidates, quality

ROOT = Path(__file__).resolve().parents[3]
REGISTERED = re.compile(r'FASTDDP_REGISTER_COMM_HOOK\("([^"]+)"')


def test_the_catalog_and_the_cpp_registry_list_the_same_hooks() -> None:
    # A fresh interpreter: a test elsewhere may register hooks of its own in this one.
    names = subprocess.run(
        [sys.executable, "-c", "from fastddp import _C; print(' '.join(_C.comm_hook_names()))"],
        capture_output=True, text=True, check=True).stdout.split()
    factories = {h.factory for h in catalog.HOOKS if h.factory is not None}
    assert set(names) == factories
    # And the sources: every registration in csrc/ is one of them (none left out of the build).
    in_sources = {m for path in (ROOT / "csrc").rglob("*.cpp")
                  for m in REGISTERED.findall(path.read_text())}
    assert in_sources == factories


@pytest.mark.parametrize("entry", catalog.HOOKS, ids=lambda h: h.name)
def test_a_constructor_takes_the_catalogs_options_and_defaults(entry: catalog.Hook) -> None:
    parameters = inspect.signature(getattr(fastddp.hooks, entry.name)).parameters
    assert {n: p.default for n, p in parameters.items()} == {
        o.name: o.default for o in entry.options}


def test_the_catalogs_checks_name_the_hook_and_option() -> None:
    with pytest.raises(ValueError, match=r"fastddp.hooks.fp8: format must be 'e4m3' or 'e5m2'"):
        fastddp.hooks.fp8("e3m4")
    with pytest.raises(TypeError, match="fastddp.hooks.int8: error_feedback must be a bool"):
        fastddp.hooks.int8(error_feedback=1)


@pytest.mark.parametrize("config", catalog.CONFIGS, ids=lambda c: c.flag)
def test_every_flag_builds_its_catalog_hook(config: catalog.Config) -> None:
    _, hook = fastddp_hook(parse_hook_spec(config.flag))
    entry = catalog.hook(config.hook)
    assert hook.name == entry.factory
    assert config.options.items() <= hook.options.items()
    assert config.help, f"--hook {config.flag} has no line in the launcher's help"


def test_candidate_names_and_flags_round_trip() -> None:
    # The tuner's candidates (fastddp/tuning/candidates.py) run the catalog's --hook
    # configurations: each name, its flag and the launcher's parse of it agree.
    for candidate, name in candidates.under("any"):
        flag = candidates.flag_of(name)
        spec = parse_hook_spec(flag or "allreduce")
        assert advise.current_candidate(spec, "") == name, (name, flag)
        assert advise.HOOK_SPELLING[name] == flag
        assert catalog.config(candidate.flag).hook, name  # a catalog configuration
        assert candidate.family and candidate.cost and candidate.policy, name
    # Each lossy candidate's quality row is its own (test_quality_note: each is measured).
    assert set(quality.CONFIG.values()) == {
        candidates.quality_of(n) for _, n in candidates.under("any")
        if n != "allreduce_fp32"} | {
        f"hier {candidates.by_name(i)[0].flag} (2x2)" for i in candidates.hier_inners()
        if i != "allreduce_fp32"}


def _table_rows(heading_text: str) -> list[list[str]]:
    """The cells of the first table after the line holding ``heading_text`` in
    docs/hooks.md (its header and separator left out)."""
    lines = (ROOT / "docs" / "hooks.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if heading_text in line)
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    rows = []
    for line in lines[first + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split(" | ")])
    return rows


def test_the_docs_built_in_table_lists_every_catalog_hook() -> None:
    named = {m for cells in _table_rows("| built-in | what goes on the wire |")
             for m in re.findall(r"`fastddp\.hooks\.(\w+)\(", cells[0])}
    assert named == {h.name for h in catalog.HOOKS} | {"auto"}


def test_the_docs_torch_table_is_the_catalogs() -> None:
    documented = {}
    for torch_cell, runs_as in _table_rows("| torch hook | runs as |"):
        if "_register_builtin_comm_hook" in torch_cell:
            continue  # torch's enum of built-ins (hooks/_torch_hooks.builtin_for_type)
        for function in re.findall(r"`(?:\w+\.)?(\w+_hook|\w+_wrapper\(allreduce_hook\))`",
                                   torch_cell):
            documented[function] = re.match(r"`(\w+)", runs_as).group(1)
    assert documented == {t.partition(".")[2]: h.name
                          for h in catalog.HOOKS for t in h.torch_hooks}


def test_the_advice_table_in_docs_auto_spells_hooks_as_the_catalog() -> None:
    lines = (ROOT / "docs" / "auto.md").read_text().splitlines()
    start = lines.index("| candidate | --hook | predicted step ms | measured step ms "
                        "| MB sent per rank per step | compute:comm |")
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    rows = [line.strip("|").split(" | ") for line in lines[start + 2:end]]
    assert rows
    for candidate, flag, *_ in rows:
        name = candidate.strip().removesuffix(" (this run)")
        assert (candidates.flag_of(name) or "(default)") == flag.strip(), name
