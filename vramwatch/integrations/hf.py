"""Hugging Face ``Trainer`` callback.

    from vramwatch.integrations.hf import VramwatchCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[VramwatchCallback()])

At ``on_train_begin`` it starts the exporter (unless the script already did), labelled with the
Trainer's process index, local process index and world size; ``on_step_end`` (once per optimiser
step, after gradient accumulation) is the heartbeat; the Trainer's model and optimizer are watched
(``vramwatch.watch``: memory by role); the loss and grad norm the Trainer logs
(every ``logging_steps``) become ``vramwatch_training_loss`` / ``_grad_norm`` (NaN / Inf counted in
``vramwatch_training_nonfinite_total``). Evaluation and checkpoint saves are declared phases
(``vramwatch.phase``): the Trainer has no hook before either, so the phase opens at the step or epoch end
whose flags (``should_evaluate``, ``should_save``) call for it, or at the first prediction step of an
evaluation the script runs itself, and closes at ``on_evaluate`` / ``on_predict`` / ``on_save``. The time
from one step's end to the next one's begin, outside those, is the data wait. At ``on_train_end``
it stops the exporter it started, so a finished run leaves no stale heartbeat behind.

Tokens: with ``TrainingArguments(include_num_input_tokens_seen=True)`` (or ``"all"`` /
``"non_padding"``) the Trainer counts the input tokens of every micro-batch into
``state.num_input_tokens_seen``, summed over all processes (it gathers them). Each optimiser step
passes this rank's share of the step's increase, ``tokens=delta / world_size``, to ``vramwatch.step``:
exact on one process, the job's total exact on many (the dashboards sum the ranks), an even split
per rank. Without the option the Trainer counts nothing and neither does the callback (no counter).
Samples: the Trainer does not count them; pass them yourself with ``vramwatch.step`` in your own loop.

It only observes: it returns no control changes, and nothing it does raises into training.
Keyword arguments are vramwatch settings, checked here (``ConfigError``) before training starts.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

import vramwatch
from vramwatch.integrations import framework_settings, start_for_framework, stop_if_started
from vramwatch.integrations import int_attr as _attr
from vramwatch.integrations.phases import CallbackPhases

__all__ = ["VramwatchCallback"]

log = logging.getLogger("vramwatch")


def _tokens_seen(args: Any, state: Any) -> int | None:
    """The Trainer's input-token count so far, or None when it does not count them (or cannot say: a
    property that needs a distributed state the process lacks raises, and a callback must not)."""
    try:
        mode = getattr(args, "include_num_input_tokens_seen", "no")
        seen = getattr(state, "num_input_tokens_seen", None)
    except Exception:  # noqa: BLE001
        return None
    if mode in ("no", False, None):
        return None
    if isinstance(seen, bool) or not isinstance(seen, (int, float)):
        return None
    return int(seen)


class VramwatchCallback(TrainerCallback):
    def __init__(self, stop_on_end: bool = True, **settings: Any) -> None:
        framework_settings(settings, None, None, None)  # raises ConfigError now, not mid-run
        self.settings = settings
        self.stop_on_end = stop_on_end
        self.handle: Any = None
        self._owned = False
        self._tokens_seen: int | None = None  # state.num_input_tokens_seen at the last step (None: not counted)
        self.phases = CallbackPhases()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._owned and vramwatch.current() is self.handle:
            return  # a retried inner loop (auto_find_batch_size after an OOM): keep what we started
        try:
            self.handle, self._owned = start_for_framework(
                self.settings,
                _attr(args, "process_index"),
                _attr(args, "local_process_index"),
                _attr(args, "world_size"),
            )
        except Exception as e:  # noqa: BLE001
            log.warning("vramwatch: callback could not start: %r", e)
        if self.handle is not None:  # memory by role: the Trainer passes its model and optimizer here
            vramwatch.watch(kwargs.get("model"), kwargs.get("optimizer"))
        # a resumed run starts from the checkpoint's count: only what this run adds is counted
        self._tokens_seen = _tokens_seen(args, state)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        tokens = None
        try:
            seen = _tokens_seen(args, state)
            if seen is not None and self._tokens_seen is not None and seen >= self._tokens_seen:
                delta = seen - self._tokens_seen
                world = _attr(args, "world_size") or 1
                tokens = delta if world == 1 else delta / world
            self._tokens_seen = seen
        except Exception:  # noqa: BLE001
            tokens = None
        vramwatch.step(tokens=tokens)
        self._flags_set(control)
        self.phases.step_ended()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.phases.close()  # a save with no hook after it (a failed one) ends here at the latest
        self.phases.step_began()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flags_set(control)

    def _flags_set(self, control: Any) -> None:
        """The Trainer evaluates, then saves, right after the hooks that set these flags (no hook before
        either): the phase begins now."""
        try:
            if getattr(control, "should_evaluate", False):
                self.phases.open("eval")
            elif getattr(control, "should_save", False):
                self.phases.open("save")
        except Exception:  # noqa: BLE001
            pass

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.phases.open("eval")  # trainer.evaluate() / predict() called by the script: from its first batch

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.phases.close("eval")
        if getattr(control, "should_save", False):
            self.phases.open("save")

    def on_predict(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.phases.close("eval")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.phases.close("save")

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        h = self.handle
        if h is None or not logs:
            return
        try:
            # training logs only (evaluation logs carry eval_loss); NaN / Inf counted as step() counts them
            h.heartbeat.note(logs.get("loss"), logs.get("grad_norm"))
        except Exception:  # noqa: BLE001
            pass

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.phases.close()
        stop_if_started(self.handle, self._owned, self.stop_on_end)
        self.handle, self._owned = None, False
