"""A real Hugging Face Trainer on CPU with a tiny random GPT-2 (built from a config: nothing downloaded)."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never reach the Hub
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import pytest

from harness import wait_until

torch = pytest.importorskip("torch")

import vramwatch  # noqa: E402
from vramwatch.integrations import framework_settings  # noqa: E402

transformers: Any = None  # bound by the fixture below, as are tiny_gpt2's TinyLM and tiny_model
TinyLM: Any = None
tiny_model: Any = None


@pytest.fixture(scope="module", autouse=True)
def transformers_imported() -> None:
    """transformers is imported when this file's first test runs, not when it is collected: every xdist
    worker collects every file, and the import costs ~1 s of CPU."""
    global transformers, TinyLM, tiny_model
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tiny_gpt2 import TinyLM, tiny_model


def tiny_args(tmp_path, **kw):
    kw.setdefault("max_steps", 8)
    return transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        **kw,
    )


def train(tmp_path, callbacks):
    trainer = transformers.Trainer(
        model=tiny_model(), args=tiny_args(tmp_path), train_dataset=TinyLM(), callbacks=callbacks
    )
    trainer.train()
    return trainer


def make_probe(exp, at_step):
    """A callback that, at one optimiser step, looks at the live target from inside the run."""

    class Probe(transformers.TrainerCallback):
        def __init__(self, exp, at_step):
            self.exp, self.at_step = exp, at_step
            self.logged = []
            self.seen = None

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.logged.append((logs["loss"], logs.get("grad_norm")))

        def on_step_end(self, args, state, control, **kw):
            if state.global_step != self.at_step:
                return
            exp = self.exp
            exp.wait_steps(self.at_step)
            loss, gnorm = self.logged[-1]  # logged after the previous step's on_step_end
            wait_until(
                lambda: exp.values("vramwatch_training_loss", rank=0) == [pytest.approx(loss)], 10, "the logged loss"
            )
            self.seen = {
                "grad_norm": exp.values("vramwatch_training_grad_norm", rank=0),
                "rank_info": [lab for lab, _ in exp.metrics().get("vramwatch_rank_info", [])],
                "gnorm": gnorm,
                "hist_count": exp.values("vramwatch_training_step_duration_seconds_count", rank=0),
            }

    return Probe(exp, at_step)


def test_trainer_drives_the_heartbeat_with_loss_and_labels(exporter, tmp_path):
    from vramwatch.integrations.hf import VramwatchCallback

    exp = exporter().start()
    probe = make_probe(exp, at_step=6)
    cb = VramwatchCallback(simulate=True, serve="external", spool_dir=exp.spool, port=exp.port, interval=0.05)
    trainer = train(tmp_path, [cb, probe])
    assert trainer.state.global_step == 8
    seen = probe.seen
    assert seen is not None, "the probe never ran"
    assert seen["gnorm"] is not None and seen["grad_norm"] == [pytest.approx(seen["gnorm"])]
    (info,) = seen["rank_info"]
    assert info["rank"] == "0" and info["local_rank"] == "0" and info["world_size"] == "1"
    assert seen["hist_count"] == [5.0]  # six optimiser steps: five intervals (12 micro-batches would give 11)
    # the callback started the exporter, so it stopped it at the end: no heartbeat left to go stale
    assert vramwatch.current() is None
    # its heartbeat and sample age go at once (nothing left to go stale); its final counters stay for the
    # dead-rank grace window (docs/nothing-lost.md)
    wait_until(
        lambda: (
            exp.values("vramwatch_training_last_step_timestamp_seconds") == []
            and exp.values("vramwatch_sample_age_seconds") == []
        ),
        10,
        "the heartbeat to go",
    )
    assert exp.values("vramwatch_training_steps_total"), "the final counters stay for the grace window"


def test_the_callback_does_not_change_training(tmp_path):
    from vramwatch.integrations.hf import VramwatchCallback

    spool = str(tmp_path / "spool")
    with_cb = train(
        tmp_path / "a",
        [VramwatchCallback(simulate=True, serve="external", spool_dir=spool, interval=0.05, status_every=2)],
    )
    without = train(tmp_path / "b", [])
    losses = [[e["loss"] for e in t.state.log_history if "loss" in e] for t in (with_cb, without)]
    assert len(losses[0]) == 8 and losses[0] == losses[1]
    for p, q in zip(with_cb.model.parameters(), without.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_an_exporter_the_script_started_is_reused_and_kept(tmp_path):
    from vramwatch.integrations.hf import VramwatchCallback

    h = vramwatch.start(simulate=True, serve="external", spool_dir=str(tmp_path / "spool"), interval=0.05, rank=0)
    try:
        train(tmp_path, [VramwatchCallback()])
        assert vramwatch.current() is h and h.heartbeat.steps == 8
    finally:
        vramwatch.stop()


def test_bad_settings_fail_when_the_callback_is_made():
    from vramwatch.integrations.hf import VramwatchCallback

    with pytest.raises(vramwatch.ConfigError, match="port"):
        VramwatchCallback(port=70000)


def test_rank_precedence_explicit_then_framework_then_launcher():
    env = {"RANK": "7", "LOCAL_RANK": "3", "WORLD_SIZE": "16"}
    # the framework's identity fills what the user left unset
    assert framework_settings({}, 2, 1, 4, env=env) == {"rank": 2, "local_rank": 1, "world_size": 4}
    # an explicit setting (argument or VRAMWATCH_*) wins over the framework
    assert framework_settings({"rank": 5}, 2, 1, 4, env=env) == {"rank": 5, "local_rank": 1, "world_size": 4}
    assert framework_settings({}, 2, None, 4, env={**env, "VRAMWATCH_LOCAL_RANK": "0"}) == {"rank": 2, "world_size": 4}
    # no framework value: nothing is set, and the launcher's environment decides at start()
    assert framework_settings({}, None, None, None, env=env) == {}
    from vramwatch.rank.identity import identify

    assert identify(env=env).rank == 7


def test_a_retried_inner_loop_keeps_ownership(tmp_path):
    """auto_find_batch_size reruns the inner loop after an OOM: on_train_begin comes twice, on_train_end once."""
    import types

    from vramwatch.integrations.hf import VramwatchCallback

    cb = VramwatchCallback(simulate=True, serve="external", spool_dir=str(tmp_path / "spool"), interval=0.05)
    args = types.SimpleNamespace(process_index=0, local_process_index=0, world_size=1)
    cb.on_train_begin(args, None, None)
    first = vramwatch.current()
    cb.on_train_begin(args, None, None)
    assert vramwatch.current() is first is cb.handle
    cb.on_step_end(args, None, None)
    cb.on_log(args, None, None, logs={"loss": 1.25, "grad_norm": 0.5, "learning_rate": 1e-4})
    cb.on_log(args, None, None, logs={"eval_loss": 9.0})
    assert (first.heartbeat.steps, first.heartbeat.loss, first.heartbeat.grad_norm) == (1, 1.25, 0.5)
    cb.on_train_end(args, None, None)
    assert vramwatch.current() is None


def test_the_callback_watches_the_trainers_model_and_optimizer(tmp_path):
    from vramwatch.integrations.hf import VramwatchCallback

    h = vramwatch.start(simulate=True, serve="external", spool_dir=str(tmp_path / "spool"), interval=0.05, rank=0)
    try:
        t = train(tmp_path, [VramwatchCallback()])
        w = h.roles
        assert w is not None and w._model() is t.model
        assert w._optimizer() is t.optimizer
    finally:
        vramwatch.stop()


def test_evaluation_and_save_are_declared_phases_and_the_gaps_a_data_wait(tmp_path):
    """The Trainer evaluates and saves every 2 steps: a probe after ours sees the phase open during each
    evaluation batch and at the save, none during training steps; the data wait is measured."""
    from vramwatch.integrations.hf import VramwatchCallback

    seen: list[tuple[str, str | None]] = []
    handles: list[Any] = []

    def current_phase():
        h = vramwatch.current()
        p = h.heartbeat.phases.current() if h is not None else None
        return p[0] if p else None

    class Probe(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            seen.append(("step", current_phase()))
            handles.append(vramwatch.current())

        def on_prediction_step(self, args, state, control, **kw):
            seen.append(("predict", current_phase()))

        def on_save(self, args, state, control, **kw):  # after ours: ours closed it; the saving itself was inside
            seen.append(("saved", current_phase()))

    cb = VramwatchCallback(simulate=True, serve="external", spool_dir=str(tmp_path / "spool"), interval=0.05)
    saves: list[str | None] = []
    orig = transformers.Trainer._save_checkpoint

    def save_checkpoint(self, *a, **kw):
        saves.append(current_phase())
        return orig(self, *a, **kw)

    transformers.Trainer._save_checkpoint = save_checkpoint
    try:
        args = tiny_args(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
        args.save_strategy = transformers.IntervalStrategy.STEPS
        args.save_steps = 2
        trainer = transformers.Trainer(
            model=tiny_model(), args=args, train_dataset=TinyLM(), eval_dataset=TinyLM(), callbacks=[cb, Probe()]
        )
        trainer.train()
    finally:
        transformers.Trainer._save_checkpoint = orig
    assert {p for what, p in seen if what == "predict"} == {"eval"}
    assert {p for what, p in seen if what == "step"} == {None}
    assert saves == ["save", "save"]
    assert all(p is None for what, p in seen if what == "saved")
    hb = handles[-1].heartbeat
    assert hb.data_tracked and 0 < hb.data_wait < 60
