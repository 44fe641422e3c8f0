"""The article's DDP configurations (ViT-L/32), torch DDP vs fastddp: prints steps/s of each.

The article's experiment ("Optimizing Data Transfer in Distributed AI/ML Training
Workloads": ViT-L/32, synthetic data, DDP options on g6e and p4d), torch DDP and fastddp
side by side in steps/s, plus a projection of the same configurations to n GPUs.

    python benchmarks/article.py [--device auto|cpu|cuda] [--nproc N] [--quick]
        [--model vit_l_32|small|tiny] [--only TEXT] [--project-n 2,4,8]
        [--bandwidth PCIe=3,NVLink=230] [--out benchmarks/out]

With GPUs: torchvision's vit_l_32 (or the same ViT-L/32 defined here), batch 32 per GPU,
NCCL, one process per GPU. On CPU: a scaled-down ViT ("small", 15.8M parameters, batch 8)
on 2 gloo ranks with one thread each. Every configuration builds a torch DDP and a
fastddp replica from the same weights and times them in interleaved blocks; steps/s are
1000 / median step ms (rank 0's clock, after warm-up). A configuration fastddp cannot
build yet (NotImplementedError, e.g. static_graph or a hook not in this build) shows
"n/a (reason)". Writes article_<device>.md/.png/.json under --out and prints the table.
"""

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fastddp
from fastddp.launch.patch import HookSpec, fastddp_hook, torch_hook
from fastddp.launch.report import format_projection

PRESETS = {  # ViT: image, patch, layers, width, heads, mlp, classes; batch; bucket sweep MB
    "vit_l_32": {"vit": (224, 32, 24, 1024, 16, 4096, 1000), "batch": 32,
                 "buckets": (1, 25, 100)},
    "small": {"vit": (128, 32, 8, 384, 6, 1536, 1000), "batch": 8, "buckets": (1, 5, 25)},
    "tiny": {"vit": (64, 32, 2, 64, 4, 128, 10), "batch": 2, "buckets": (1,)},
}
# Figures stated in the article's text (its tables are images); "~" marks values derived
# from a percentage or a step time the text gives.
ARTICLE = {
    "g6e.48xlarge (8x L40S, PCIe without P2P)": {
        "no DDP, 1 GPU": "8.91", "DDP, 1 GPU": "8.40", "DDP fp32, one bucket": "~1.43",
        "BF16, one bucket": "~2.36", "BF16, bucket_cap_mb=100": "~2.66",
        "PowerSGD r=1, one bucket": "7.5"},
    "p4d.24xlarge (8x A100, NVLink)": {
        "no DDP, 1 GPU": "5.17", "DDP, 1 GPU": "5.04", "DDP fp32, one bucket": "~4.76",
        "fp32, gradient_as_bucket_view, bucket_cap_mb=100": "~4.95"},
}
ARTICLE_NOTES = ("g6e 8-GPU DDP: 701 ms step in its trace (\"more than 6 times slower\"); "
                 "BF16 +65% and, with several buckets, +86% over it; PowerSGD 7.5 steps/s. "
                 "p4d 8-GPU DDP: \"8% lower\" than 5.17; best configuration +4%.")


