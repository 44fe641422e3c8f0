"""``python -m fastddp``: run an unmodified DDP training script with fastddp.

    torchrun --nproc_per_node=N -m fastddp [--hook NAME] [--bucket-cap-mb X] [--report]
             [--shard-optimizer]
             [--emulate-link BANDWIDTH[,LATENCY]] [--advise [--advise-out DIR]]
             [--] train.py [script args ...]
    python -m fastddp --check      (the install's self-check, fastddp.selfcheck)

Launcher options come before the script path; everything after it belongs to the script.
"""

import argparse
import os
import runpy
import socket
import sys
import textwrap

from fastddp.launch.sync_patch import sync_patch
from fastddp.hooks import catalog
from fastddp.launch.patch import HookUnavailableError, parse_hook_spec, patch
from fastddp.link.model import parse_link
from fastddp.selfcheck import main as self_check

_DESCRIPTION = """\
Runs a training script unmodified, with torch.nn.parallel.DistributedDataParallel (and
torch.nn.parallel.distributed.DistributedDataParallel) replaced by
fastddp.DistributedDataParallel. Start one process per device with torchrun, as for the
script itself; plain `python -m fastddp train.py` runs a world of size 1 (it sets the
environment `torchrun --nproc_per_node=1` would). Rank 0 prints one line saying what was
replaced and with which settings. fastddp.patch() does the same from code."""


def _hook_lines() -> str:
    """The --hook names and what each does: the hooks' catalog's (fastddp/hooks/catalog.py)."""
    lines = []
    for config in catalog.CONFIGS:
        first, *rest = textwrap.wrap(config.help, 72)
        lines += [f"  {config.usage():<16}{first}", *(" " * 18 + line for line in rest)]
    return "\n".join(lines) + "\n"


_EPILOG = """\
hooks (--hook):
""" + _hook_lines() + """\
  hier[:INNER]    multi-node: reduce-scatter inside the node, INNER (none, bf16, bf16-fp32acc,
                  int8, fp8, ...; default bf16) on each rank's shard between nodes, allgather
                  inside the node; nodes of LOCAL_WORLD_SIZE ranks (torchrun's --nproc-per-node)
  auto[:POLICY]   fastddp measures the first steps (7 to about 55), tries the configurations
                  its cost model ranks best, keeps the fastest and says so (rank 0, one line).
                  POLICY: lossless (allreduce, bucket sizes), bf16 (also 16-bit wires) or
                  any (also int8/fp8 wires and PowerSGD; the default); on 2 or more nodes
                  (LOCAL_WORLD_SIZE < WORLD_SIZE) bf16 and any also try hier:none/bf16/int8
The launcher's hook is registered on every model the script wraps and replaces any hook the
script registers itself (rank 0 says so once). Without --hook, the script's hooks are used.

emulated link (--emulate-link):
  Every model's collectives complete no earlier than they would on a link of this bus
  bandwidth (nccl-tests busbw) and per-collective latency: allreduce 2(n-1)/n*S/B,
  alltoall and allgather (n-1)/n*S/B, plus the latency, queued one after another. Results
  are unchanged. Units: B/s KB/s MB/s GB/s (1e9 bytes) GiB/s, bits: Mb/s Gb/s; latency: s
  ms us ns. E.g. 3GB/s (PCIe box at 8 GPUs), 100Gb/s,5us.

advice (--advise):
  Changes nothing in the run: rank 0 reads model.comm_stats() in a few steps (after 3),
  and at exit prints the cost model's predicted step time of allreduce, bf16,
  bf16-fp32acc and powersgd:1/2/4/8 on this run's link (the --emulate-link one, else
  estimated from the run's own collectives), with the --hook to use; also written to
  DIR/fastddp_advice.md and .json (DIR: --advise-out, default the current directory).

environment:
  FASTDDP_DISABLE=1   leave torch's DDP in place (stock torch DDP). Launcher options still
                      apply, through torch's built-in hooks (powersgd:R -> PowerSGDState
                      with start_powerSGD_iter=2); bf16-fp32acc has no torch equivalent.

examples:
  python -m fastddp --check      (check this install: every hook against torch DDP)
  torchrun --nproc_per_node=8 -m fastddp --hook bf16 --bucket-cap-mb 100 train.py --epochs 1
  FASTDDP_DISABLE=1 torchrun --nproc_per_node=8 -m fastddp --hook bf16 train.py
  torchrun --nproc_per_node=4 -m fastddp --emulate-link 3GB/s,20us --report train.py
  python -m fastddp --report -- train.py --lr 0.1
  torchrun --nproc_per_node=4 -m fastddp --advise --advise-out runs/ train.py
  torchrun --nproc_per_node=8 -m fastddp --hook auto:bf16 train.py
  torchrun --nproc_per_node=8 -m fastddp --shard-optimizer train.py
  torchrun --nproc_per_node=8 -m fastddp --sync diloco:H=100,wire=int8 train.py
  torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
      -m fastddp --hook hier:bf16 train.py   (on each node)"""

