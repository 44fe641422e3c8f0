"""The tuner's candidates: the configurations ``fastddp.hooks.auto()`` and ``--advise``
choose among, and what only the tuner knows of them. A candidate runs one ``--hook``
configuration of the hooks' catalog (fastddp/hooks/catalog.py: the flag, its hook and
options, which the catalog owns); this table adds its candidate name, the least ``auto``
policy that tries it, its family (auto tries the best predicted of each), its cost-model
function (cost_model.py) and wire format (advise.py times its kernels), the least policy
that tries it between nodes, and its row in the quality benchmark (benchmarks/quality.py).

The names: ``allreduce_fp32`` and its bucket-cap variants (``allreduce_fp32@16MB``), the
table's (``bf16``, ``bf16_fp32_accumulate``, ``int8``, ``fp8``, ``powersgd_r<rank>``,
``acpsgd_r<rank>``) and ``hier_<inner>``. Every reader takes them from here: the tuner
(auto.py, _auto_choice.py), ``--advise`` (advise.py), its quality line (quality.py), the
quality benchmark, and the docs' tables (tests/python/hooks/test_catalog.py).
"""

from dataclasses import dataclass
from typing import Any

from fastddp.hooks import catalog


@dataclass(frozen=True)
class Candidate:
    """A configuration the tuner may choose: ``--hook flag``, named ``name``."""

    flag: str  # the catalog's --hook configuration it runs
    name: str  # the tuner's name ("{rank}": one per RANKS)
    policy: str  # the least auto policy that tries it
    family: str  # auto tries the best predicted of each family
    cost: tuple[str, ...]  # cost_model's function and its first arguments
    wire: str = ""  # the wire format advise.py times kernels of
    hier: str = ""  # the least policy that tries it between nodes (hier_<name>)
    quality: str = ""  # benchmarks/quality.py's row ("{rank}" per rank)

    @property
    def config(self) -> catalog.Config:
        return catalog.config(self.flag)

    @property
    def low_rank(self) -> bool:
        return "{rank}" in self.name

    def names(self) -> tuple[str, ...]:
        return tuple(self.name.format(rank=r) for r in RANKS) if self.low_rank else (self.name,)


RANKS = (1, 2, 4, 8)  # the low-rank ranks the tuner tries

CANDIDATES = (
    Candidate("allreduce", "allreduce_fp32", "lossless", "bucket size", ("allreduce_fp32",),
              wire="fp32", hier="bf16", quality="fp32 allreduce"),
    Candidate("bf16", "bf16", "bf16", "bf16", ("bf16",), wire="bf16", hier="bf16",
              quality="fastddp bf16"),
    Candidate("bf16-fp32acc", "bf16_fp32_accumulate", "bf16", "bf16",
              ("bf16_fp32_accumulate",), wire="bf16", quality="bf16 fp32-sum"),
    Candidate("int8", "int8", "any", "8-bit", ("quant8", "int8"), wire="int8", hier="any",
              quality="int8"),
    Candidate("fp8", "fp8", "any", "8-bit", ("quant8", "fp8"), wire="e4m3",
              quality="fp8 e4m3"),
    Candidate("powersgd", "powersgd_r{rank}", "any", "low-rank", ("powersgd",),
              quality="powersgd r{rank}"),
    Candidate("acpsgd", "acpsgd_r{rank}", "any", "low-rank", ("acpsgd",),
              quality="acpsgd r{rank}"),
)

HIER_PREFIX = "hier_"  # a hierarchical candidate: hier_<its inner's candidate>
CAP_FACTORS = (0.25, 4.0)  # plain allreduce is also tried with these times the bucket cap


def under(policy: str) -> list[tuple[Candidate, str]]:
    """(candidate, name) of every candidate ``policy`` tries, in the table's order (the
    order every rank agrees on)."""
    allowed = catalog.POLICIES[:catalog.POLICIES.index(policy) + 1]
    return [(c, name) for c in CANDIDATES if c.policy in allowed for name in c.names()]


