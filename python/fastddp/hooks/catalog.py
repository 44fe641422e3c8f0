"""One catalog of fastddp's hooks: the single place that names them. Every reader takes its
names from here: the constructors' option checks (_constructors.py), torch's hooks run
natively (_torch_hooks.py), the launcher's ``--hook`` (launch/hook_spec.py), the tuner's
candidates (fastddp/tuning/candidates.py: which configurations it tries, and what it knows
of them), the self-check (selfcheck/cases.py), and the docs' tables
(tests/python/hooks/test_catalog.py holds docs/hooks.md and the C++ registry to it).

Two tables:

- ``HOOKS``: every ``fastddp.hooks`` constructor: the C++ factory it builds (the name given
  to FASTDDP_REGISTER_COMM_HOOK in csrc/hooks/), its options with their defaults and checks,
  the torch hook functions fastddp runs as it, and its self-check cases.
- ``CONFIGS``: the configurations that have a name outside Python, one per ``--hook``
  spelling: the hook and the options that spelling fixes, its argument, the launcher's help
  line, and the torch hook stock DDP runs instead (or what torch lacks).

Data only: nothing here imports fastddp, so any module may read it (no import cycle).
Adding a hook: docs/hooks.md, "Adding a hook".
"""

from dataclasses import dataclass, field
from typing import Any

# fastddp.hooks.auto()'s policies, least to most lossy (the tuner tries a candidate under
# its policy and after).
POLICIES = ("lossless", "bf16", "any")


@dataclass(frozen=True)
class Option:
    """A constructor argument, its default and its check: ``choices`` (ValueError naming
    the hook and option otherwise), ``bool`` (TypeError unless a bool), or ``checked_by``
    another function (PowerSGD's arguments: hooks/_powersgd_args.powersgd_options)."""

    name: str
    default: Any
    choices: tuple[str, ...] = ()
    checked_by: str = ""

    def check(self, hook: str, value: Any) -> Any:
        if self.choices and value not in self.choices:
            allowed = " or ".join(repr(c) for c in self.choices)
            raise ValueError(f"fastddp.hooks.{hook}: {self.name} must be {allowed}, "
                             f"got {value!r}")
        if isinstance(self.default, bool) and not self.checked_by and not isinstance(value,
                                                                                       bool):
            raise TypeError(f"fastddp.hooks.{hook}: {self.name} must be a bool, "
                            f"got {type(value).__name__}")
        return value


@dataclass(frozen=True)
class SelfCheck:
    """A row of ``python -m fastddp --check``: the hook built with ``options``, against
    ``tolerance``: "exact" or "powersgd" (torch DDP running the hook's first torch hook), or a
    wire format (bf16, fp16, int8, e4m3, e5m2: within its error of the exact float32 mean)."""

    label: str
    options: dict[str, Any] = field(default_factory=dict)
    tolerance: str = "exact"
    ranks: int | None = None  # None: any world size


@dataclass(frozen=True)
class Hook:
    """A ``fastddp.hooks.<name>()`` constructor."""

    name: str
    factory: str | None  # its C++ registry name; None: built otherwise (hierarchical)
    options: tuple[Option, ...] = ()
    # torch.distributed.algorithms.ddp_comm_hooks functions fastddp runs as this hook:
    # "module.function", "module.wrapper(allreduce_hook)"; powerSGD_hook's take a PowerSGDState.
    torch_hooks: tuple[str, ...] = ()
    selfcheck: tuple[SelfCheck, ...] = ()

    def option(self, name: str) -> Option:
        return next(o for o in self.options if o.name == name)

    def checked(self, **values: Any) -> dict[str, Any]:
        """``values`` checked in the options' order, as the registry takes them."""
        return {o.name: o.check(self.name, values[o.name]) for o in self.options
                if o.name in values}


@dataclass(frozen=True)
class Config:
    """A configuration with a name outside Python: ``--hook flag``."""

    flag: str
    hook: str  # the HOOKS entry
    options: dict[str, Any] = field(default_factory=dict)  # what the flag fixes
    # What ``--hook flag:ARG`` sets: "rank" (matrix_approximation_rank, NAME:RANK) or an
    # option with choices (fp8's "format"); "" takes no argument.
    argument: str = ""
    start: str = ""  # a low-rank hook's start-iteration option (the launcher starts at 2)
    torch: str = ""  # the torch hook FASTDDP_DISABLE=1 runs instead (HOOKS' spelling)
    torch_instead: str = ""  # without one: the --hook that compares with torch
    no_torch: str = ""  # without one: what stock torch lacks (the error's words)
    help: str = ""  # the launcher's --help line

    def usage(self) -> str:
        """``flag[:ARG]`` as the launcher's help writes it."""
        return self.flag + ("" if not self.argument else "[:R]" if self.argument == "rank"
                            else f"[:{self.argument.upper()}]")


def _half(name: str) -> tuple[Option, ...]:
    """bf16's and fp16's options: the sum in 16 bits or in float32, error feedback."""
    return Option("accumulate", name, choices=(name, "fp32")), Option("error_feedback", False)


_POWERSGD = tuple(Option(n, d, checked_by="powersgd_options") for n, d in (
    ("matrix_approximation_rank", 1), ("start_powerSGD_iter", 1_000),
    ("min_compression_rate", 2), ("use_error_feedback", True), ("warm_start", True),
    ("orthogonalization_epsilon", 0), ("random_seed", 0),
    ("batch_tensors_with_same_shape", False), ("compression_stats_logging_frequency", 10_000)))
_PSGD_CHECK = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}

