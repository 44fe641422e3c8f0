"""World size 1 with every comm hook: fastddp against torch DDP on the same data.

FASTDDP_WORLD1_REDUCER=1 makes fastddp build its reducer on one process, so that one GPU
over NCCL runs every bucket, hook, stream and write-back path. Each case trains torch DDP
with the matching torch hook (where torch has none: fastddp's pure-torch reference of the
same algorithm, run by torch DDP) and fastddp side by side from one seed, and compares
grads after every backward.

As scenarios: run_case() on a 1-rank harness world (test_world1_hooks.py). As a script, in
one process, what `make gpu-check` and its compute-sanitizer steps run:

    python tests/python/hooks/world1_hooks_scenarios.py [--device cuda] [--backend nccl]
        [--cases none,bf16,...] [--configs plain,bucket_view] [--steps 5]

It prints one row per case and config, then a `gpu-check figures: {json}` line, and exits
1 if any case failed (every case runs; --exit-zero: 0 all the same, for compute-sanitizer,
whose exit code must then say only what the sanitizer found).
"""

import argparse
import copy
import json
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from fastddp.ddp._options import WORLD1_REDUCER_ENV

# Run as a script (make gpu-check), the scenario modules are imported from the repository's
# root, as the tests import them.
sys.path.insert(1, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))
from tests.python.hooks.hooks_scenarios import EXACT, compare_grads, make_hook  # noqa: E402
from tests.python.hooks.powersgd_scenarios import (  # noqa: E402
    BATCHED_TOL, TOL, _differs_from_plain_mean, serialized_batched_powerSGD_hook,
    serialized_powerSGD_hook)
from tests.python.scenarios import mlp, unwrap, vector_batch  # noqa: E402

# fastddp's fused PowerSGD against torch's hook: powersgd_scenarios.py derives both bounds.
PSGD_TOL, PSGD_BATCHED_TOL = TOL, BATCHED_TOL
PSGD_START = 2  # start_powerSGD_iter: torch's minimum with error feedback

# name: (fastddp's hook, torch DDP's reference, tolerance, the native hook that must run).
# "none" registers no hook: the reducer exists only because of FASTDDP_WORLD1_REDUCER=1.
CASES = {
    "none": ("none", "none", EXACT, "allreduce"),
    "allreduce": ("fastddp.allreduce", "torch.allreduce_hook", EXACT, "allreduce"),
    # fastddp rounds as torch's half hooks (Note [torch's half rounding]): bit for bit.
    "bf16": ("fastddp.bf16", "torch.bf16_compress_hook", EXACT, "bf16"),
    # torch has no fp32-accumulating or error-feedback half hook: fastddp's reference.
    "bf16_fp32acc": ("fastddp.bf16_fp32", "fastddp.bf16_fp32", EXACT, "bf16(accumulate=fp32)"),
    "bf16_error_feedback": ("fastddp.bf16_ef", "fastddp.bf16_ef", EXACT,
                            "bf16+error_feedback"),
    "fp16": ("fastddp.fp16", "torch.fp16_compress_hook", EXACT, "fp16"),
    "torch_bf16_hook_native": ("torch.bf16_compress_hook", "torch.bf16_compress_hook",
                               EXACT, "bf16"),
    "powersgd_r1": ("fastddp.powersgd:1", "torch.powerSGD_hook:1", PSGD_TOL, "powersgd"),
    "powersgd_r4": ("fastddp.powersgd:4", "torch.powerSGD_hook:4", PSGD_TOL, "powersgd"),
    "batched_powersgd": ("fastddp.batched_powersgd:2", "torch.batched_powerSGD_hook:2",
                         PSGD_BATCHED_TOL, "powersgd_batched"),
    "python_hook": ("custom", "custom", EXACT, None),
    # The 8-bit hooks against the same algorithm in torch ops (quant8_hooks_scenarios.py).
    "int8": ("fastddp.int8", "quant8_reference:int8", EXACT, "int8"),
    "fp8_e5m2": ("fastddp.fp8:e5m2", "quant8_reference:e5m2", EXACT, "fp8(e5m2)"),
}
CONFIGS = {
    # 0.0001 MiB: about a bucket per parameter after the rebuild (many launches).
    "plain": {"bucket_cap_mb": 0.0001},
    "bucket_view": {"bucket_cap_mb": 0.001, "gradient_as_bucket_view": True},
}
FIGURES = ("result", "hook", "max_rel_diff", "buckets", "bytes_sent", "bytes_reduced", "error")


