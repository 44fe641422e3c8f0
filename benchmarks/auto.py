"""--hook auto against every fixed configuration on emulated links: prints auto/best, worst/best.

    python benchmarks/auto.py [--nproc 2] [--links 1GB/s,3GB/s,10GB/s,50GB/s]
                              [--models vit,convnet] [--policy any] [--rounds 8] [--out DIR]

Spawns ``--nproc`` gloo ranks on 127.0.0.1 (one intra-op thread each). For each model and
each link (an EmulatedLinkGroup over WORLD, Note [emulated link timing]): one model tuned by
``fastddp.hooks.auto(policy)`` until it has chosen, then it and one model per fixed
candidate of the policy (plain allreduce at bucket caps 1, 4 and 16 MB, bf16, bf16 summed in
fp32, PowerSGD of rank 1, 2, 4, 8) are timed interleaved (benchmarks/common/auto_runs.py): median
step (zero_grad, forward, backward, SGD step) on rank 0's clock. Reported: auto's choice,
its median, the best and worst fixed configuration and their medians, auto over best (the
target: at most 1.05), and the steps auto spent choosing. Models: ``vit``, one ViT-L/32
block at full width on 16 tokens (~50 MB of gradients: communication-bound at slow links),
and ``convnet``, three 64-channel convolutions on 48x48 images (~0.3 MB: compute-bound). Writes
auto.md, auto.json and auto.png under --out. A benchmark, not a test.

The emulated link only delays: a collective never completes faster than gloo on loopback
really moves it, so the fast links all look alike once the real transport is the slower.
"""

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import auto_runs, machine  # benchmarks/common/: scripts run from benchmarks/


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for kind in args.models.split(","):
        for link in args.links.split(","):
            result = auto_runs.auto_against_fixed(kind, link, args.policy, args.rounds)
            if rank == 0:
                queue.put(result)
                print(f"{kind} {link}: auto chose {result['auto']['choice']}", flush=True)
            gc.collect()
    if rank == 0:
        queue.put(None)
    dist.barrier()
    dist.destroy_process_group()


def _row(result: dict) -> dict:
    medians = dict(result["medians"])
    auto_ms = medians.pop("auto")
    best = min(medians, key=medians.get)
    worst = max(medians, key=medians.get)
    return {"model": result["kind"], "link": result["link"],
            "choice": result["auto"]["choice"], "auto_ms": auto_ms,
            "best": best, "best_ms": medians[best], "worst": worst, "worst_ms": medians[worst],
            "auto_over_best": auto_ms / medians[best],
            "worst_over_best": medians[worst] / medians[best],
            "tuning_steps": result["tuning_steps"], "grad_mb": result["grad_bytes"] / 1e6}


def table(rows: list[dict]) -> str:
    lines = ["| model | link | auto's choice | auto ms | best fixed | best ms | worst fixed "
             "| worst ms | auto / best | worst / best | steps to choose |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} ({r['grad_mb']:.1f} MB) | {r['link']} | {r['choice']} "
                     f"| {r['auto_ms']:.1f} | {r['best']} | {r['best_ms']:.1f} | {r['worst']} "
                     f"| {r['worst_ms']:.1f} | {r['auto_over_best']:.3f} "
                     f"| {r['worst_over_best']:.2f} | {r['tuning_steps']} |")
    return "\n".join(lines)


def chart(rows: list[dict], path: Path, title: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart skipped: matplotlib is not installed (pip install matplotlib)"
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        xs = range(len(mine))
        for offset, key, label, color in ((-0.27, "best_ms", "best fixed", "#2ca02c"),
                                          (0.0, "auto_ms", "auto", "#1f77b4"),
                                          (0.27, "worst_ms", "worst fixed", "#888888")):
            ax.bar([x + offset for x in xs], [r[key] for r in mine], width=0.27, label=label,
                   color=color)
        for x, r in zip(xs, mine):
            ax.text(x, r["auto_ms"], r["choice"], ha="center", va="bottom", fontsize=6,
                    rotation=90)
        ax.set_xticks(list(xs), [r["link"] for r in mine])
        ax.set_ylabel("ms per step (lower is better)")
        ax.set_title(model, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"chart: {path}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--links", default="1GB/s,3GB/s,10GB/s,50GB/s")
    parser.add_argument("--models", default="vit,convnet")
    parser.add_argument("--policy", default="any", choices=("lossless", "bf16", "any"))
    parser.add_argument("--rounds", type=int, default=8, help="interleaved timing rounds")
    parser.add_argument("--out", default="auto_results")
    args = parser.parse_args()
    run = machine.Run()
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(args.nproc, machine.free_port(), args, queue), nprocs=args.nproc,
             join=True)
    results = list(iter(queue.get, None))
    rows = [_row(r) for r in results]
    header = run.header(f"); {args.nproc} ranks, policy {args.policy}, {args.rounds} "
                        "interleaved rounds.")
    text = header + "\n" + table(rows)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "auto.md").write_text(text + "\n")
    (out / "auto.json").write_text(json.dumps({"command": sys.argv, "machine": machine.describe(),
                                               "rows": rows, "runs": results}, indent=1,
                                              default=str) + "\n")
    print(chart(rows, out / "auto.png", f"fastddp --hook auto:{args.policy}, {args.nproc} "
                f"gloo ranks, {machine.describe()}"))


if __name__ == "__main__":
    main()
