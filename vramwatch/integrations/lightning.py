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
exporter it started.

The base class is ``lightning.pytorch.Callback`` when ``lightning`` is installed (or is the one the
script imported), else ``pytorch_lightning.Callback``. Keyword arguments are vramwatch settings,
checked here (``ConfigError``). It only observes; nothing it does raises into training.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import vramwatch
from vramwatch.integrations import framework_settings, start_for_framework


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


def _attr(obj: Any, name: str) -> int | None:
    try:
        v = getattr(obj, name)
        return int(v) if v is not None else None
    except Exception:  # noqa: BLE001
        return None


class VramwatchCallback(_callback_base()):  # type: ignore[misc]
    def __init__(self, stop_on_end: bool = True, **settings: Any) -> None:
        super().__init__()
        framework_settings(settings, None, None, None)  # raises ConfigError now, not mid-run
        self.settings = settings
        self.stop_on_end = stop_on_end
        self.handle: Any = None
        self._owned = False
        self._last_global_step = -1

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

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.handle is None:
            return
        try:  # the optimizers exist from here on (configure_optimizers has run)
            optimizers = trainer.optimizers
            optimizer = optimizers[0] if optimizers else None
        except Exception:  # noqa: BLE001
            optimizer = None
        vramwatch.watch(pl_module, optimizer)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
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
        vramwatch.step(loss=loss, grad_norm=grad_norm)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if self._owned and self.stop_on_end:
            self._owned = False
            if vramwatch.current() is self.handle:
                vramwatch.stop()
        self.handle = None
