"""Lightning callback (``lightning`` or the older ``pytorch_lightning`` package).

    from vramwatch.integrations.lightning import VramwatchCallback
    trainer = lightning.pytorch.Trainer(..., callbacks=[VramwatchCallback()])

At ``setup`` for fitting it starts the exporter (unless the script already did), labelled with the
trainer's global rank, local rank and world size. The heartbeat beats once per optimiser step
(``trainer.global_step`` advancing, so gradient accumulation counts one step); the loss is the
``loss`` of ``training_step``'s output, passed as the tensor it is and converted on the sampler
thread; a grad norm is taken from the logged metrics when the module logs one (``grad_norm``, or
``grad_2.0_norm_total`` from ``lightning.pytorch.utilities.grad_norm``). At ``on_train_start`` the
module and its (first) optimizer are watched (``vramwatch.watch``: memory by role). ``teardown`` stops the
exporter it started. Validation (and its sanity check) is a declared ``eval`` phase, a checkpoint's save
and load ``save`` / ``load`` phases (from ``on_save_checkpoint`` / ``on_load_checkpoint`` to the loop's
next hook: Lightning calls none after the write); the time from one batch's end to the next one's start,
outside those, is the data wait.

Tokens and samples, per rank, summed over the micro-batches of each optimiser step and passed to
``vramwatch.step(tokens=..., samples=...)``. Lightning does not count them, so they come from the
batch: ``batch_size_fn(batch)`` (samples) and ``length_fn(batch)`` (tokens), the hooks of Lightning's
own ``ThroughputMonitor``, when given; otherwise a mapping batch holding ``input_ids`` (or
``attention_mask``) gives ``numel()`` tokens (padding included, as the Hugging Face Trainer's "all")
and its first dimension as samples, and any other batch its first tensor's first dimension as samples
and no tokens. Only tensor shapes are read: counting non-padding tokens would sum a mask on the GPU
and wait for it, so pass ``length_fn`` for that (on a CPU mask, or a count the data loader carries).

The base class is ``lightning.pytorch.Callback`` when ``lightning`` is installed (or is the one the
script imported), else ``pytorch_lightning.Callback``. Keyword arguments are vramwatch settings,
checked here (``ConfigError``). It only observes; nothing it does raises into training.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any

import vramwatch
from vramwatch.integrations import framework_settings, start_for_framework, stop_if_started
from vramwatch.integrations import int_attr as _attr
from vramwatch.integrations.phases import CallbackPhases


def _callback_base() -> type:
    if "pytorch_lightning" in sys.modules and "lightning" not in sys.modules:
        from pytorch_lightning import Callback  # the script uses the old name

        return Callback
    try:
        from lightning.pytorch import Callback as LightningCallback
    except ImportError:
        from pytorch_lightning import Callback as LegacyCallback

        return LegacyCallback
    return LightningCallback


__all__ = ["VramwatchCallback"]

log = logging.getLogger("vramwatch")

_GRAD_NORM_KEYS = ("grad_norm", "grad_2.0_norm_total", "train/grad_norm")


def _first_dim(x: Any) -> int | None:
    shape = getattr(x, "shape", None)
    try:
        return int(shape[0]) if shape is not None and len(shape) else None
    except Exception:  # noqa: BLE001
        return None


def _first_tensor(batch: Any) -> Any:
    if hasattr(batch, "shape"):
        return batch
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for x in items:
        if hasattr(x, "shape"):
            return x
    return None


def batch_counts(batch: Any) -> tuple[int | None, int | None]:
    """(tokens, samples) a batch holds, from its tensors' shapes only (never a device sync)."""
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        if ids is None:
            ids = batch.get("attention_mask")
        if ids is not None and hasattr(ids, "numel"):
            return int(ids.numel()), _first_dim(ids)
    return None, _first_dim(_first_tensor(batch))


def _count(fn: Callable[[Any], Any], batch: Any) -> int | float | None:
    v = fn(batch)
    if hasattr(v, "item") and getattr(v, "device", None) is not None and str(v.device) != "cpu":
        return None  # a device tensor: converting it would wait for the GPU
    if hasattr(v, "item"):
        v = v.item()
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else None


