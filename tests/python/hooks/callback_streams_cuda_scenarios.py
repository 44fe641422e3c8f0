"""Scenario for test_callback_streams_cuda.py (issue 43 item 5): the CUDA streams a
compressed PowerSGD-family step's kernels run on, from torch's profiler (CUPTI's stream ids
in the chrome trace), on one GPU over NCCL with fastddp's reducer forced at world size 1.

torch runs a future's callbacks with a stream of c10's global pool current; fastddp's
decompression in those callbacks must run on its own side stream instead (Note [hook streams]
in csrc/hooks/common/side_stream.h). The stream ids of the compute stream, the side stream
and a pool stream are learned first, each from a profile holding one marker kernel on it."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import fastddp
from fastddp import _C
from fastddp.ddp._options import WORLD1_REDUCER_ENV
from tests.python.scenarios import mlp, vector_batch

# Device work with a stream in the chrome trace: kernels, and memsets and copies.
DEVICE_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")
PSGD = {"matrix_approximation_rank": 2, "min_compression_rate": 1}
HOOKS: dict[str, Callable[[], object]] = {
    "powersgd": lambda: fastddp.hooks.powersgd(start_powerSGD_iter=2, **PSGD),
    "batched_powersgd": lambda: fastddp.hooks.batched_powersgd(start_powerSGD_iter=2, **PSGD),
    "acpsgd": lambda: fastddp.hooks.acpsgd(start_iter=2, **PSGD),
}
WARMUP = 4  # two plain steps (start iter 2), then compressed ones: state exists


def _device_work(run: Callable[[], None]) -> list[tuple[str, int]]:
    """(name, stream id) of every device activity `run` launched, synchronized at the end."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return [(e.get("name", ""), int(e["args"]["stream"])) for e in events
            if e.get("cat") in DEVICE_CATEGORIES and "stream" in e.get("args", {})]


def _stream_of_marker(stream: torch.cuda.Stream) -> int:
    x = torch.ones(16, device="cuda")
    torch.cuda.synchronize()

    def marker() -> None:
        with torch.cuda.stream(stream):
            x.add_(1)

    streams = {sid for _, sid in _device_work(marker)}
    assert len(streams) == 1, streams
    return streams.pop()


def step_streams(hook: str, steps: int = 2) -> dict:
    """The streams of `steps` compressed steps' device work (forward and backward, with the
    write-back and decompression), by kind: NCCL's kernels and the rest."""
    sid, index, kind = _C._side_stream("cuda:0")
    side = torch.cuda.Stream(stream_id=sid, device_index=index, device_type=kind)
    ids = {"compute": _stream_of_marker(torch.cuda.current_stream()),
           "side": _stream_of_marker(side),
           "pool": _stream_of_marker(torch.cuda.Stream())}
    os.environ[WORLD1_REDUCER_ENV] = "1"
    try:
        torch.manual_seed(0)
        fast = fastddp.DistributedDataParallel(mlp().cuda(), device_ids=[0], bucket_cap_mb=0.0001)
    finally:
        os.environ.pop(WORLD1_REDUCER_ENV, None)
    fast.register_comm_hook(None, HOOKS[hook]())
    batches = [vector_batch(k, device="cuda") for k in range(WARMUP + steps)]

    def step(k: int) -> None:
        inputs, target = batches[k]
        F.mse_loss(fast(inputs), target).backward()

    for k in range(WARMUP):
        step(k)
    torch.cuda.synchronize()
    work = _device_work(lambda: [step(k) for k in range(WARMUP, WARMUP + steps)])
    nccl = sorted({s for name, s in work if name.startswith("nccl")})
    other = {}
    for name, s in work:
        if not name.startswith("nccl"):
            other.setdefault(s, []).append(name[:120])
    return {"ids": ids, "nccl_streams": nccl, "other": other,
            "bytes_sent": fast.comm_stats()["bytes_sent"],
            "bytes_reduced": fast.comm_stats()["bytes_reduced"]}
