#!/usr/bin/env python3
"""Transformers `Trainer` with the Stitch callback on a tiny Llama built locally (CPU, no hub).

    python examples/hf_trainer.py [--board /tmp/stitch-example-board]

The same callback works with TRL trainers (e.g. GRPOTrainer, tested in tests/test_trl.py).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from stitch_trainer import Publisher
from stitch_trainer.hf import StitchCallback


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 32, vocab: int = 512):
        self.x = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--board", default="/tmp/stitch-example-board")
    a = ap.parse_args()
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    work = tempfile.mkdtemp()
    config.save_pretrained(work)  # config.json travels with snapshots
    pub = Publisher(a.board, run="hf-trainer", view="bf16", snapshot_every=5, config_dir=work)
    args = TrainingArguments(output_dir=work, max_steps=6, per_device_train_batch_size=4,
                             learning_rate=1e-5, use_cpu=True, report_to=[], save_strategy="no")
    Trainer(model=model, args=args, train_dataset=Tokens(),
            callbacks=[StitchCallback(pub, close_on_end=True)]).train()
    print(f"published {a.board} run hf-trainer: `stitch versions {a.board} --run hf-trainer`")


if __name__ == "__main__":
    main()
