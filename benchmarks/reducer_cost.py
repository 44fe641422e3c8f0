"""The reducer's cost at world size 1 (GPT-style model): prints step time vs bare and torch DDP.

The reducer's own cost: a GPT-style model at world size 1 with the reducer forced
(``FASTDDP_WORLD1_REDUCER=1``), against the bare module and torch DDP, in one run.

    python benchmarks/reducer_cost.py [--device cuda|cpu] [--groups default,gbv,bf16,powersgd]
        (also fp16, bf16_ef, int8, fp8, batched, acpsgd: fastddp's other hooks, for --count)
        [--width 1024] [--layers 12] [--heads 16] [--vocab 32000] [--batch 8] [--seq 512]
        [--rounds 7] [--block 6] [--profile] [--count]

The model (issue 32's): token embedding, ``nn.TransformerEncoder`` (pre-norm, 4x MLP),
vocabulary head; at the defaults 216.7M parameters. Loss: cross-entropy on random tokens,
bf16 autocast on CUDA, fused AdamW. One process, NCCL on CUDA, gloo on the CPU (the CPU
defaults are shrunk so that it runs in seconds: it shows the direction, not the figures).

Each group builds three copies from the same weights: the bare module, fastddp and torch
DDP with the same arguments, then runs --rounds rounds of --block steps (zero_grad,
forward, backward, step) of each, in rotating order, and reports the median of the
per-round mean step times and its ratio to the bare module's. Groups: default arguments;
gbv (gradient_as_bucket_view=True); bf16 (torch's bf16_compress_hook registered on both);
powersgd (torch's powerSGD_hook with a PowerSGDState, rank 4, start_powerSGD_iter=2, on
both). The copies of a group are freed before the next is built.

--profile: after the groups, torch.profiler over --block steps of fastddp (default
arguments): the ops and kernels by self device time and fastddp's own ranges by host
time, to show where the reducer's cost goes. Not a test.

--count: instead of timing, the ops one step dispatches (ATen and c10d, top level: an op
called by another op is that op's work), counted by torch's profiler for the three
variants of each group, and the ones DDP adds to the bare step. Each is host time on the
autograd thread, and on a GPU most are a kernel launch: the direction of the reducer's
host cost, the same on any machine (tests/python/benchmarks/test_reducer_cost.py asserts it).
"""

import argparse
import collections
import copy
import gc
import os
import platform
import socket
import statistics
import time

os.environ.setdefault("FASTDDP_WORLD1_REDUCER", "1")  # read when a model is wrapped

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd  # noqa: E402

import fastddp  # noqa: E402

TorchDDP = nn.parallel.DistributedDataParallel
GROUPS = ("default", "gbv", "bf16", "powersgd")
# fastddp's other hooks, for --count (issue 43 item 7: every hook's ops counted): torch DDP
# runs torch's twin where it has one (fp16) and its default reduction otherwise.
FASTDDP_GROUPS = {
    "fp16": lambda: fastddp.hooks.fp16(),
    "bf16_ef": lambda: fastddp.hooks.bf16(error_feedback=True),
    "int8": lambda: fastddp.hooks.int8(),
    "fp8": lambda: fastddp.hooks.fp8("e4m3"),
    "batched": lambda: fastddp.hooks.batched_powersgd(4, start_powerSGD_iter=2),
    "acpsgd": lambda: fastddp.hooks.acpsgd(4, start_iter=2),
}


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)
        # enable_nested_tensor only applies to post-norm layers; off to keep torch quiet.
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))


def ddp_kwargs(group: str) -> dict:
    return {"gradient_as_bucket_view": True} if group == "gbv" else {}


def register_hook(model: nn.Module, group: str) -> None:
    if group in FASTDDP_GROUPS:
        if isinstance(model, fastddp.DistributedDataParallel):
            model.register_comm_hook(None, FASTDDP_GROUPS[group]())
        elif group == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif group == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif group == "powersgd":
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                   start_powerSGD_iter=2)
        model.register_comm_hook(state, psgd.powerSGD_hook)


class Runner:
    """One variant: its model, optimizer and a step."""

    def __init__(self, name: str, model: nn.Module, device: torch.device, args):
        self.name, self.model, self.device, self.args = name, model, device, args
        fused = device.type == "cuda"
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
        gen = torch.Generator(device="cpu").manual_seed(0)
        shape = (args.batch, args.seq)
        self.tokens = torch.randint(args.vocab, shape, generator=gen).to(device)
        self.targets = torch.randint(args.vocab, shape, generator=gen).to(device)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, torch.bfloat16,
                            enabled=self.device.type == "cuda"):
            logits = self.model(self.tokens)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), self.targets.flatten())
        loss.backward()
        self.opt.step()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_group(group: str, base: nn.Module, device: torch.device, args) -> list[Runner]:
    bare = copy.deepcopy(base).to(device)
    ours = fastddp.DistributedDataParallel(copy.deepcopy(base).to(device), **ddp_kwargs(group))
    theirs = TorchDDP(copy.deepcopy(base).to(device), **ddp_kwargs(group))
    for model in (ours, theirs):
        register_hook(model, group)
    return [Runner("bare", bare, device, args), Runner("fastddp", ours, device, args),
            Runner("torch DDP", theirs, device, args)]


