"""A Transformers `TrainerCallback` that publishes a version at the end of every N-th step.

    from stitch_trainer import Publisher
    from stitch_trainer.hf import StitchCallback

    pub = Publisher("file:///boards", run="grpo-qwen", view="bf16", nats="nats://host:4222",
                    config_dir=model_dir)           # config/tokenizer files for snapshots
    trainer = Trainer(..., callbacks=[StitchCallback(pub, every=1)])

Only the main process publishes (`state.is_world_process_zero`); `publish` returns after the view
is projected and the upload continues in the background. Training end flushes the queue.
"""

from __future__ import annotations

from transformers import TrainerCallback

from .publisher import Publisher, VersionInfo


class StitchCallback(TrainerCallback):
    def __init__(self, publisher: Publisher, every: int = 1, close_on_end: bool = False):
        self.publisher = publisher
        self.every = max(1, every)
        self.close_on_end = close_on_end
        self.published: list[VersionInfo] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is None or state.global_step % self.every:
            return control
        if getattr(self.publisher, "collective", False):  # e.g. FSDPPublisher: every rank
            self.published.append(self.publisher.publish(state.global_step, model))
        elif state.is_world_process_zero:
            if _sharded(model):
                raise RuntimeError(
                    "the model's parameters are DTensors (FSDP2): a Publisher on the main process "
                    "alone would gather them with collectives the other ranks never join; use "
                    "stitch_trainer.fsdp.FSDPPublisher, which publishes from every rank")
            self.published.append(self.publisher.publish(state.global_step, model))
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if getattr(self.publisher, "collective", False) or state.is_world_process_zero:
            if self.close_on_end:
                self.publisher.close()
            elif hasattr(self.publisher, "flush"):
                self.publisher.flush()
        return control


def _sharded(model) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())
