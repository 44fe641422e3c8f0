"""fastddp's PowerSGD/ACP-SGD vs torch's powerSGD_hook: prints hook and step time ratios, bytes.

    python benchmarks/powersgd.py [--model vit|mlp] [--parts abcd] [--scale 0.25] [--blocks 24]
        [--rank 4] [--bucket-cap-mb 8] [--world 1] [--rounds 10] [--block 2] [--batch 4]
        [--device cpu] [--link 1GB/s]

--model vit (the default): parameters shaped as ViT-L/32's (patch embed 1024x3x32x32, 24
blocks of qkv 3072x1024, proj 1024x1024, fc1 4096x1024, fc2 1024x4096, layernorms and
biases, class token, position embedding, 1000-class head), hidden and MLP widths times
--scale (0.25 on CPU, 1.0 with --device cuda unless given). --model mlp: a plain MLP of
widths 512 -> 1024 (x6) -> 256 (6M parameters, ReLU, 256 classes), the shape on which an
outside check found fastddp's PowerSGD step barely ahead of torch's (issue 54; run it with
--batch 16).

(a) Hook time per step: the native hook (``fastddp.hooks.powersgd(...).native(group)``)
    and torch's ``powerSGD_hook`` (a ``PowerSGDState``, run through
    ``_C.PythonCommHook``) on the same gradients, via ``_C.HookRunner`` (buckets of
    --bucket-cap-mb in reverse parameter order, as DDP's), at --rank after
    start_powerSGD_iter (warm), on --world ranks. torch's hook is waited for bucket by
    bucket when there are several (it issues collectives from completion callbacks,
    which gloo pairs up wrongly across ranks otherwise).
(b) 2-rank training step time on a ViT-like module of those parameters (a tiny forward:
    --batch images of 64x64, 5 tokens, one attention head): fastddp + the native hook,
    torch DDP + torch's hook (serialized as above) with the same buckets, and torch DDP +
    torch's hook with one bucket (torch's advice for PowerSGD).
(c) Compression: fastddp's ``comm_stats()`` bytes reduced / sent per step, and torch's
    ``PowerSGDState.compression_stats()``.
(d) ACP-SGD (``fastddp.hooks.acpsgd``) against fastddp's PowerSGD at the same rank and
    buckets, 2 ranks, both over an emulated --link (fastddp.link.EmulatedLinkGroup).

Every figure is a median over --rounds rounds of --block steps, variants in rotating
order, rank 0's clock. Spawns gloo ranks on 127.0.0.1 (nccl with --device cuda when there
is a GPU per rank), one intra-op thread per rank on CPU. Not a test.
"""

import argparse
import copy
import os
import platform
import socket
import statistics
import subprocess
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

import fastddp
from fastddp import _C
from fastddp.link import EmulatedLinkGroup

START = 2  # start_powerSGD_iter: torch's minimum with error feedback
TorchDDP = nn.parallel.DistributedDataParallel


class Block(nn.Module):
    def __init__(self, hidden: int, mlp: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, mlp), nn.Linear(mlp, hidden)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(t)).chunk(3, dim=-1)
        t = t + self.proj(F.scaled_dot_product_attention(q, k, v))
        return t + self.fc2(F.gelu(self.fc1(self.ln2(t))))


class ViTLike(nn.Module):
    """ViT-L/32's parameter shapes at widths (hidden, mlp); 64x64 images, 4 patches."""

    def __init__(self, hidden: int, mlp: int, blocks: int, classes: int = 1000):
        super().__init__()
        self.patch = nn.Conv2d(3, hidden, 32, stride=32)
        self.cls = nn.Parameter(torch.zeros(1, 1, hidden))
        self.pos = nn.Parameter(torch.randn(1, 5, hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(hidden, mlp) for _ in range(blocks))
        self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.patch(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(t.shape[0], -1, -1), t], dim=1) + self.pos
        for block in self.blocks:
            t = block(t)
        return self.head(self.norm(t[:, 0]))


class PlainMLP(nn.Module):
    """Widths 512 -> 1024 (x6) -> 256: six hidden layers, 6M parameters."""

    def __init__(self, width_in: int = 512, width: int = 1024, hidden: int = 6,
                 classes: int = 256):
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(width_in, width), nn.ReLU()]
        for _ in range(hidden - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, classes))
        self.width_in, self.classes = width_in, classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_model(args: argparse.Namespace) -> nn.Module:
    if args.model == "mlp":
        return PlainMLP()
    return ViTLike(args.hidden, args.mlp, args.blocks)


