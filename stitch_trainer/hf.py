"""A Transformers `TrainerCallback` that publishes a version at the end of every N-th step.

    from stitch_trainer import Publisher
    from stitch_trainer.hf import StitchCallback

    pub = Publisher("file:///boards", run="grpo-qwen", view="bf16", nats="nats://host:4222",
                    config_dir=model_dir)           # config/tokenizer files for snapshots
    trainer = Trainer(..., callbacks=[StitchCallback(pub, every=1)])

With a `Publisher`, only the main process publishes (`state.is_world_process_zero`); `publish`
returns after the view is projected and the upload continues in the background. Training end
flushes the queue.

Under FSDP2 (accelerate's FSDP plugin with `fsdp_config={"version": 2}`, or `fully_shard` by
hand) the parameters are DTensors: give the callback a `stitch_trainer.fsdp.FSDPPublisher`
(created after `TrainingArguments`, which initialises the process group) and it publishes on every
rank, each rank its own shard; `start_from=` names the checkpoint training starts from (v0):

    pub = FSDPPublisher("file:///boards", run="grpo-qwen", view="bf16", config_dir=model_dir)
    trainer = Trainer(..., callbacks=[StitchCallback(pub, start_from=model_dir)])

Layouts a publisher cannot handle are refused on every rank at `on_train_begin`, before the first
step (a refusal on the main process alone would leave the other ranks hanging in a collective).
"""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from .publisher import Publisher, VersionInfo


class StitchCallback(TrainerCallback):
    """Publishes a version through `publisher` at the end of every `every`-th step."""

    def __init__(
        self,
        publisher: Publisher,
        every: int = 1,
        close_on_end: bool = False,
        start_from: str | Path | None = None,
    ):
        if start_from is not None and not getattr(publisher, "collective", False):
            raise ValueError(
                "start_from is for collective publishers (FSDPPublisher); a Publisher's first "
                "publish is a snapshot of the model itself"
            )
        self.publisher = publisher
        self.every = max(1, every)
        self.close_on_end = close_on_end
        self.start_from = start_from
        self._started = False
        self.published: list[VersionInfo] = []

    @property
    def collective(self) -> bool:
        return bool(getattr(self.publisher, "collective", False))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # every rank, with the model as the accelerator prepared it (FSDP2: sharded in place)
        if model is not None:
            _check_layout(model, self.collective)
        if self.collective and self.start_from is not None and not self._started:
            self.publisher.start_from(self.start_from, step=state.global_step)
        self._started = True
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is None or state.global_step % self.every:
            return control
        if self.collective:  # e.g. FSDPPublisher: every rank, each its own shard
            self.published.append(self.publisher.publish(state.global_step, model))
        elif state.is_world_process_zero:
            if _sharded(model):  # on_train_begin refuses this on every rank; a manual call
                raise RuntimeError(_DTENSOR_REFUSAL)
            self.published.append(self.publisher.publish(state.global_step, model))
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.collective or state.is_world_process_zero:
            if self.close_on_end:
                self.publisher.close()
            elif hasattr(self.publisher, "flush"):
                self.publisher.flush()
        return control


_DTENSOR_REFUSAL = (
    "the model's parameters are DTensors (FSDP2): a Publisher on the main process "
    "alone would gather them with collectives the other ranks never join; use "
    "stitch_trainer.fsdp.FSDPPublisher, which publishes from every rank"
)


def _check_layout(model, collective: bool) -> None:
    """Raise (on every rank alike: the layout is the same everywhere) if the publisher cannot
    publish this model without a hang or a wrong version."""
    if _fsdp1(model):
        raise RuntimeError(
            "the model is wrapped in FSDP1 (FullyShardedDataParallel): its state_dict is a "
            "collective gather and its flat parameters carry no global layout, so neither "
            "Publisher nor FSDPPublisher can publish it; use FSDP2 (fully_shard; with "
            "accelerate/Trainer: fsdp_config={'version': 2}) and FSDPPublisher"
        )
    if not collective and _sharded(model):
        raise RuntimeError(_DTENSOR_REFUSAL)


def _sharded(model) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _fsdp1(model) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch without distributed
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