def measure(runners: list[Runner], args) -> dict[str, float]:
    """Median over rounds of the mean step time of a block, variants in rotating order."""
    device = runners[0].device
    for r in runners:  # warm-up: bucket rebuild, PowerSGD's start, the allocator
        for _ in range(3):
            r.step()
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    for k in range(args.rounds):
        for r in runners[k % len(runners):] + runners[:k % len(runners)]:
            sync(device)
            start = time.perf_counter()
            for _ in range(args.block):
                r.step()
            sync(device)
            times[r.name].append((time.perf_counter() - start) / args.block)
    return {name: statistics.median(t) for name, t in times.items()}


def profile(runner: Runner, args) -> None:
    from torch.profiler import ProfilerActivity, profile as tprofile

    activities = [ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sync(runner.device)
    with tprofile(activities=activities) as prof:
        for _ in range(args.block):
            runner.step()
        sync(runner.device)
    averages = prof.key_averages()
    key = "self_device_time_total" if runner.device.type == "cuda" else "self_cpu_time_total"
    print(f"\n## Profile: fastddp, default arguments, {args.block} steps, by {key}\n")
    try:
        table = averages.table(sort_by=key, row_limit=30, max_name_column_width=60)
    except (AttributeError, KeyError, ValueError):  # older spelling of the device column
        table = averages.table(sort_by="self_cuda_time_total", row_limit=30,
                               max_name_column_width=60)
    print(table)
    print("\n## fastddp's ranges and the autograd engine, by host time\n")
    print("| range | calls | host total ms |")
    print("|---|---:|---:|")
    for e in sorted(averages, key=lambda e: -e.cpu_time_total):
        if "fastddp" in e.key or "DistributedDataParallel" in e.key:
            print(f"| {e.key} | {e.count} | {e.cpu_time_total / 1e3:.2f} |")


def dispatched_ops(step) -> collections.Counter:
    """The top-level ATen and c10d ops of one call of `step`, by name (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    def is_op(name: str) -> bool:
        return name.startswith(("aten::", "c10d::"))

    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return collections.Counter(e.name for e in prof.events() if is_op(e.name) and not (
        e.cpu_parent is not None and is_op(e.cpu_parent.name)))


def count(group: str, runners: list[Runner], n_params: int) -> None:
    # Warm-up: the bucket rebuild, PowerSGD's start (2), and two compressed steps, which
    # make the two sets of views a double-buffered state alternates between.
    for r in runners:
        for _ in range(5):
            r.step()
    ops = {r.name: dispatched_ops(r.step) for r in runners}
    bare = ops["bare"]
    print(f"| {group} | bare | {sum(bare.values())} | | | |")
    for name in ("fastddp", "torch DDP"):
        extra = ops[name] - bare
        listed = ", ".join(f"{op} {n}" for op, n in extra.most_common())
        print(f"| {group} | {name} | {sum(ops[name].values())} | {sum(extra.values())} | "
              f"{sum(extra.values()) / n_params:.2f} | {listed} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--groups", default=",".join(GROUPS))
    parser.add_argument("--width", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--block", type=int, default=6)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--count", action="store_true")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    # The model on a GPU; on the CPU a small one with the same structure.
    for name, gpu, cpu in (("width", 1024, 128), ("layers", 12, 4), ("vocab", 32000, 4000),
                           ("seq", 512, 64)):
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else cpu)
    groups = [g for g in args.groups.split(",") if g]
    unknown = set(groups) - set(GROUPS) - set(FASTDDP_GROUPS)
    if unknown:
        parser.error(f"unknown groups {sorted(unknown)}; known: "
                     f"{', '.join([*GROUPS, *FASTDDP_GROUPS])}")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(args.device)
    if cuda:
        if device.index is None:  # set_device() wants an index on torch 2.11
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    base = GPT(args.vocab, args.width, args.layers, args.heads)
    n_params = sum(p.numel() for p in base.parameters())
    name = torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu"
    print(f"# reducer cost at world size 1: {name}, torch {torch.__version__}, "
          f"fastddp {fastddp.__version__}")
    print(f"model: {n_params / 1e6:.1f}M parameters (width {args.width}, {args.layers} layers,"
          f" vocabulary {args.vocab}), batch {args.batch}x{args.seq}; {args.rounds} rounds of"
          f" {args.block} steps; FASTDDP_WORLD1_REDUCER={os.environ['FASTDDP_WORLD1_REDUCER']}")
    tensors = sum(1 for _ in base.parameters())
    if args.count:
        print(f"\n{tensors} parameter tensors")
        print("\n| group | variant | ops/step | added to the bare step | added per parameter "
              "| the added ops |")
        print("|---|---|---:|---:|---:|---|")
    else:
        print("\n| group | variant | ms/step | vs bare | fastddp / torch |")
        print("|---|---|---:|---:|---:|")
    for group in groups:
        runners = build_group(group, base, device, args)
        if args.count:
            count(group, runners, tensors)
            del runners
            continue
        medians = measure(runners, args)
        bare = medians["bare"]
        for variant, t in medians.items():
            vs_torch = (f"{t / medians['torch DDP']:.3f}" if variant == "fastddp" else "")
            print(f"| {group} | {variant} | {t * 1e3:.2f} | {t / bare:.3f} | {vs_torch} |",
                  flush=True)
        del runners
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if args.profile:
        model = fastddp.DistributedDataParallel(copy.deepcopy(base).to(device))
        runner = Runner("fastddp", model, device, args)
        for _ in range(3):  # the bucket rebuild happens outside the profile
            runner.step()
        profile(runner, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