def _hook(spec: str) -> tuple[object, object] | None:
    """(state, hook) for a spec; None for "none". PowerSGD specs carry ":rank"."""
    if spec == "none":
        return None
    name, _, rank = spec.partition(":")
    if name == "fastddp.fp8":
        return None, fastddp.hooks.fp8(format=rank)
    if name == "quant8_reference":
        from tests.python.hooks import quant8_hooks_scenarios

        return None, quant8_hooks_scenarios.ReferenceHook(rank, error_feedback=True)
    if name in ("fastddp.powersgd", "fastddp.batched_powersgd"):
        make = getattr(fastddp.hooks, name.removeprefix("fastddp."))
        return None, make(matrix_approximation_rank=int(rank), start_powerSGD_iter=PSGD_START)
    if name in ("torch.powerSGD_hook", "torch.batched_powerSGD_hook"):
        state = psgd.PowerSGDState(None, matrix_approximation_rank=int(rank),
                                   start_powerSGD_iter=PSGD_START)
        # Waited for bucket by bucket (numbers unchanged); batched: torch's 2-D fix-up.
        return state, (serialized_powerSGD_hook if name == "torch.powerSGD_hook"
                       else serialized_batched_powerSGD_hook)
    return make_hook(spec)


def run_case(case: str, config: str = "plain", device: str = "cpu", steps: int = 5) -> dict:
    """One case on a 1-rank world: raises AssertionError on a mismatch; returns figures."""
    if case not in CASES or config not in CONFIGS:
        raise ValueError(f"unknown case {case!r} or config {config!r}; cases: {list(CASES)}, "
                         f"configs: {list(CONFIGS)}")
    assert dist.get_world_size() == 1, "a world-size-1 scenario"
    fast_spec, ref_spec, tol, native = CASES[case]
    previous = os.environ.get(WORLD1_REDUCER_ENV)
    os.environ[WORLD1_REDUCER_ENV] = "1"
    try:
        return _train(case, fast_spec, ref_spec, tol, native, CONFIGS[config], device, steps)
    finally:
        if previous is None:
            os.environ.pop(WORLD1_REDUCER_ENV, None)
        else:
            os.environ[WORLD1_REDUCER_ENV] = previous


