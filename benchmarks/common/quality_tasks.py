"""The two real-data tasks of benchmarks/quality.py: what a rank trains and how it is scored.

``digits``: scikit-learn's handwritten digits (1,797 8x8 images that ship with the package):
a small CNN, held-out accuracy (higher is better). ``text``: the source of Python's own
standard library (its ``.py`` files, read in sorted order), a small character-level
transformer, held-out bits per character (lower is better). Each rank draws its own batches
from the training split with its own generator; the held-out split is the same everywhere.
"""

import math
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed
import torch.nn.functional as F
from torch import nn

FINAL_LR = 0.1  # every run's learning rate decays along a cosine to this share of its peak
TEXT_BYTES = 600_000  # of the standard library's source: enough for a few hundred steps
CONTEXT = 64


@dataclass
class Task:
    name: str
    metric: str              # "accuracy" (higher is better) or "bits/char" (lower)
    higher_is_better: bool
    make_model: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (rank, step)
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[nn.Module], float]
    optimizer: Callable[[object], torch.optim.Optimizer]  # (parameters) -> optimizer


def _digits() -> Task:
    from sklearn.datasets import load_digits  # the data ships with scikit-learn

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = order[:1500], order[1500:]

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(64 * 16, 128), nn.ReLU(),
                             nn.Linear(128, 10))

    def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + rank)
        idx = train[torch.randint(len(train), (32,), generator=g)]
        return x[idx], y[idx]

    def evaluate(model: nn.Module) -> float:
        with torch.no_grad():
            return float((model(x[test]).argmax(1) == y[test]).float().mean())

    return Task("digits", "accuracy", True, make, batch,
                lambda m, a, b: F.cross_entropy(m(a), b), evaluate,
                lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9))


class CharModel(nn.Module):
    def __init__(self, vocab: int = 128, d: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(CONTEXT, d))
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.body(h, mask=self.mask, is_causal=True))


def stdlib_text() -> torch.Tensor:
    """The first TEXT_BYTES of the standard library's .py files, ASCII (others -> 0)."""
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and total < TEXT_BYTES:
            with open(os.path.join(root, name), "rb") as f:
                data = f.read()
            chunks.append(data)
            total += len(data)
    raw = b"".join(chunks)[:TEXT_BYTES]
    return torch.tensor([c if c < 128 else 0 for c in raw], dtype=torch.long)


def _text() -> Task:
    tokens = stdlib_text()
    split = int(len(tokens) * 0.9)
    train, test = tokens[:split], tokens[split:]
    g = torch.Generator().manual_seed(0)
    # 256 windows (16K characters): the score's noise well under the benchmark's tolerance.
    starts = torch.randint(len(test) - CONTEXT - 1, (256,), generator=g)
    test_x = torch.stack([test[s:s + CONTEXT] for s in starts])
    test_y = torch.stack([test[s + 1:s + CONTEXT + 1] for s in starts])

    def make() -> nn.Module:
        torch.manual_seed(0)
        return CharModel()

    def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 * step + rank)
        s = torch.randint(len(train) - CONTEXT - 1, (16,), generator=gen)
        return (torch.stack([train[i:i + CONTEXT] for i in s]),
                torch.stack([train[i + 1:i + CONTEXT + 1] for i in s]))

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    def evaluate(model: nn.Module) -> float:
        with torch.no_grad():
            return float(loss(model, test_x, test_y)) / math.log(2)

    return Task("text", "bits/char", False, make, batch, loss, evaluate,
                lambda params: torch.optim.AdamW(params, lr=3e-3))


def task(name: str) -> Task:
    return {"digits": _digits, "text": _text}[name]()


def train(t: Task, run, steps: int, eval_every: int) -> dict:
    """Trains ``run`` (a periodic_sync.Setup: the module the loss runs, the one scored, the
    optimizer, what follows each step) for ``steps`` steps on this rank's batches, the
    learning rate along a cosine to FINAL_LR of its peak. Returns rank 0's scores every
    ``eval_every`` steps (and at the last) and the bytes one rank sent per step."""
    decay = torch.optim.lr_scheduler.LambdaLR(
        run.opt, lambda s: FINAL_LR + (1 - FINAL_LR) * (1 + math.cos(math.pi * s / steps)) / 2)
    rank, scores = torch.distributed.get_rank(), {}
    for step in range(1, steps + 1):
        x, y = t.batch(rank, step)
        run.opt.zero_grad(set_to_none=True)
        t.loss(run.model, x, y).backward()
        run.opt.step()
        run.after_step()
        decay.step()
        if step % eval_every == 0 or step == steps:
            scores[step] = t.evaluate(run.module)
    sent = run.sent(steps)
    run.close()
    return {"scores": scores, "sent": sent}
