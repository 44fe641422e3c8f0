"""A tiny Accelerate run on CPU DDP (tests/python/launch/test_stacks.py): gradient accumulation with
``accelerator.accumulate``, then steps whose last backward is synchronized by
``accelerator.trigger_sync_in_backward`` after forwards under ``accelerator.no_sync``.

    torchrun --nproc_per_node=2 -m fastddp accelerate_train.py --out OUT
"""

import argparse

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from stack_result import describe_wrapper, shutdown, write_result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    noise = 0.1 * torch.randn(64, 1, generator=generator)
    data = TensorDataset(x, x[:, :1] * 2 - x[:, 1:2] + noise)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(data, batch_size=4, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []

    for x, y in loader:  # 8 batches per rank: 4 optimizer steps
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())

    batches = list(loader)
    for (xa, ya), (xb, yb) in zip(batches[0::2], batches[1::2]):
        with accelerator.no_sync(model):
            loss_a = nn.functional.mse_loss(model(xa), ya)
            loss_b = nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss_a)  # local accumulation only
        with accelerator.trigger_sync_in_backward(model):
            accelerator.backward(loss_b)  # reduces the sum of both
        optimizer.step()
        optimizer.zero_grad()
        losses += [loss_a.item(), loss_b.item()]

    write_result(args.out, describe_wrapper(model), losses, accelerator.unwrap_model(model))


if __name__ == "__main__":
    main()
    shutdown()
