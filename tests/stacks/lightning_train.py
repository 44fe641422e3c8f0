"""A tiny Lightning run on CPU DDP, automatic or manual optimization
(tests/python/launch/test_stacks.py).

    torchrun --nproc_per_node=2 -m fastddp lightning_train.py --out OUT [--manual]
             [--find-unused]

and, with Lightning's own process launcher (no torchrun), a strategy by name
(tests/python/launch/test_lightning_strategy.py):

    python lightning_train.py --out OUT --strategy fastddp_bf16
    python lightning_train.py --out OUT --strategy ddp --torch-hook bf16   # its reference
"""

import argparse
import tempfile

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from stack_result import describe_wrapper, shutdown, write_result


class Regressor(L.LightningModule):
    def __init__(self, manual: bool, unused_layer: bool):
        super().__init__()
        self.automatic_optimization = not manual
        # BatchNorm: its buffers show whether DDP broadcast them when torch does.
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
        self.unused = nn.Linear(4, 4) if unused_layer else None
        self.losses: list[float] = []
        self.wrapper: dict = {}
        self.torch_hook: str | None = None  # --torch-hook

    def on_train_start(self) -> None:
        if self.torch_hook:
            # Before the first backward, on torch's wrapper: the reference for a fastddp
            # strategy with a hook (the launcher's FASTDDP_DISABLE=1 comparison does the same).
            from fastddp.launch.hook_spec import parse_hook_spec, torch_hook

            self.trainer.strategy.model.register_comm_hook(
                *torch_hook(parse_hook_spec(self.torch_hook)))
        self.wrapper = describe_wrapper(self.trainer.strategy.model)
        self.wrapper["comm_hooks"] = [getattr(h, "__name__", type(h).__name__)
                                      for h, _ in getattr(self.trainer.strategy.model,
                                                          "_comm_hooks", [])]

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--manual", action="store_true")
    parser.add_argument("--find-unused", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--strategy", help="a registered strategy name (default: ddp)")
    parser.add_argument("--torch-hook", help="a --hook spelling: torch's closest hook, "
                        "registered on torch's wrapper (Lightning's ddp does so on CUDA only)")
    args = parser.parse_args()
    if args.strategy and args.strategy.startswith("fastddp"):
        import fastddp.integrations.lightning  # noqa: F401  (registers the fastddp strategies)

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=generator)
    noise = 0.1 * torch.randn(96, 1, generator=generator)
    data = TensorDataset(x, x[:, :1] * 2 - x[:, 1:2] + noise)
    L.seed_everything(0, verbose=False)
    model = Regressor(args.manual, unused_layer=args.find_unused)
    strategy = args.strategy or ("ddp_find_unused_parameters_true" if args.find_unused
                                 else "ddp")
    if args.torch_hook:
        model.torch_hook = args.torch_hook
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=root)
        trainer.fit(model, DataLoader(data, batch_size=8, shuffle=False))
    write_result(args.out, model.wrapper, model.losses, model, rank=trainer.global_rank)


if __name__ == "__main__":
    main()
    shutdown()