def make_batch(base: nn.Module, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's fixed inputs and class labels for `base`."""
    if isinstance(base, PlainMLP):
        return (torch.randn(n, base.width_in, generator=g),
                torch.randint(0, base.classes, (n,), generator=g))
    return torch.randn(n, 3, 64, 64, generator=g), torch.randint(0, 1000, (n,), generator=g)


def serialized_powerSGD_hook(state: psgd.PowerSGDState,
                             bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's hook, finished before the next bucket's (see (a) above); no number changes."""
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(psgd.powerSGD_hook(state, bucket).wait())
    return done


def timed(fns: dict[str, Callable[[], None]], args: argparse.Namespace,
          sync: Callable[[], None]) -> dict[str, float]:
    """Median ms per call of each fn: --rounds rounds of --block calls, rotating order."""
    names, times = list(fns), {n: [] for n in fns}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            sync()
            t = time.perf_counter()
            for _ in range(args.block):
                fns[name]()
            sync()
            times[name].append((time.perf_counter() - t) / args.block * 1e3)
    return {n: statistics.median(v) for n, v in times.items()}


def part_a(args: argparse.Namespace, model: nn.Module, device: torch.device) -> dict:
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(dist.get_rank())
    grads = [torch.randn(p.shape, generator=g).to(device) for p in model.parameters()]
    cap = int(args.bucket_cap_mb * 2**20)
    native = _C.HookRunner(fastddp.hooks.powersgd(matrix_approximation_rank=args.rank,
                                                  start_powerSGD_iter=START).native(group),
                           grads, cap, group)
    state = psgd.PowerSGDState(None, matrix_approximation_rank=args.rank,
                               start_powerSGD_iter=START)
    reference = _C.HookRunner(_C.PythonCommHook(state, psgd.powerSGD_hook, grads, "powerSGD"),
                              grads, cap, group)
    serialize = len(reference.bucket_plan()) > 1
    fns = {"fastddp native powersgd": lambda: native.run(grads),
           "torch powerSGD_hook": lambda: reference.run(grads, serialize=serialize)}
    for fn in fns.values():
        for _ in range(START + 2):  # past start_powerSGD_iter: P and Q exist, warm start on
            fn()
    return {"times": timed(fns, args, _sync(device)), "buckets": len(native.bucket_plan())}


def train_timed(models: dict[str, nn.Module], args: argparse.Namespace,
                device: torch.device, base: nn.Module) -> dict[str, float]:
    """Training steps (SGD, cross-entropy on this rank's fixed inputs) of every model, past
    the start of compression, then timed interleaved: median ms per step by name."""
    opts = {n: torch.optim.SGD(m.parameters(), lr=1e-3) for n, m in models.items()}
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = (t.to(device) for t in make_batch(base, args.batch, g))

    def step(name: str) -> None:
        opts[name].zero_grad(set_to_none=True)
        F.cross_entropy(models[name](x), y).backward()
        opts[name].step()

    fns = {n: (lambda n=n: step(n)) for n in models}
    for fn in fns.values():
        for _ in range(START + 2):
            fn()
    return timed(fns, args, _sync(device))


def part_b(args: argparse.Namespace, base: nn.Module, device: torch.device) -> dict:
    one_bucket_mb = sum(p.numel() * p.element_size() for p in base.parameters()) / 2**20 + 1
    models: dict[str, nn.Module] = {}
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=args.bucket_cap_mb)
    fast.register_comm_hook(None, fastddp.hooks.powersgd(matrix_approximation_rank=args.rank,
                                                         start_powerSGD_iter=START))
    models["fastddp + native powersgd"] = fast
    # The floor: the same step with no DDP and no communication at all.
    models["local module, no DDP (floor)"] = copy.deepcopy(base)
    states = {}
    for name, cap, hook in (
            (f"torch DDP + powerSGD_hook (serialized), {args.bucket_cap_mb:g} MiB buckets",
             args.bucket_cap_mb, serialized_powerSGD_hook),
            ("torch DDP + powerSGD_hook, one bucket", one_bucket_mb, psgd.powerSGD_hook)):
        model = TorchDDP(copy.deepcopy(base), bucket_cap_mb=cap)
        states[name] = psgd.PowerSGDState(None, matrix_approximation_rank=args.rank,
                                          start_powerSGD_iter=START)
        model.register_comm_hook(states[name], hook)
        models[name] = model
    times = train_timed(models, args, device, base)
    torch_stats = {n: s.compression_stats() for n, s in states.items()}
    return {"times": times, "comm": fast.comm_stats(), "torch_compression": torch_stats,
            "buckets": {"fastddp": len(fast.comm_stats()["buckets"])}}


def part_d(args: argparse.Namespace, base: nn.Module, device: torch.device) -> dict:
    """ACP-SGD against fastddp's PowerSGD at the same rank and buckets, both on the emulated
    --link (EmulatedLinkGroup: each collective takes what that link would make it take)."""
    group = EmulatedLinkGroup(dist.group.WORLD, args.link)
    hooks = {f"fastddp powersgd, rank {args.rank}":
             lambda: fastddp.hooks.powersgd(args.rank, start_powerSGD_iter=START),
             f"fastddp acpsgd, rank {args.rank}":
             lambda: fastddp.hooks.acpsgd(args.rank, start_iter=START)}
    models = {}
    for name, make in hooks.items():
        model = fastddp.DistributedDataParallel(copy.deepcopy(base), process_group=group,
                                                bucket_cap_mb=args.bucket_cap_mb)
        model.register_comm_hook(None, make())
        models[name] = model
    return {"times": train_timed(models, args, device, base),
            "sent": {n: m.comm_stats()["bytes_sent"] for n, m in models.items()}}


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def worker(rank: int, world: int, port: int, part: str, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        torch.set_num_threads(1)
    backend = "nccl" if device.type == "cuda" and torch.cuda.device_count() >= world else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    torch.manual_seed(0)
    base = make_model(args).to(device)
    out = {"a": part_a, "b": part_b, "d": part_d}[part](args, base, device)
    out["backend"] = backend
    if rank == 0:
        out["numel"] = sum(p.numel() for p in base.parameters())
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def spawn(part: str, world: int, args: argparse.Namespace) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").Queue()
    mp.spawn(worker, args=(world, port, part, args, queue), nprocs=world)
    return queue.get()


def table(times: dict[str, float], ref: str) -> None:
    print(f"| variant | median ms | vs {ref} |\n|---|---:|---:|")
    for name, ms in times.items():
        print(f"| {name} | {ms:.2f} | {ms / times[ref]:.3f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit", choices=["vit", "mlp"])
    parser.add_argument("--parts", default="abc", help="which of (a), (b), (c), (d) to run")
    parser.add_argument("--link", default="1GB/s", help="(d)'s emulated link")
    parser.add_argument("--scale", type=float, help="width factor (0.25 on CPU, 1 on CUDA)")
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--rank", type=int, default=4, help="matrix_approximation_rank")
    parser.add_argument("--bucket-cap-mb", type=float, default=8.0)
    parser.add_argument("--world", type=int, default=1, help="ranks for (a); (b) uses 2")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=2, help="steps timed together")
    parser.add_argument("--batch", type=int, default=4, help="images per rank in (b)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    scale = args.scale if args.scale is not None else (1.0 if args.device == "cuda" else 0.25)
    args.hidden, args.mlp = int(1024 * scale), int(4096 * scale)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False,
                            capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    shapes = ("an MLP 512 -> 1024 (x6) -> 256" if args.model == "mlp" else
              f"ViT-L/32 shapes x{scale:g} (hidden {args.hidden}, mlp {args.mlp}, "
              f"{args.blocks} blocks)")
    print(f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, device "
          f"{args.device}, fastddp at {commit.strip() or '?'}; {shapes}; rank {args.rank}, "
          f"{args.bucket_cap_mb:g} MiB buckets; {args.rounds} rounds x {args.block} steps\n")
    if "a" in args.parts:
        a = spawn("a", args.world, args)
        print(f"(a) hook time per step, {a['numel'] / 1e6:.1f}M fp32 grads in {a['buckets']} "
              f"buckets, {args.world} {a['backend']} rank(s)\n")
        table(a["times"], "torch powerSGD_hook")
        print()
    if "b" in args.parts or "c" in args.parts:
        b = spawn("b", 2, args)
        if "b" in args.parts:
            print(f"(b) training step, 2 {b['backend']} ranks, batch {args.batch} per rank, "
                  f"fastddp in {b['buckets']['fastddp']} buckets\n")
            fast_name, *refs = b["times"]
            for ref in refs:
                table({k: b["times"][k] for k in (fast_name, ref)}, ref)
                print()
        if "c" in args.parts:
            c = b["comm"]
            print(f"(c) fastddp comm_stats per step: {c['bytes_reduced'] / 2**20:.2f} MiB reduced, "
                  f"{c['bytes_sent'] / 2**20:.3f} MiB sent, ratio {c['compression_ratio']:.1f}x")
            for name, (rate, before, after) in b["torch_compression"].items():
                print(f"    {name}: compression_stats() rate {rate:.1f}x "
                      f"({before:.0f} -> {after:.0f} elements, all steps)")
    if "d" in args.parts:
        d = spawn("d", 2, args)
        print(f"(d) training step on an emulated {args.link} link, 2 {d['backend']} ranks, "
              f"batch {args.batch} per rank; bytes each rank sent in the last step: "
              + ", ".join(f"{n} {b / 2**20:.3f} MiB" for n, b in d["sent"].items()) + "\n")
        powersgd_name = next(iter(d["times"]))
        table(d["times"], powersgd_name)


if __name__ == "__main__":
    main()