# Launcher options that consume the next token; needed to find where the script path is.
_VALUE_OPTIONS = ("--hook", "--bucket-cap-mb", "--emulate-link", "--advise-out", "--sync")


def build_parser() -> argparse.ArgumentParser:
    """The parser of the launcher's own options (the script and its args are split off
    before parsing, so that the script's options are never mistaken for the launcher's)."""
    parser = argparse.ArgumentParser(
        prog="python -m fastddp",
        usage="torchrun [torchrun options] -m fastddp [options] [--] script.py [script args]",
        description=_DESCRIPTION, epilog=_EPILOG, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hook", metavar="NAME",
                        help="register this communication hook on every wrapped model: "
                             + ", ".join(c.usage() for c in catalog.CONFIGS)
                             + ", auto[:POLICY], hier[:INNER]")
    parser.add_argument("--sync", metavar="diloco:H=STEPS[,KEY=VALUE...]",
                        help="no per-step gradient collective: fastddp.DiLoCo every H "
                             "optimizer steps; keys outer_lr, outer_momentum, wire "
                             "(fp32|bf16|int8|int4), quantized_sum, fragments, overlap, "
                             "merge_alpha; see docs/diloco.md; excludes the other options")
    parser.add_argument("--bucket-cap-mb", metavar="X", type=_positive_float,
                        help="bucket size in MiB for every wrapped model (overrides the "
                             "script's bucket_cap_mb and bucket_cap_mb_list)")
    parser.add_argument("--check-for-nan-in-grad", action="store_true",
                        help="raise, on every rank, when a gradient holds NaN or Inf, naming "
                             "the parameter, the rank and the step (costs one small "
                             "allreduce per step)")
    parser.add_argument("--emulate-link", metavar="BANDWIDTH[,LATENCY]", type=_link_spec,
                        help="delay every model's collectives to the time they take on a link "
                             "of this bus bandwidth and latency, e.g. 3GB/s or 100Gb/s,5us")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="torch.optim.SGD/Adam/AdamW built over a wrapped model's parameters "
                             "become fastddp.optim.ShardedOptimizer: the optimizer's state "
                             "sharded over the ranks (ZeRO-1, docs/sharded.md)")
    parser.add_argument("--report", action="store_true",
                        help="print a table of model.comm_stats() on rank 0 at exit")
    parser.add_argument("--advise", action="store_true",
                        help="change nothing; at exit print (rank 0) which --hook the cost "
                             "model predicts fastest on this run's link, and save it")
    parser.add_argument("--check", action="store_true",
                        help="check this install and exit: print the environment, then train "
                             "three steps with every hook against torch DDP on the CPU and on "
                             "each GPU (about a minute); exit status 0 if all passed")
    parser.add_argument("--advise-out", metavar="DIR", default=None,
                        help="folder for fastddp_advice.md and .json (default: the current "
                             "directory); needs --advise")
    return parser