def hier_inners(policy: str | None = None) -> list[str]:
    """The candidates tried between nodes (under ``policy``; None: under any)."""
    allowed = catalog.POLICIES[:catalog.POLICIES.index(policy or "any") + 1]
    return [c.name for c in CANDIDATES if c.hier and c.hier in allowed]


def by_name(name: str) -> tuple[Candidate, int | None]:
    """The candidate of a name, and its rank (low-rank ones)."""
    for c in CANDIDATES:
        if c.low_rank:
            prefix = c.name.removesuffix("{rank}")
            if name.startswith(prefix) and name[len(prefix):].isdigit():
                return c, int(name[len(prefix):])
        elif name == c.name:
            return c, None
    raise KeyError(f"fastddp.tuning: no candidate {name!r}")


def name_of(flag: str, rank: int | None = None) -> str:
    """The tuner's name of ``--hook flag[:rank]`` (rank None: the hook's default)."""
    c = next((c for c in CANDIDATES if c.flag == flag), None)
    if c is None:
        raise KeyError(f"fastddp.tuning: --hook {flag!r} is no candidate")
    if not c.low_rank:
        return c.name
    if rank is None:
        rank = catalog.hook(c.config.hook).option("matrix_approximation_rank").default
    return c.name.format(rank=rank)


def flag_of(name: str) -> str:
    """``--hook`` for a candidate: ``bf16_fp32_accumulate`` -> ``bf16-fp32acc``,
    ``powersgd_r4`` -> ``powersgd:4``, ``hier_int8`` -> ``hier:int8``, ``hier_allreduce_fp32``
    -> ``hier:none``; plain allreduce is the default, no --hook: ""."""
    if name.startswith(HIER_PREFIX):
        inner = flag_of(name.removeprefix(HIER_PREFIX))
        return f"{catalog.HIER}:{inner or 'none'}"
    c, rank = by_name(name)
    if c.flag == "allreduce":
        return ""
    return c.flag if rank is None else f"{c.flag}:{rank}"


def quality_of(name: str) -> str | None:
    """The quality benchmark's row of a lossy candidate; None for a lossless one."""
    if name.startswith(HIER_PREFIX):
        flag = by_name(name.removeprefix(HIER_PREFIX))[0].flag
        return None if flag == "allreduce" else f"hier {flag} (2x2)"
    c, rank = by_name(name)
    if c.flag == "allreduce":
        return None
    return c.quality.format(rank=rank)


LOSSLESS = name_of("allreduce")
# The low-rank candidates: they start compressing after a few plain steps.
LOW_RANK = tuple(name for c, name in under("any") if c.low_rank)
HIER_INNERS = tuple(hier_inners())  # the inter-node hooks of the hierarchical candidates
HIER = tuple(HIER_PREFIX + inner for inner in HIER_INNERS)


def lossy(name: str) -> bool:
    return not name.startswith(LOSSLESS)


def cap_variant(cap_mb: float) -> str:
    """The name of plain allreduce with buckets of ``cap_mb`` MiB."""
    return f"{LOSSLESS}@{cap_mb:g}MB"


def variant_cap(name: str) -> float | None:
    """The bucket cap in MiB a candidate name asks for (None: the run's own)."""
    _, sep, cap = name.partition("@")
    return float(cap.removesuffix("MB")) if sep else None


def for_auto(spec: Any, cap_mb: float, hierarchical: bool = False) -> list[str]:
    """The names ``spec`` (an AutoHook) tries, in a fixed order every rank agrees on, at a
    bucket cap of ``cap_mb``; ``hierarchical``: the ranks span several nodes (Note [auto on
    several nodes], auto.py)."""
    names = [LOSSLESS, *(cap_variant(cap_mb * f) for f in CAP_FACTORS)]
    names += [name for _, name in under(spec.policy) if name != LOSSLESS]
    if hierarchical and spec.policy != "lossless":
        names += [HIER_PREFIX + inner for inner in hier_inners(spec.policy)]
    return names
