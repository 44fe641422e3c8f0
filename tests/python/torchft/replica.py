"""One torchft replica group (one rank) training a small model, in its own process, for
tests/python/torchft: fastddp's DDP under torchft (``impl="fastddp"``) or torchft's own DDP
(``impl="torchft"``), the reference we did not write.

Each step's batch depends on the replica and on the manager's step only, so a step that is
not committed is retried on the same data, and two runs whose quorums change at the same
steps take the same steps. ``kill_at``: this replica exits (os._exit, as a killed process:
its sockets close, no clean-up) in that step: ``kill_in="backward"`` (the default) in the
middle of its backward, after the last layer's gradients are ready (fastddp has launched a
bucket by then); ``kill_in="between"`` once the step is committed, before the next. The result, written
with torch.save to ``out``: the weights, the optimizer state, per step attempted
(step, participants, committed), and per step attempted what ``manager.is_participating()``
said after the forward and after the backward.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

KILLED_EXIT_CODE = 17
IN_DIM, HIDDEN, OUT_DIM = 24, 48, 8


def make_model(hidden: int = HIDDEN) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN_DIM, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                         nn.Tanh(), nn.Linear(hidden, OUT_DIM))


def batch(replica: int, step: int, rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(rows, IN_DIM, generator=g), torch.randn(rows, OUT_DIM, generator=g)


def _wrap(impl: str, manager: Any, model: nn.Module, hook: str | None,
          bucket_cap_mb: float, **kwargs: Any) -> nn.Module:
    if impl == "fastddp":
        from fastddp.integrations.torchft import DistributedDataParallel
        return DistributedDataParallel(manager, model, hook=hook, bucket_cap_mb=bucket_cap_mb,
                                       **kwargs)
    from torchft.ddp import DistributedDataParallel
    if hook == "bf16":
        return _bf16_torchft_ddp()(manager, model, bucket_cap_mb=bucket_cap_mb)
    assert hook is None, f"torchft's DDP here: allreduce or bf16, not {hook}"
    return DistributedDataParallel(manager, model, bucket_cap_mb=bucket_cap_mb)


def _bf16_torchft_ddp() -> type:
    """torchft's DDP with torch's bf16 compression (bf16_compress_hook's algorithm) over the
    manager's allreduce, which averages over the participants: torchft's constructor
    registers ``self._comm_hook``, overridden here."""
    from torchft.ddp import DistributedDataParallel

    class Bf16DistributedDataParallel(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):  # no hints: torch checks them, and they are strings here
            buffer = bucket.buffer()
            work = state.allreduce(buffer.to(torch.bfloat16))
            work.wait()

            def decompress(fut: torch.futures.Future) -> torch.Tensor:
                value = fut.value()
                buffer.copy_(value[0] if isinstance(value, list) else value)
                return buffer

            return work.get_future()._fut.then(decompress)

    return Bf16DistributedDataParallel


def run(config: dict[str, Any]) -> None:
    """The replica's whole life; config: replica, lighthouse, steps, impl, hook,
    min_replicas, kill_at (or None), timeout_s, out; optional group_rank and group_world
    (this process is rank group_rank of a replica group of group_world ranks, with its own
    gloo group inside the group: the hierarchical hook's node) and store_port (the group's
    TCPStore, made by the harness), init_sync and use_async_quorum (the Manager's), kill_in,
    full, hidden, rows,
    bucket_cap_mb, stall_at, stall_s and stall_replica (once, that replica's backward of that
    step sleeps stall_s), nan_at (replica 0's batch has a NaN at that step), ddp_kwargs. An
    error raised by backward ends the run, logged as (step, None, False, its repr)."""
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    replica = config["replica"]
    group_rank, group_world = config.get("group_rank", 0), config.get("group_world", 1)
    model = make_model(config.get("hidden", HIDDEN))
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    timeout = timedelta(seconds=config["timeout_s"])
    if config.get("store_port"):
        store = dist.TCPStore("localhost", config["store_port"], is_master=False)
    else:
        store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    if group_world > 1:  # the replica group's own group (torchft leaves it alone)
        dist.init_process_group("gloo", store=dist.PrefixStore("replica_group", store),
                                rank=group_rank, world_size=group_world, timeout=timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        min_replica_size=config["min_replicas"],
        load_state_dict=lambda s: (model.load_state_dict(s["model"]),
                                   inner.load_state_dict(s["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"replica_{replica}", store_addr="localhost", store_port=store.port,
        rank=group_rank, world_size=group_world, lighthouse_addr=config["lighthouse"], port=0,
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
        # False: no replica heals at step 0 (with it, all but one send zeros in that step).
        init_sync=config.get("init_sync", True),
        # False: the heal happens in zero_grad (start_quorum), before the first bind.
        use_async_quorum=config.get("use_async_quorum", True))
    # Small buckets by default: several collectives per step, so that a death lands
    # between two of them.
    if config.get("start_together"):
        _wait_for_all(config)
    ddp = _wrap(config["impl"], manager, model, config.get("hook"),
                config.get("bucket_cap_mb", 0.004), **config.get("ddp_kwargs", {}))
    optimizer = OptimizerWrapper(manager, inner)
    armed = [None]  # what backward does at the first layer's output this step

    def arm(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if armed[0] is not None:
            output.register_hook(armed[0])

    model[0].register_forward_hook(arm)
    log = []
    participation = []  # per step attempted: (step, is_participating() after forward, after backward)
    stalled = False
    try:
        # With "full": and on, until a step committed with every replica (a killed one
        # restarted and healed), so that the others wait for it.
        full = config.get("full")
        while manager.current_step() < config["steps"] or (
                full is not None and log and log[-1][1:3] != (full, True)):
            step = manager.current_step()
            optimizer.zero_grad()
            x, y = batch(replica * group_world + group_rank, step, config.get("rows", 16))
            if (step, replica) == (config.get("nan_at"), 0):
                x[0, 0] = float("nan")
            dies = step == config.get("kill_at")
            armed[0] = None
            if dies and config.get("kill_in", "backward") == "backward":
                armed[0] = lambda grad: _die(config)
            elif (step, replica) == (config.get("stall_at"), config.get("stall_replica")) \
                    and not stalled:
                # A replica that is late (its compute, as a sleep inside autograd: the
                # peers wait in the collective for its bucket, which it sends late).
                stalled = True
                armed[0] = lambda grad: time.sleep(config["stall_s"])
            loss = nn.functional.mse_loss(ddp(x), y)
            after_forward = manager.is_participating()
            try:
                loss.backward()
            except RuntimeError as e:  # recorded, for the tests that expect one
                log.append((step, None, False, repr(e)))
                break
            participation.append((step, after_forward, manager.is_participating()))
            optimizer.step()
            if dies and config.get("kill_in") == "between" and manager.current_step() > step:
                _die(config)
            log.append((step, manager.num_participants(), manager.current_step() > step,
                        time.time()))
            _note_progress(config, log[-1])
        torch.save({"model": model.state_dict(), "optim": inner.state_dict(), "log": log,
                    "participation": participation, "impl": config["impl"],
                    "hook_iter": _hook_iter(ddp)}, config["out"])
    finally:
        manager.shutdown(wait=False)
        if dist.is_initialized():
            dist.destroy_process_group()


def _hook_iter(ddp: nn.Module) -> int | None:
    """PowerSGD's or ACP-SGD's iteration (their collectives follow it), else None."""
    try:
        return ddp.comm_hook_state_dict().get("iter")
    except (AttributeError, NotImplementedError, ValueError):  # torchft's DDP; no such state
        return None


def _note_progress(config: dict[str, Any], entry: tuple) -> None:
    # One line per step attempted, "step participants committed", for the harness: it
    # restarts a killed replica once a survivor has committed without it (torchft_world.py).
    with open(config["out"] + ".progress", "a") as f:
        f.write(f"{entry[0]} {entry[1]} {int(entry[2])}\n")


def _die(config: dict[str, Any]) -> None:
    # The time of death, for benchmarks/torchft_recovery.py; then as a killed process does.
    with open(config["out"] + ".killed", "w") as f:
        f.write(repr(time.time()))
    os._exit(KILLED_EXIT_CODE)


def _wait_for_all(config: dict[str, Any]) -> None:
    """Every replica's manager heartbeats before any asks for a quorum, so the Lighthouse's
    first quorum holds them all (it waits for every heartbeating replica); a restarted
    replica does not wait (its config says start_together=False)."""
    ready = config["out"] + ".ready"
    open(ready, "w").close()
    folder = os.path.dirname(ready)
    deadline = time.monotonic() + 120.0  # a hang guard: the others start in seconds
    while sum(name.endswith(".ready") for name in os.listdir(folder)) < config["start_together"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica {config['replica']}: the others did not start")
        time.sleep(0.05)
