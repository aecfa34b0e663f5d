"""The synthetic trainer of the engine suites and the engine fault rig: a real HF model trained by
transformers with AdamW on random tokens, publishing every step."""

from __future__ import annotations

import threading
from pathlib import Path

import torch


class AdamWTrainer:
    """A real HF model trained by transformers with AdamW on random tokens, publishing every
    step (v0 is the untrained model)."""

    def __init__(self, model_dir, board, nats: str, run: str, lr: float = 2e-3,
                 signing_key: Path | None = None):
        from transformers import AutoModelForCausalLM

        from stitch_trainer import Publisher

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.g = torch.Generator().manual_seed(0)
        self.pub = Publisher(str(board), run, "bf16", nats=nats, config_dir=model_dir,
                             signing_key=signing_key)
        self.step = 0
        self.lock = threading.Lock()

    def view(self) -> dict[str, torch.Tensor]:
        """The served bf16 view of the current weights (what the Publisher ships)."""
        return {k: v.detach().to(torch.bfloat16).clone()
                for k, v in self.model.state_dict().items() if k != "lm_head.weight"
                or not self.model.config.tie_word_embeddings}

    def train(self) -> None:
        """One AdamW step on random tokens (`publish(train=False)` then ships it)."""
        with self.lock:
            x = torch.randint(0, self.model.config.vocab_size, (4, 16), generator=self.g)
            loss = self.model(input_ids=x, labels=x).loss
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self._trained = True

    def publish(self, train: bool = True) -> int:
        """Train one step (none for v0; none when `train()` already ran), publish, wait until
        it is on the board. A test that needs the publish itself to be quick (an apply landing
        while a request streams) trains first."""
        if train and self.step and not getattr(self, "_trained", False):
            self.train()
        with self.lock:
            v = self.pub.publish(self.step, self.model).result().version
            self.step += 1
            self._trained = False
            return v
