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
        self.schedule = False  # --schedule

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
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if not self.schedule:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
            "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--manual", action="store_true")
    parser.add_argument("--find-unused", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--strategy", help="a registered strategy name (default: ddp)")
    parser.add_argument("--torch-hook", help="a --hook spelling: torch's closest hook, "
                        "registered on torch's wrapper (Lightning's ddp does so on CUDA only)")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="FastDDPStrategy(shard_optimizer=True) instead of a name")
    parser.add_argument("--schedule", action="store_true", help="a StepLR stepped per step")
    parser.add_argument("--clip", type=float, help="the Trainer's gradient_clip_val")
    parser.add_argument("--checkpoint", action="store_true",
                        help="trainer.save_checkpoint after fit; its optimizer state recorded")
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
    model.schedule = args.schedule
    if args.shard_optimizer:
        from fastddp.integrations.lightning import FastDDPStrategy

        strategy = FastDDPStrategy(shard_optimizer=True)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=root,
                            gradient_clip_val=args.clip)
        trainer.fit(model, DataLoader(data, batch_size=8, shuffle=False))
        if args.shard_optimizer:  # refused, naming why: no rank holds a whole gradient
            try:
                trainer.strategy.precision_plugin.clip_grad_by_value(trainer.optimizers[0], 0.1)
            except NotImplementedError as e:
                model.wrapper["refused"] = str(e)
        if args.checkpoint:  # Lightning's own save: every rank calls it, rank 0 writes
            path = f"{root}/last.ckpt"
            trainer.save_checkpoint(path)
            trainer.strategy.barrier()
        if args.checkpoint and trainer.global_rank == 0:  # each rank has a root of its own
            saved = torch.load(path, weights_only=False)["optimizer_states"][0]
            model.wrapper["saved_optimizer"] = {
                "momentum": [saved["state"][i]["momentum_buffer"].flatten().tolist()
                             for i in sorted(saved["state"])],
                "lr": [g["lr"] for g in saved["param_groups"]]}
        model.wrapper["optimizer"] = type(trainer.optimizers[0]).__qualname__
        model.wrapper["lr"] = trainer.optimizers[0].param_groups[0]["lr"]
    write_result(args.out, model.wrapper, model.losses, model, rank=trainer.global_rank)


if __name__ == "__main__":
    main()
    shutdown()
