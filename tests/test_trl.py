"""The Transformers callback inside TRL's GRPOTrainer (a real RL loop: generate, reward, update)."""

from __future__ import annotations

import asyncio

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from stitch_core.format import fingerprint as fpr
from stitch_core.format.views import project
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.store import list_manifests
from stitch_dev.tinymodel import build_tiny_model
from stitch_trainer import Publisher
from stitch_trainer.hf import StitchCallback
from stitch_trainer.publisher import named_tensors


def test_grpo_trainer_publishes_each_step(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model", arch="qwen2")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    pub = Publisher(str(tmp_path / "board"), "grpo", "bf16", config_dir=model_dir)
    cb = StitchCallback(pub)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=8, learning_rate=1e-4,
                      use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                      disable_tqdm=True, bf16=False)
    prompts = Dataset.from_dict({"prompt": ["the quick brown fox", "hello world", "a b c",
                                            "stitch"] * 3})
    trainer = GRPOTrainer(model=model, args=args, train_dataset=prompts, processing_class=tok,
                          reward_funcs=lambda completions, **kw: [float(len(c))
                                                                  for c in completions],
                          callbacks=[cb])
    trainer.train()
    pub.close()
    ms = asyncio.run(list_manifests(LocalBoard(tmp_path / "board"), "grpo"))
    assert [m.step for m in ms] == [1, 2, 3] and [i.version for i in cb.published] == [0, 1, 2]
    assert ms[0].kind == "snapshot" and all(m.kind == "patch" for m in ms[1:])
    final = project(named_tensors(trainer.model), "bf16")
    assert ms[-1].fingerprints == fpr.state_fingerprints(final)
    assert ms[-1].changed_elements > 0  # the policy really moved