def _train(case: str, fast_spec: str, ref_spec: str, tol: dict, native: str | None,
           ddp_kwargs: dict, device: str, steps: int) -> dict:
    torch.manual_seed(0)
    base = mlp().to(device)
    if device != "cpu":
        ddp_kwargs = {**ddp_kwargs, "device_ids": [torch.device(device).index or 0]}
    ref = TorchDDP(copy.deepcopy(base), **ddp_kwargs)
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), **ddp_kwargs)
    assert fast._reducer is not None, f"{WORLD1_REDUCER_ENV}=1 but fastddp built no reducer"
    hooks = _hook(ref_spec), _hook(fast_spec)
    for model, hook in zip((ref, fast), hooks):
        if hook is not None:
            model.register_comm_hook(*hook)
    hook_name = fast._reducer.hook_name
    if native is not None:
        assert hook_name == native, f"fastddp ran hook {hook_name!r}, expected {native!r}"
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, fast)]
    max_abs = max_rel = 0.0
    compressed = False
    for step in range(steps):
        inputs, target = vector_batch(step, device=device)
        for model, opt in zip((ref, fast), opts):
            opt.zero_grad(set_to_none=step % 2 == 0)
            F.mse_loss(model(inputs), target).backward()
        for p, q in zip(unwrap(ref).parameters(), unwrap(fast).parameters(), strict=True):
            diff = (q.grad - p.grad).abs().max().item()
            max_abs = max(max_abs, diff)
            max_rel = max(max_rel, diff / max(p.grad.abs().max().item(), 1e-30))
        compare_grads(unwrap(ref), unwrap(fast), f"{case}, step {step}", tol)
        if "powersgd" in fast_spec and step >= PSGD_START:
            compressed |= _differs_from_plain_mean(base, fast, inputs, target)
        for opt in opts:
            opt.step()
        with torch.no_grad():  # rounding differences must not compound through the optimizer
            for p, q in zip(ref.parameters(), fast.parameters()):
                q.copy_(p)
    stats = fast.comm_stats()
    if "powersgd" in fast_spec:
        assert compressed, f"{case}: the grads equal the uncompressed ones: nothing compressed"
        assert stats["bytes_sent"] < stats["bytes_reduced"], f"{case}: {stats}"
    if tol is EXACT and isinstance(hooks[0], tuple) and isinstance(hooks[0][0], dict):
        assert hooks[1][0]["calls"] == hooks[0][0]["calls"], "the Python hook saw other buckets"
    return {"hook": hook_name, "reference": ref_spec, "exact": tol is EXACT,
            "max_abs_diff": max_abs, "max_rel_diff": max_rel,
            "buckets": len(stats["buckets"]), "bytes_reduced": stats["bytes_reduced"],
            "bytes_sent": stats["bytes_sent"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", help="default: nccl on CUDA, gloo on CPU")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--exit-zero", action="store_true",
                        help="exit 0 even when a case fails (the table still says so)")
    args = parser.parse_args(argv)
    cases, configs = args.cases.split(","), args.configs.split(",")
    unknown = [c for c in cases if c not in CASES] + [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown case or config {unknown}; cases: {', '.join(CASES)}; "
                     f"configs: {', '.join(CONFIGS)}")
    backend = args.backend or ("nccl" if args.device.startswith("cuda") else "gloo")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device).index or 0)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, rank=0, world_size=1)
    print(f"world size 1, {backend}, {args.device}, torch {torch.__version__}, "
          f"{WORLD1_REDUCER_ENV}=1, {args.steps} steps\n")
    print("| case | config | fastddp hook | reference (torch DDP) | max abs diff | max rel diff "
          "| result |\n|---|---|---|---|---:|---:|---|", flush=True)
    results, failed = {}, 0
    for case in cases:
        for config in configs:
            start = time.perf_counter()
            try:
                out = run_case(case, config, args.device, args.steps)
                out["result"] = "pass"
            except Exception as e:  # every case runs; the failure is reported
                failed += 1
                out = {"result": "FAIL", "error": f"{type(e).__name__}: {e}"}
                traceback.print_exc(file=sys.stdout)
            out["seconds"] = round(time.perf_counter() - start, 2)
            results[f"{case}/{config}"] = {k: out[k] for k in FIGURES if k in out}
            diffs = ("-", "-") if "max_abs_diff" not in out else (
                f"{out['max_abs_diff']:.3g}", f"{out['max_rel_diff']:.3g}")
            print(f"| {case} | {config} | {out.get('hook', '-')} | {CASES[case][1]} | "
                  f"{diffs[0]} | {diffs[1]} | {out['result']} |", flush=True)
    dist.destroy_process_group()
    print(f"\n{len(results) - failed} of {len(results)} passed")
    print("gpu-check figures: " + json.dumps({"passed": len(results) - failed,
                                              "failed": failed, "cases": results}))
    return 1 if failed and not args.exit_zero else 0


if __name__ == "__main__":
    sys.exit(main())
