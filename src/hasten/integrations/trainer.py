"""hasten for people who keep their own Hugging Face Trainer (or PEFT, or TRL) script.

    handle, collator, callback = prepare_trainer_model(model, max_tokens=16384)
    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collator, callbacks=[callback])

`HastenCallback` puts hasten's counters (fallbacks, packing efficiency, MoE expert load) into the
Trainer's logs; `prepare_trainer_model` patches the model (a transformers model or a PEFT
`PeftModel` around one) and builds the packing collator and the callback in one call.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel, TrainerCallback

from hasten.config import Config
from hasten.integrations.transformers import AccelerationHandle, accelerate
from hasten.observability import fallback_counts, logger
from hasten.packing.collator import PackingCollator

PREFIX = "hasten/"


class HastenCallback(TrainerCallback):
    """Adds hasten's metrics to every Trainer log:

      hasten/fallbacks             total uses of slower paths (hasten.observability.fallback_counts())
      hasten/fallback/<key>        one count per fallback kind, e.g. hasten/fallback/attention_per_sequence
      hasten/packing_efficiency    real tokens / packed slots of the collator so far (when a collator is given)
      hasten/moe_<field>           expert-load summary since the last log (MoE models only)

    and logs `handle.report()` (what hasten patched, what it did not) once, at the start of
    training, through the `hasten` logger at INFO level.

    The Trainer stores a copy of each log in `trainer.state.log_history` and then calls the
    callbacks in order; this callback adds its fields to that stored copy too, so they are in the
    log history whatever the order. Reporting integrations (`report_to`: TensorBoard, W&B, ...)
    are created before the callbacks passed to `Trainer(callbacks=...)` and would log without the
    hasten fields; call `callback.attach(trainer)` instead to put this callback first.
    """

    def __init__(self, handle: AccelerationHandle, collator: PackingCollator | None = None) -> None:
        self.handle = handle
        self.collator = collator
        self._reported = False

    def metrics(self) -> dict[str, float]:
        """The hasten fields for one log (reads and resets the MoE load accumulated since the last one)."""
        counts = fallback_counts()
        out: dict[str, float] = {PREFIX + "fallbacks": sum(counts.values())}
        out.update({f"{PREFIX}fallback/{key}": value for key, value in sorted(counts.items())})
        if self.collator is not None:
            out[PREFIX + "packing_efficiency"] = self.collator.stats.efficiency
        if self.handle.moe_stats is not None:
            summary = self.handle.moe_stats.summary()
            if summary:
                out.update({f"{PREFIX}moe_{key}": value for key, value in summary.items()})
        return out

    def attach(self, trainer: Any) -> HastenCallback:
        """Make this the first callback of `trainer`, so every reporting integration sees the hasten fields."""
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        if not self._reported and state.is_world_process_zero:
            logger.info(self.handle.report())
            self._reported = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        history = state.log_history
        # Trainer.log appends {**logs, "step": global_step} to the history before calling the callbacks.
        entry = history[-1] if history else None
        same = entry is not None and entry.get("step") == state.global_step and \
            {k for k in entry if k != "step"} == {k for k in logs if k != "step"}
        metrics = self.metrics()
        logs.update(metrics)
        if same:
            entry.update(metrics)


def _unwrap_peft(model: Any) -> PreTrainedModel:
    """The transformers model inside a PEFT PeftModel (or the model itself)."""
    if isinstance(model, PreTrainedModel) or not callable(getattr(model, "get_base_model", None)):
        return model  # accelerate() raises a clear TypeError for anything else
    peft_config = getattr(model, "active_peft_config", None)
    if getattr(peft_config, "is_prompt_learning", False):
        raise ValueError(f"hasten: the PEFT adapter {type(peft_config).__name__} is prompt learning (virtual tokens "
                         "prepended to every row), which does not respect packed sample boundaries; use an adapter "
                         "that changes weights (LoRA, DoRA, IA3, ...) with packed batches")
    return model.get_base_model()


def prepare_trainer_model(model: Any, config: Config | None = None, *, max_tokens: int,
                          pad_token_id: int = 0) -> tuple[AccelerationHandle, PackingCollator, HastenCallback]:
    """Patch `model` for packed training and build the collator and callback for the HF Trainer.

    `model` is a transformers `PreTrainedModel` or a PEFT `PeftModel` (e.g. from
    `peft.get_peft_model`): hasten patches the transformers model inside it
    (`model.get_base_model()`), and the PeftModel's forward reaches that patched model, so keep
    training the PeftModel. Calling this before `get_peft_model` works as well.

    Returns `(handle, collator, callback)`:
      * `handle`: `hasten.accelerate(...)`'s handle (`handle.report()`, `handle.undo()`);
      * `collator`: `PackingCollator(max_tokens, pad_token_id=...)`; pass it as the Trainer's
        `data_collator`. Each sample is a dict with `input_ids` and optionally `labels`.
      * `callback`: `HastenCallback`; pass it in `callbacks=[...]`, or `callback.attach(trainer)`
        so that `report_to` integrations see its fields too.

    Notes for the Trainer's arguments:
      * `per_device_train_batch_size` is the number of samples per packed batch: the Trainer
        hands that many samples to the collator, which packs them into rows of at most
        `max_tokens` tokens (one row when they fit, else several, the short ones ending in a
        padding segment without loss; `collator.stats.efficiency` shows how much is padding).
        Pick it so that batch_size x mean sample length is close to `max_tokens`.
      * `remove_unused_columns`: the collator reads only `input_ids` and `labels`, which are
        arguments of the model's forward, so the Trainer's default (True) keeps them and drops
        other columns such as `text`. Set it to False only when the dataset has extra columns
        that a collator of yours needs before packing (say, a `completion_mask` you turn into
        `labels`): with True the Trainer removes every column that is not a forward argument
        before the collator sees the batch.
      * Labels need no shifting: give them aligned with `input_ids` (-100 = no loss); the
        collator masks the first token of every sample so no target crosses a boundary.
    """
    handle = accelerate(_unwrap_peft(model), config)
    overlong = config.training.overlong if config is not None else "truncate"
    collator = PackingCollator(max_tokens, overlong=overlong, pad_token_id=pad_token_id)
    return handle, collator, HastenCallback(handle, collator)
