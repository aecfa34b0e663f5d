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
        if model is None or not state.is_world_process_zero or state.global_step % self.every:
            return control
        self.published.append(self.publisher.publish(state.global_step, model))
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.publisher.close() if self.close_on_end else self.publisher.flush()
        return control