class ViT(nn.Module):
    """ViT as torchvision builds it (conv patches, class token, pre-norm encoder, head)."""

    def __init__(self, image: int, patch: int, layers: int, width: int, heads: int, mlp: int,
                 classes: int):
        super().__init__()
        self.patch = nn.Conv2d(3, width, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, width) * 0.02)
        block = nn.TransformerEncoderLayer(width, heads, mlp, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        return self.head(self.norm(self.encoder(x))[:, 0])


def build_model(name: str) -> nn.Module:
    if name == "vit_l_32":
        try:
            from torchvision.models import vit_l_32
            return vit_l_32(weights=None)
        except ImportError:
            pass
    return ViT(*PRESETS[name]["vit"])


@dataclass
class Config:
    name: str
    kwargs: dict = field(default_factory=dict)
    hook: HookSpec | None = None
    world1: bool = False  # on a one-rank group, next to the bare model (the baseline)


def configurations(buckets: tuple[int, ...]) -> list[Config]:
    """The article's sequence, one option at a time from its starting point (one 2 GB
    bucket), then the bucket sweep and its two best combinations."""
    one = {"bucket_cap_mb": 2000}
    fast = {"static_graph": True, "gradient_as_bucket_view": True}
    multi = buckets[len(buckets) // 2]
    return [
        Config("DDP, 1 process", one, world1=True),
        Config("DDP, bucket_cap_mb=2000 (one bucket)", one),
        Config("+ static_graph", {**one, "static_graph": True}),
        Config("+ gradient_as_bucket_view", {**one, "gradient_as_bucket_view": True}),
        Config("+ BF16 hook", one, HookSpec("bf16")),
        Config("+ BF16 hook, fp32 accumulation", one, HookSpec("bf16-fp32acc")),
        Config("+ PowerSGD hook, rank 1", one, HookSpec("powersgd", 1)),
        *[Config(f"bucket_cap_mb={mb}", {"bucket_cap_mb": mb}) for mb in buckets],
        Config(f"static + bucket view + BF16, bucket_cap_mb={multi}",
               {**fast, "bucket_cap_mb": multi}, HookSpec("bf16")),
        Config("static + bucket view + PowerSGD r=1, one bucket", {**fast, **one},
               HookSpec("powersgd", 1)),
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # the article's optimizer
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return step


def _wrap(impl: str, cfg: Config, state: dict, args: argparse.Namespace, device: torch.device,
          group: dist.ProcessGroup | None) -> nn.Module:
    model = build_model(args.model).to(device)
    model.load_state_dict(state)
    cls = fastddp.DistributedDataParallel if impl == "fastddp" else (
        nn.parallel.DistributedDataParallel)
    ids = [device.index] if device.type == "cuda" else None
    ddp = cls(model, device_ids=ids, process_group=group, **cfg.kwargs)
    if cfg.hook is not None:
        hook_state, hook = (torch_hook if impl == "torch" else fastddp_hook)(cfg.hook, "hook")
        ddp.register_comm_hook(hook_state, hook)
    return ddp


def measure(variants: dict, device: torch.device, args: argparse.Namespace) -> dict[str, float]:
    """Median ms per step of each variant, blocks interleaved in alternating order."""
    for step in variants.values():
        for _ in range(args.warmup):
            step()
    ms: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            for _ in range(args.steps):
                _sync(device)
                start = time.perf_counter()
                variants[name]()
                _sync(device)
                ms[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(v) for name, v in ms.items()}


def run_config(cfg: Config, state: dict, batch: tuple, args: argparse.Namespace,
               device: torch.device, group: dist.ProcessGroup | None) -> dict:
    variants, na = {}, {}
    if cfg.world1:
        bare = build_model(args.model).to(device)
        bare.load_state_dict(state)
        variants["no DDP"] = _make_step(bare, *batch)
    for impl in ("torch", "fastddp"):
        try:
            variants[impl] = _make_step(_wrap(impl, cfg, state, args, device, group), *batch)
        except NotImplementedError as e:  # a feature that has not landed: say which
            reason = str(e).replace("fastddp.DistributedDataParallel: ", "")
            na[impl] = reason.split(" (")[0].split("; ")[0]  # the first clause is enough
    medians = measure(variants, device, args) if variants else {}
    return {"name": cfg.name, "ranks": 1 if cfg.world1 else args.nproc, "ms": medians, "na": na}


def kernel_times(model: nn.Module, device: torch.device, multi_mb: int) -> dict:
    """One device's cost of what each DDP variant adds to a step (for the projection)."""
    grads = [p.detach().clone() for p in model.parameters()]
    nbytes, psgd_bytes = wire_bytes(grads)
    flat = torch.empty(nbytes // 4, device=device)
    half = torch.empty(nbytes // 4, device=device, dtype=torch.bfloat16)
    mats = [g.reshape(g.shape[0], -1) for g in grads if g.dim() > 1
            and (g.shape[0] + g[0].numel()) * 2 < g.numel()]  # as in wire_bytes()
    qs = [torch.randn(m.shape[1], 1, device=device) for m in mats]

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    def copies() -> None:  # gradients into the bucket and back
        torch.cat([g.flatten() for g in grads], out=flat)
        chunks = flat.split([g.numel() for g in grads])
        torch._foreach_copy_(grads, [c.view_as(g) for c, g in zip(chunks, grads)])

    def powersgd() -> None:  # P = MQ, orthonormalize, Q = M^T P, then M ~ PQ^T and the
        for m, q in zip(mats, qs):  # error feedback M - PQ^T: two passes over M
            p = torch.linalg.qr(m @ q).Q
            approx = p @ (m.t() @ p).t()
            m.sub_(approx).add_(approx)
    return {"grad_bytes": nbytes, "psgd_wire_bytes": psgd_bytes, "copy_ms": timed(copies),
            "bf16_ms": timed(lambda: (half.copy_(flat), flat.copy_(half))),
            "psgd_ms": timed(powersgd), "buckets": math.ceil(nbytes / (multi_mb * 2**20)),
            "multi_mb": multi_mb}


def worker(rank: int, args: argparse.Namespace, port: int, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # the ranks share the cores
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.nproc)
    one = dist.new_group([0])
    preset = PRESETS[args.model]
    torch.manual_seed(0)
    model = build_model(args.model).to(device)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(100 + rank)
    image = preset["vit"][0]
    batch = (torch.randn(args.batch, 3, image, image, generator=gen).to(device),
             torch.randint(0, preset["vit"][-1], (args.batch,), generator=gen).to(device))
    configs = [c for c in configurations(preset["buckets"]) if args.only in c.name]
    rows = []
    for i, cfg in enumerate(configs):
        start = time.perf_counter()
        row = None
        if not cfg.world1 or rank == 0:
            row = run_config(cfg, state, batch, args, device, one if cfg.world1 else None)
        dist.barrier()
        if rank == 0:
            rows.append(row)
            cells = [f"{k} {1e3 / v:.2f} steps/s" for k, v in row["ms"].items()]
            cells += [f"{k} n/a ({v})" for k, v in row["na"].items()]
            print(f"[{i + 1}/{len(configs)}] {cfg.name}: {', '.join(cells)}  "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
    if rank == 0:
        kernels = kernel_times(model, device, preset["buckets"][len(preset["buckets"]) // 2])
        Path(result_path).write_text(json.dumps({"rows": rows, "kernels": kernels}))
    dist.barrier()
    dist.destroy_process_group()


def _cell(row: dict, impl: str) -> str:
    if impl in row["na"]:
        return f"n/a ({row['na'][impl]})"
    return f"{1e3 / row['ms'][impl]:.2f}" if impl in row["ms"] else "-"


def format_table(rows: list[dict], machine: str) -> str:
    base = next((r["ms"]["no DDP"] for r in rows if "no DDP" in r["ms"]), None)
    head = ["configuration", "ranks", "torch DDP steps/s", "fastddp steps/s", "fastddp / torch",
            "torch / baseline", "fastddp / baseline"]
    out = [(f"Machine: {machine}. steps/s = 1000 / median step ms (rank 0); fastddp / torch "
            "> 1 means fastddp is faster; baseline = the bare model on one process."), "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if base is not None:
        out.append(f"| no DDP (bare model, 1 process): baseline | 1 | {1e3 / base:.2f} "
                   f"| {1e3 / base:.2f} | - | 1.00 | 1.00 |")
    for r in rows:
        ms = r["ms"]
        ratio = f"{ms['torch'] / ms['fastddp']:.3f}" if "torch" in ms and "fastddp" in ms else "-"
        rel = [f"{base / ms[i]:.2f}" if base and i in ms else "-" for i in ("torch", "fastddp")]
        out.append(f"| {r['name']} | {r['ranks']} | {_cell(r, 'torch')} | {_cell(r, 'fastddp')} "
                   f"| {ratio} | {rel[0]} | {rel[1]} |")
    return "\n".join(out)


def write_chart(rows: list[dict], path: Path, title: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart skipped: matplotlib is not installed (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.5))
    ys = range(len(rows))
    for offset, impl, color in ((-0.2, "torch", "#888888"), (0.2, "fastddp", "#1f77b4")):
        vals = [1e3 / r["ms"][impl] if impl in r["ms"] else 0.0 for r in rows]
        ax.barh([y + offset for y in ys], vals, height=0.4, label=impl, color=color)
        for y, r in zip(ys, rows):
            if impl not in r["ms"]:
                ax.text(0.01, y + offset, f"{impl}: n/a", va="center", fontsize=7)
    base = next((r["ms"]["no DDP"] for r in rows if "no DDP" in r["ms"]), None)
    if base:
        ax.axvline(1e3 / base, color="black", linestyle="--", label="no DDP baseline")
    ax.set_yticks(list(ys), [r["name"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("steps/s (higher is better)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"chart: {path}"


def wire_bytes(params: list[torch.Tensor]) -> tuple[int, int]:
    """fp32 gradient bytes, and PowerSGD rank-1 wire bytes: a matrix is compressed to
    (rows + cols) floats when torch's rule (min_compression_rate 2) says it pays."""
    total = psgd = 0
    for p in params:
        n, rows = p.numel(), p.shape[0] if p.dim() > 1 else p.numel()
        cols = n // rows
        total += 4 * n
        psgd += 4 * ((rows + cols) if p.dim() > 1 and (rows + cols) * 2 < n else n)
    return total, psgd


def projection(result: dict, ns: list[int], bandwidths: list[tuple[str, float]]) -> str:
    """Note [ring allreduce cost] (fastddp/launch/report.py) for this run's model on this device,
    and for ViT-L/32 on the article's two machines."""
    k = result["kernels"]
    base = next(r["ms"]["no DDP"] for r in result["rows"] if "no DDP" in r["ms"])

    def rows_for(compute: float, S: float, psgd_bytes: float, kern: dict, buckets: int,
                 multi_mb: int, reported: dict) -> list[dict]:
        # Backward is about 2/3 of a step: what the buckets before the last can hide under.
        over = {"overlap_ms": compute * 2 / 3, "buckets": buckets}
        specs = [("DDP fp32, one bucket", kern["copy"], S, {}),
                 (f"fp32, gradient_as_bucket_view, bucket_cap_mb={multi_mb}", 0.0, S, over),
                 ("BF16, one bucket", kern["bf16"], S / 2, {}),
                 (f"BF16, bucket_cap_mb={multi_mb}", kern["bf16"], S / 2, over),
                 ("PowerSGD r=1, one bucket", kern["psgd"], psgd_bytes, {})]
        return [dict(name=n, compute_ms=compute, kernel_ms=ms, wire_bytes=w,
                     reported=reported.get(n, {}), **extra) for n, ms, w, extra in specs]

    measured = {"copy": k["copy_ms"], "bf16": k["bf16_ms"], "psgd": k["psgd_ms"]}
    here = rows_for(base, k["grad_bytes"], k["psgd_wire_bytes"], measured, k["buckets"],
                    k["multi_mb"], {})
    out = [("PROJECTION, not a measurement: step = one device's compute + the variant's "
            "kernels + the exposed ring allreduce 2(n-1)/n * S / B (B = bus bandwidth; with "
            "several buckets an idealized overlap with backward)."), "",
           format_projection(here, ns, bandwidths, "This run's model: compute and kernel "
                             "times measured on this device")]
    # ViT-L/32 on the article's GPUs: compute from the article's 1-GPU figure; kernel times
    # estimated as bytes moved at the GPU's memory bandwidth (bucket copies 4S, bf16 casts
    # 3S, PowerSGD about 5S), since they cannot be measured without that GPU.
    with torch.device("meta"):
        S, psgd_bytes = wire_bytes(list(ViT(*PRESETS["vit_l_32"]["vit"]).parameters()))
    for (machine, figs), (label, gbs), mem in zip(
            ARTICLE.items(), (("PCIe no P2P", 3.0), ("NVLink", 230.0)), (864, 1555)):
        est = {"copy": 4 * S / mem / 1e6, "bf16": 3 * S / mem / 1e6, "psgd": 5 * S / mem / 1e6}
        reported = {n: {(8, label): v} for n, v in figs.items()}
        rows = rows_for(1e3 / float(figs["no DDP, 1 GPU"]), S, psgd_bytes, est,
                        math.ceil(S / (100 * 2**20)), 100, reported)
        out += ["", format_projection(rows, [8], [(label, gbs)], f"ViT-L/32 on {machine}: "
                                      "compute from the article's 1-GPU steps/s, kernels "
                                      f"estimated at {mem} GB/s; (article: its figure)")]
    names = list(dict.fromkeys(n for figs in ARTICLE.values() for n in figs))
    out += ["", ("**The article's reported steps/s** (8 GPUs unless marked 1 GPU; ~ derived "
                 "from its text)"), "", "| configuration | " + " | ".join(ARTICLE) + " |",
            "|---|" + "---|" * len(ARTICLE)]
    out += [f"| {n} | " + " | ".join(f.get(n, "-") for f in ARTICLE.values()) + " |"
            for n in names]
    out += ["", f"From its text: {ARTICLE_NOTES}"]
    return "\n".join(out)


def _machine(device: str, nproc: int, model: str) -> str:
    if device == "cuda":
        what = f"{nproc}x {torch.cuda.get_device_name(0)}, NCCL"
    else:
        what = f"CPU ({os.cpu_count()} cores), {nproc} gloo ranks on 127.0.0.1, 1 thread each"
    return f"{what}; torch {torch.__version__}; model {model}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--nproc", type=int, help="ranks (default: GPUs, or 2 on CPU)")
    parser.add_argument("--model", choices=list(PRESETS),
                        help="default: vit_l_32 on GPU, small on CPU")
    parser.add_argument("--batch", type=int, help="per-rank batch (default: the preset's)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    parser.add_argument("--quick", action="store_true", help="--warmup 2 --rounds 2 --steps 3")
    parser.add_argument("--only", default="", help="run the configurations whose name has this")
    parser.add_argument("--project-n", default="2,4,8", help="GPU counts for the projection")
    parser.add_argument("--bandwidth", default="PCIe no P2P=3,NVLink=230",
                        help="LABEL=GB/s bus bandwidths for the projection")
    parser.add_argument("--out", default=str(Path(__file__).parent / "out"))
    args = parser.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible")
    args.nproc = args.nproc or (torch.cuda.device_count() if args.device == "cuda" else 2)
    args.model = args.model or ("vit_l_32" if args.device == "cuda" else "small")
    args.batch = args.batch or PRESETS[args.model]["batch"]
    if args.quick:
        args.warmup, args.rounds, args.steps = 2, 2, 3
    bandwidths = [(label, float(gbs)) for label, gbs in
                  (b.rsplit("=", 1) for b in args.bandwidth.split(","))]
    ns = [int(n) for n in args.project_n.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"article_{args.device}_{args.model}"
    machine = _machine(args.device, args.nproc, args.model)
    print(f"article experiment: {machine}; batch {args.batch}/rank; warm-up {args.warmup}, "
          f"{args.rounds} rounds x {args.steps} steps per variant", flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port, f"{stem}.json"), nprocs=args.nproc)
    result = json.loads(Path(f"{stem}.json").read_text())
    table = format_table(result["rows"], machine)
    chart = write_chart(result["rows"], stem.with_suffix(".png"), machine)
    text = table
    if any("no DDP" in r["ms"] for r in result["rows"]):
        text += "\n\n" + projection(result, ns, bandwidths)
    stem.with_suffix(".md").write_text(f"`{' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}`"
                                      f"\n\n{text}\n")
    print(f"\n{text}\n\n{chart}\ntable: {stem}.md", flush=True)


if __name__ == "__main__":
    main()
