"""A real Lightning Trainer on CPU with a tiny randomly initialised module."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from harness import wait_until

torch = pytest.importorskip("torch")

import vramwatch  # noqa: E402

L: Any = None  # lightning.pytorch and tiny_lightning.Tiny, bound by the fixture below
Tiny: Any = None


@pytest.fixture(scope="module", autouse=True)
def lightning_imported() -> None:
    """Lightning is imported when this file's first test runs, not when it is collected: every xdist worker
    collects every file, and Lightning's import costs ~2 s of CPU."""
    global L, Tiny
    L = pytest.importorskip("lightning.pytorch")
    from tiny_lightning import Tiny


def trainer(callbacks, max_steps=6):
    return L.Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=2,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )


def make_probe(exp, at_step):
    """A callback that, at one optimiser step, looks at the live target from inside the run."""

    class Probe(L.Callback):
        def __init__(self, exp, at_step):
            self.exp, self.at_step = exp, at_step
            self.seen = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step != self.at_step or self.seen is not None:
                return
            exp = self.exp
            exp.wait_steps(self.at_step)
            loss = float(outputs["loss"])
            wait_until(
                lambda: exp.values("vramwatch_training_loss", rank=0) == [pytest.approx(loss, rel=1e-5)],
                10,
                "this step's loss",
            )
            gn = float(trainer.callback_metrics["grad_2.0_norm_total"])
            wait_until(
                lambda: exp.values("vramwatch_training_grad_norm", rank=0) == [pytest.approx(gn, rel=1e-5)],
                10,
                "the logged grad norm",
            )
            self.seen = {"rank_info": [lab for lab, _ in exp.metrics().get("vramwatch_rank_info", [])]}

    return Probe(exp, at_step)


def test_lightning_drives_the_heartbeat_per_optimiser_step(exporter):
    from vramwatch.integrations.lightning import VramwatchCallback

    exp = exporter().start()
    probe = make_probe(exp, at_step=4)
    cb = VramwatchCallback(simulate=True, serve="external", spool_dir=exp.spool, port=exp.port, interval=0.05)
    t = trainer([cb, probe])
    t.fit(Tiny())
    assert t.global_step == 6
    assert probe.seen is not None, "the probe never ran"
    (info,) = probe.seen["rank_info"]
    assert info["rank"] == "0" and info["local_rank"] == "0" and info["world_size"] == "1"
    assert vramwatch.current() is None  # stopped at teardown: it started the exporter
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
    from vramwatch.integrations.lightning import VramwatchCallback

    a, b = Tiny(), Tiny()
    trainer(
        [
            VramwatchCallback(
                simulate=True,
                serve="external",
                spool_dir=str(tmp_path / "spool"),
                interval=0.05,
                status_every=2,
                reclaim_threshold=0.9,
            )
        ]
    ).fit(a)
    trainer([]).fit(b)
    assert len(a.losses) == 12 and a.losses == b.losses
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_pytorch_lightning_name_gets_its_own_base_class():
    pytest.importorskip("pytorch_lightning")
    code = (
        "import pytorch_lightning, sys\n"
        "from vramwatch.integrations.lightning import VramwatchCallback\n"
        "assert issubclass(VramwatchCallback, pytorch_lightning.Callback), VramwatchCallback.__mro__\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]


def test_setup_labels_the_exporter_with_the_trainers_identity(tmp_path, monkeypatch):
    """One process here, so the trainer's ranks are faked: setup must take them from the trainer, not the env."""
    import types

    from vramwatch.integrations.lightning import VramwatchCallback

    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    cb = VramwatchCallback(simulate=True, serve="external", spool_dir=str(tmp_path / "spool"), interval=0.05)
    trainer = types.SimpleNamespace(global_rank=3, local_rank=1, world_size=4, global_step=5)
    cb.setup(trainer, None, "validate")
    assert cb.handle is None and vramwatch.current() is None  # only fit starts it
    cb.setup(trainer, None, "fit")
    try:
        h = vramwatch.current()
        assert h is cb.handle and (h.identity.rank, h.identity.local_rank, h.identity.world_size) == (3, 1, 4)
        assert cb._last_global_step == 5  # a resumed run's first step is not counted twice
        cb.setup(trainer, None, "fit")  # fit again (a second trainer.fit): the same exporter
        assert vramwatch.current() is h
    finally:
        cb.teardown(trainer, None, "fit")
    assert vramwatch.current() is None


def test_the_callback_watches_the_module_and_its_optimizer(tmp_path):
    from vramwatch.integrations.lightning import VramwatchCallback

    h = vramwatch.start(simulate=True, serve="external", spool_dir=str(tmp_path / "spool"), interval=0.05, rank=0)
    try:
        module = Tiny()
        t = trainer([VramwatchCallback()])
        t.fit(module)
        w = h.roles
        assert w is not None and w._model() is module
        assert w._optimizer() is t.optimizers[0]
    finally:
        vramwatch.stop()


def test_validation_and_checkpoint_save_are_declared_phases(tmp_path):
    """A probe after ours sees eval during validation (the sanity check too), save while the checkpoint is
    assembled, and no phase while training batches run; the data wait is measured."""
    from vramwatch.integrations.lightning import VramwatchCallback

    seen: list[tuple[str, str | None]] = []
    handles: list[Any] = []

    def current_phase():
        h = vramwatch.current()
        p = h.heartbeat.phases.current() if h is not None else None
        return p[0] if p else None

    class Probe(L.Callback):
        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            seen.append(("validate", current_phase()))

        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            seen.append(("save", current_phase()))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(("train", current_phase()))
            handles.append(vramwatch.current())

    class WithValidation(Tiny):
        def validation_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def val_dataloader(self):
            return self.train_dataloader()

    cb = VramwatchCallback(simulate=True, serve="external", spool_dir=str(tmp_path / "spool"), interval=0.05)
    t = L.Trainer(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        callbacks=[cb, Probe(), L.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=2,
        limit_val_batches=2,
        num_sanity_val_steps=1,
    )
    t.fit(WithValidation())
    assert {p for what, p in seen if what == "validate"} == {"eval"}
    assert [p for what, p in seen if what == "save"] and {p for what, p in seen if what == "save"} == {"save"}
    assert {p for what, p in seen if what == "train"} == {None}
    hb = handles[-1].heartbeat
    assert hb.data_tracked and 0 < hb.data_wait < 60