HOOKS = (
    Hook("allreduce", "allreduce", (), ("default_hooks.allreduce_hook",),
         (SelfCheck("fastddp.hooks.allreduce()"),)),
    Hook("bf16", "bf16", _half("bf16"),
         ("default_hooks.bf16_compress_hook",
          "default_hooks.bf16_compress_wrapper(allreduce_hook)"),
         (SelfCheck("fastddp.hooks.bf16()"),
          SelfCheck('fastddp.hooks.bf16(accumulate="fp32")', {"accumulate": "fp32"}, "bf16"),
          SelfCheck("fastddp.hooks.bf16(error_feedback=True)", {"error_feedback": True},
                    "bf16"))),
    Hook("fp16", "fp16", _half("fp16"),
         ("default_hooks.fp16_compress_hook",
          "default_hooks.fp16_compress_wrapper(allreduce_hook)"),
         (SelfCheck("fastddp.hooks.fp16()"),
          SelfCheck('fastddp.hooks.fp16(accumulate="fp32")', {"accumulate": "fp32"}, "fp16"))),
    Hook("powersgd", "powersgd", _POWERSGD, ("powerSGD_hook.powerSGD_hook",),
         (SelfCheck("fastddp.hooks.powersgd(2)", _PSGD_CHECK, "powersgd"),)),
    Hook("batched_powersgd", "powersgd_batched", _POWERSGD,
         ("powerSGD_hook.batched_powerSGD_hook",),
         (SelfCheck("fastddp.hooks.batched_powersgd(2)", _PSGD_CHECK, "powersgd"),)),
    Hook("int8", "int8", (Option("error_feedback", True),), (),
         (SelfCheck("fastddp.hooks.int8()", {}, "int8"),)),
    Hook("fp8", "fp8", (Option("format", "e4m3", choices=("e4m3", "e5m2")),
                        Option("error_feedback", True)), (),
         (SelfCheck('fastddp.hooks.fp8("e4m3")', {"format": "e4m3"}, "e4m3"),
          SelfCheck('fastddp.hooks.fp8("e5m2")', {"format": "e5m2"}, "e5m2"))),
    Hook("acpsgd", "acpsgd", tuple(Option(n, d, checked_by="powersgd_options") for n, d in (
        ("matrix_approximation_rank", 4), ("start_iter", 1_000), ("min_compression_rate", 2),
        ("orthogonalization_epsilon", 0), ("random_seed", 0)))),
    # No collective, as torch's debugging_hooks.noop_hook: no self-check row (each rank keeps
    # its own gradients, so there is no average to hold it to); tests/python/hooks holds it to
    # torch's hook.
    Hook("noop", "noop"),
    # Two "nodes" of two ranks: float32 inside a node, bf16 (inter's default) between them.
    Hook("hierarchical", None, (Option("inter", None), Option("mesh", None),
                                Option("local_size", None), Option("groups", None)), (),
         (SelfCheck("fastddp.hooks.hierarchical(bf16(), local_size=2)", {"local_size": 2},
                    "bf16", ranks=4),)),
)

CONFIGS = (
    Config("allreduce", "allreduce", torch="default_hooks.allreduce_hook",
           help="plain allreduce through the hook interface"),
    Config("fp16", "fp16", torch="default_hooks.fp16_compress_hook",
           help="compress gradients to fp16 for the allreduce"),
    Config("bf16", "bf16", {"accumulate": "bf16"}, torch="default_hooks.bf16_compress_hook",
           help="compress gradients to bf16 for the allreduce"),
    Config("bf16-fp32acc", "bf16", {"accumulate": "fp32"}, torch_instead="bf16",
           no_torch="built-in hook that accumulates bf16 gradients in fp32",
           help="bf16 on the wire, accumulated in fp32"),
    Config("int8", "int8", torch_instead="bf16", no_torch="int8 gradient compression",
           help="block-scaled int8 on the wire (1/4 of fp32's bytes), accumulated in fp32, "
                "with error feedback"),
    Config("fp8", "fp8", argument="format", torch_instead="bf16",
           no_torch="fp8 gradient compression",
           help="the same with fp8 codes; FORMAT: e4m3 (the default) or e5m2"),
    Config("powersgd", "powersgd", argument="rank", start="start_powerSGD_iter",
           torch="powerSGD_hook.powerSGD_hook",
           help="PowerSGD low-rank compression of rank R (default: the hook's default)"),
    Config("noop", "noop", torch="debugging_hooks.noop_hook",
           help="no communication: each rank keeps its own gradients (to time a step "
                "without DDP's averaging; not for training)"),
    Config("acpsgd", "acpsgd", argument="rank", start="start_iter", torch_instead="powersgd",
           no_torch="acpsgd gradient compression",
           help="ACP-SGD: PowerSGD's compression with one allreduce per bucket per step, "
                "P and Q in turn (rank R, default 4)"),
)

# --hook names that are not one hook: auto chooses among the tuner's candidates
# (fastddp/tuning/candidates.py), hier wraps one of them.
AUTO, HIER = "auto", "hier"


def hook(name: str) -> Hook:
    """The HOOKS entry of ``fastddp.hooks.<name>()``."""
    for h in HOOKS:
        if h.name == name:
            return h
    raise KeyError(f"fastddp.hooks catalog: no hook {name!r}")


def config(flag: str) -> Config:
    """The CONFIGS entry of ``--hook flag``."""
    for c in CONFIGS:
        if c.flag == flag:
            return c
    raise KeyError(f"fastddp.hooks catalog: no --hook {flag!r}")


def flags() -> tuple[str, ...]:
    """Every --hook name, in the order the launcher lists them."""
    return (*(c.flag for c in CONFIGS), AUTO, HIER)