def split_command_line(argv: list[str]) -> tuple[list[str], str | None, list[str]]:
    """``[launcher options], script, [script args]``: the script is the first token that
    is not a launcher option (or the token after ``--``)."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return argv[:i], (argv[i + 1] if i + 1 < len(argv) else None), argv[i + 2:]
        if not token.startswith("-") or token == "-":
            return argv[:i], token, argv[i + 1:]
        i += 2 if token in _VALUE_OPTIONS else 1
    return argv, None, []


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m fastddp``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    own, script, script_args = split_command_line(argv)
    options = parser.parse_args(own)  # --help exits 0 here, a bad option exits 2
    try:
        hook = None if options.hook is None else parse_hook_spec(options.hook)
    except ValueError as e:
        parser.error(str(e))
    if options.advise_out is not None and not options.advise:
        parser.error("--advise-out needs --advise")
    if options.check:
        if script is not None or own != ["--check"]:
            parser.error("--check takes no other option and no script")
        return self_check()
    if script is None:
        parser.print_usage(sys.stderr)
        print("python -m fastddp: error: no training script given", file=sys.stderr)
        return 2
    if not os.path.isfile(script):
        print(f"python -m fastddp: error: script {script!r} not found", file=sys.stderr)
        return 2
    single = _default_to_world_of_one()
    if options.sync is not None:
        return _run_synced(parser, options, script, script_args, single)
    try:
        handle = patch(hook=hook, bucket_cap_mb=options.bucket_cap_mb,
                       report=options.report, _option="--hook",
                       emulate_link=options.emulate_link,
                       check_for_nan_in_grad=options.check_for_nan_in_grad,
                       advise=options.advise, shard_optimizer=options.shard_optimizer)
    except (HookUnavailableError, ValueError, NotImplementedError) as e:
        print(f"python -m fastddp: error: {e}", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        where = " [single process: world size 1]" if single else ""
        print(handle.describe() + where, flush=True)

    try:
        _run_script(script, script_args)
    finally:
        # Also after sys.exit() in the script; rank 0 only, like the one-line summary.
        if options.report and rank == 0:
            print(handle.report_text(), flush=True)
        if options.advise and rank == 0:
            print(handle.advice_text(options.advise_out or ".",
                                     _advised_command(own, script, script_args)), flush=True)
    return 0


def _run_script(script: str, script_args: list[str]) -> None:
    sys.argv = [script, *script_args]
    # As `python train.py` would: the script's folder first, so its sibling modules import.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def _run_synced(parser: argparse.ArgumentParser, options: argparse.Namespace, script: str,
                script_args: list[str], single: bool) -> int:
    """--sync: the script's DDP models train locally, synced by DiLoCo (fastddp/diloco/
    sync_patch.py). The per-step options have nothing to act on there."""
    per_step = [name for name, given in (
        ("--hook", options.hook), ("--bucket-cap-mb", options.bucket_cap_mb),
        ("--emulate-link", options.emulate_link), ("--advise", options.advise),
        ("--report", options.report),
        ("--check-for-nan-in-grad", options.check_for_nan_in_grad),
        ("--shard-optimizer", options.shard_optimizer)) if given]
    if per_step:
        parser.error(f"--sync excludes {', '.join(per_step)} (no per-step gradient collective)")
    try:
        handle = sync_patch(options.sync)
    except ValueError as e:
        print(f"python -m fastddp: error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        where = " [single process: world size 1]" if single else ""
        print(handle.describe() + where, flush=True)
    with handle:
        _run_script(script, script_args)
    return 0


def _advised_command(own: list[str], script: str, script_args: list[str]) -> str:
    """This run's command line without --advise/--advise-out/--hook, with ``{hook}`` where
    the advised ``--hook X `` goes (str.format)."""
    kept, i = [], 0
    while i < len(own):
        token = own[i]
        name = token.split("=", 1)[0]
        width = 2 if token in ("--hook", "--advise-out") else 1
        if name not in ("--advise", "--advise-out", "--hook"):
            kept.append(token.replace("{", "{{").replace("}", "}}"))
        i += width
    nproc = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    rest = " ".join(t.replace("{", "{{").replace("}", "}}") for t in [script, *script_args])
    return (f"torchrun --nproc_per_node={nproc} -m fastddp "
            f"{' '.join(kept) + ' ' if kept else ''}{{hook}}{rest}")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _link_spec(text: str):  # -> fastddp.link.Link
    try:
        return parse_link(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _default_to_world_of_one() -> bool:
    """Outside torchrun, sets the variables a one-process torchrun sets, so that a script
    calling init_process_group() runs as a world of size 1. Returns whether it did."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_WORLD_SIZE", "1"), ("GROUP_RANK", "0"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        os.environ.setdefault(key, value)
    return True