class VramwatchCallback(_callback_base()):  # type: ignore[misc]
    def __init__(
        self,
        stop_on_end: bool = True,
        batch_size_fn: Callable[[Any], Any] | None = None,
        length_fn: Callable[[Any], Any] | None = None,
        **settings: Any,
    ) -> None:
        super().__init__()
        framework_settings(settings, None, None, None)  # raises ConfigError now, not mid-run
        self.settings = settings
        self.stop_on_end = stop_on_end
        self.batch_size_fn = batch_size_fn
        self.length_fn = length_fn
        self.handle: Any = None
        self._owned = False
        self._last_global_step = -1
        self._tokens: int | float | None = None  # of the micro-batches since the last optimiser step
        self._samples: int | float | None = None
        self.phases = CallbackPhases()

    def _add_batch(self, batch: Any) -> None:
        tokens: int | float | None
        samples: int | float | None
        try:
            tokens, samples = batch_counts(batch)
            if self.length_fn is not None:
                tokens = _count(self.length_fn, batch)
            if self.batch_size_fn is not None:
                samples = _count(self.batch_size_fn, batch)
        except Exception:  # noqa: BLE001 - a hook that fails counts nothing
            tokens = samples = None
        if tokens is not None:
            self._tokens = tokens + (self._tokens or 0)
        if samples is not None:
            self._samples = samples + (self._samples or 0)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or (self._owned and vramwatch.current() is self.handle):
            return
        try:
            self.handle, self._owned = start_for_framework(
                self.settings, _attr(trainer, "global_rank"), _attr(trainer, "local_rank"), _attr(trainer, "world_size")
            )
        except Exception as e:  # noqa: BLE001
            log.warning("vramwatch: callback could not start: %r", e)
        self._last_global_step = _attr(trainer, "global_step") or 0

    def _watch(self, trainer: Any, pl_module: Any) -> None:
        if self.handle is None:
            return
        try:  # the optimizers exist from here on (configure_optimizers has run)
            optimizers = trainer.optimizers
            optimizer = optimizers[0] if optimizers else None
        except Exception:  # noqa: BLE001
            optimizer = None
        vramwatch.watch(pl_module, optimizer)

    # --- declared phases: validation (and its sanity check), checkpoint save and load ---
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.phases.open("eval")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.phases.close("eval")

    def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
        self.phases.open("eval")

    def on_sanity_check_end(self, trainer: Any, pl_module: Any) -> None:
        self.phases.close("eval")

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        # called as the checkpoint is assembled, before it is written: no hook follows the write, so the
        # phase closes at the next hook of the loop
        self.phases.open("save")

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        self.phases.open("load")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.phases.close("load")
        self._watch(trainer, pl_module)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.phases.close("save")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.phases.close("save", "load")
        self.phases.step_began()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        try:
            self._batch_end(trainer, outputs, batch)
        finally:
            self.phases.step_ended()

    def _batch_end(self, trainer: Any, outputs: Any, batch: Any) -> None:
        self._add_batch(batch)
        try:
            gs = trainer.global_step
            if gs == self._last_global_step:
                return  # an accumulation micro-batch: the optimiser has not stepped
            self._last_global_step = gs
            loss: Any = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if hasattr(loss, "detach"):
                loss = loss.detach()  # keep no autograd graph alive; no copy, no sync
            grad_norm = None
            metrics = trainer.callback_metrics
            for key in _GRAD_NORM_KEYS:
                if key in metrics:
                    grad_norm = metrics[key]
                    break
        except Exception:  # noqa: BLE001
            loss = grad_norm = None
        tokens, samples, self._tokens, self._samples = self._tokens, self._samples, None, None
        vramwatch.step(loss=loss, grad_norm=grad_norm, tokens=tokens, samples=samples)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.phases.close()
        if stage == "fit":
            stop_if_started(self.handle, self._owned, self.stop_on_end)
            self.handle, self._owned = None, False
