"""A tiny Accelerate run on CPU DDP (tests/python/launch/test_stacks.py): gradient accumulation with
``accelerator.accumulate``, then steps whose last backward is synchronized by
``accelerator.trigger_sync_in_backward`` after forwards under ``accelerator.no_sync``.

    torchrun --nproc_per_node=2 -m fastddp accelerate_train.py --out OUT

With ``--fastddp``, fastddp.integrations.accelerate's Accelerator instead of Accelerate's, for
``accelerate launch`` (tests/python/launch/test_accelerate_integration.py); ``--comm-hook``,
``--comm-wrapper`` and ``--comm-state`` (JSON) fill Accelerate's DistributedDataParallelKwargs:

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 accelerate_train.py \
        --out OUT --fastddp --comm-hook bf16
"""

import argparse
import json

import torch
from accelerate import Accelerator
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from stack_result import describe_wrapper, shutdown, write_result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--fastddp", action="store_true",
                        help="fastddp.integrations.accelerate.Accelerator")
    parser.add_argument("--comm-hook", help="DistributedDataParallelKwargs.comm_hook")
    parser.add_argument("--comm-wrapper", help="DistributedDataParallelKwargs.comm_wrapper")
    parser.add_argument("--comm-state", help="comm_state_option, as JSON")
    parser.add_argument("--fastddp-hook", help="FastDDPKwargs(hook=...), a --hook spelling")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="with --fastddp: Accelerator(shard_optimizer=True)")
    parser.add_argument("--schedule", action="store_true",
                        help="a StepLR built on the optimizer before prepare()")
    parser.add_argument("--clip", type=float, help="accelerator.clip_grad_norm_ before a step")
    args = parser.parse_args()

    # Enum members: Accelerate looks its hooks up by member, and a plain string finds none.
    options = {key: value for key, value in (
        ("comm_hook", args.comm_hook and DDPCommunicationHookType(args.comm_hook)),
        ("comm_wrapper", args.comm_wrapper and DDPCommunicationHookType(args.comm_wrapper)),
        ("comm_state_option", json.loads(args.comm_state) if args.comm_state else None))
        if value is not None}
    handlers = [DistributedDataParallelKwargs(**options)] if options else None
    if args.fastddp:
        from fastddp.integrations.accelerate import Accelerator as FastDDPAccelerator
        from fastddp.integrations.accelerate import FastDDPKwargs

        if args.fastddp_hook:
            handlers = [FastDDPKwargs(hook=args.fastddp_hook, **options)]
        accelerator = FastDDPAccelerator(cpu=True, gradient_accumulation_steps=2,
                                         kwargs_handlers=handlers,
                                         shard_optimizer=args.shard_optimizer)
    else:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2,
                                  kwargs_handlers=handlers)

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    noise = 0.1 * torch.randn(64, 1, generator=generator)
    data = TensorDataset(x, x[:, :1] * 2 - x[:, 1:2] + noise)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(data, batch_size=4, shuffle=False)
    prepared = [model, optimizer, loader]
    if args.schedule:  # built on the torch optimizer, before prepare(), as scripts do
        prepared.append(torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5))
    model, optimizer, loader, *scheduler = accelerator.prepare(*prepared)
    losses = []

    def step() -> None:
        if args.clip is not None and accelerator.sync_gradients:  # as Accelerate documents it
            accelerator.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        for s in scheduler:
            s.step()
        optimizer.zero_grad()

    for x, y in loader:  # 8 batches per rank: 4 optimizer steps
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            step()
        losses.append(loss.item())

    batches = list(loader)
    for (xa, ya), (xb, yb) in zip(batches[0::2], batches[1::2]):
        with accelerator.no_sync(model):
            loss_a = nn.functional.mse_loss(model(xa), ya)
            loss_b = nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss_a)  # local accumulation only
        with accelerator.trigger_sync_in_backward(model):
            accelerator.backward(loss_b)  # reduces the sum of both
        step()
        losses += [loss_a.item(), loss_b.item()]

    wrapper = describe_wrapper(model)
    # The hooks registered: torch's functions (torch DDP), and the C++ hook fastddp runs.
    wrapper["comm_hooks"] = [getattr(h, "__name__", type(h).__name__)
                             for h, _ in getattr(model, "_comm_hooks", [])]
    native = getattr(model, "_native_hook", None)
    wrapper["native_hook"] = native.name if native is not None else None
    if args.shard_optimizer:  # what a sharded optimizer refuses, each naming the cause
        wrapper["refused"] = []
        for refused in (lambda: accelerator.clip_grad_value_(model.parameters(), 0.1),
                        lambda: accelerator.clip_grad_norm_(list(model.parameters())[:1], 1.0),
                        lambda: accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))):
            try:
                refused()
            except (NotImplementedError, RuntimeError) as e:
                wrapper["refused"].append(f"{type(e).__name__}: {e}")
    wrapper["optimizer"] = type(getattr(optimizer, "optimizer", optimizer)).__qualname__
    wrapper["lr"] = optimizer.param_groups[0]["lr"]
    write_result(args.out, wrapper, losses, accelerator.unwrap_model(model))


if __name__ == "__main__":
    main()
    shutdown()
