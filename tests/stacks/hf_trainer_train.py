"""A tiny Hugging Face Trainer run on CPU DDP with default arguments
(tests/python/launch/test_stacks.py).

The model is built from a small BertConfig (no download) and the data are synthetic.

    torchrun --nproc_per_node=2 -m fastddp hf_trainer_train.py --out OUT
"""

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import torch  # noqa: E402
from transformers import (BertConfig, BertForSequenceClassification, Trainer,  # noqa: E402
                          TrainingArguments)

from stack_result import describe_wrapper, shutdown, write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=2)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (64, 12), generator=generator)
    labels = (ids[:, 0] > 32).long()
    data = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": label}
            for i, label in zip(ids, labels)]
    with tempfile.TemporaryDirectory() as out_dir:
        training_args = TrainingArguments(output_dir=out_dir, max_steps=args.steps,
                                          per_device_train_batch_size=4, logging_steps=1,
                                          report_to="none", save_strategy="no", use_cpu=True,
                                          disable_tqdm=True)
        trainer = Trainer(model=model, args=training_args, train_dataset=data)
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    write_result(args.out, describe_wrapper(trainer.model_wrapped), losses, trainer.model)


if __name__ == "__main__":
    main()
    shutdown()
