"""Each hook of the HF and Lightning callbacks, driven as the frameworks call them, in milliseconds.

test_hf.py and test_lightning.py train real models (rank 0 of 1); these call the hooks directly with
stand-in ``args`` / ``trainer`` objects carrying only the attributes the callbacks read, so that ranks,
resumed steps, accumulation and failing framework properties can be set. The exporter is a real one
(simulated GPU); what a test reads is the handle's heartbeat and identity, or what was passed to
``vramwatch.watch``.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types

import pytest

torch = pytest.importorskip("torch")

import vramwatch  # noqa: E402
from vramwatch.integrations import framework_settings, start_for_framework  # noqa: E402

NS = types.SimpleNamespace


# The callback modules, imported by the tests that use them: collecting this file (every xdist worker collects
# every file) then costs none of transformers' and Lightning's imports, ~5 s of CPU, on the workers not running it.
def _callbacks(name: str) -> types.ModuleType:
    pytest.importorskip({"hf": "transformers", "lightning": "lightning.pytorch"}[name])
    return importlib.import_module(f"vramwatch.integrations.{name}")


@pytest.fixture
def hf() -> types.ModuleType:
    return _callbacks("hf")


@pytest.fixture
def lightning() -> types.ModuleType:
    return _callbacks("lightning")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    for var in [v for v in __import__("os").environ if v.startswith("VRAMWATCH_")]:
        monkeypatch.delenv(var)
    yield
    vramwatch.stop()


@pytest.fixture
def kw(tmp_path):
    return dict(simulate=True, serve="external", spool_dir=str(tmp_path / "spool"), interval=0.05)


@pytest.fixture
def watched(monkeypatch):
    """What the callbacks pass to vramwatch.watch: (model, optimizer) per call."""
    calls: list[tuple[object, object]] = []

    def record(model, optimizer=None, *args, **kwargs):
        calls.append((model, optimizer))

    monkeypatch.setattr(vramwatch, "watch", record)
    return calls


def hb():
    h = vramwatch.current()
    assert h is not None
    return h.heartbeat


def ident():
    h = vramwatch.current()
    assert h is not None
    return (h.identity.rank, h.identity.local_rank, h.identity.world_size)


class Raising:
    """A framework object whose every attribute needs a distributed state we do not have."""

    def __getattr__(self, name):
        raise RuntimeError(f"{name}: no process group")


# --- _attr: both modules read the framework's ranks through it ---


@pytest.mark.parametrize("name", ["hf", "lightning"])
def test_attr_reads_an_integer_or_nothing(name):
    mod = _callbacks(name)
    assert mod._attr(NS(r="3"), "r") == 3 and isinstance(mod._attr(NS(r=3.0), "r"), int)
    assert mod._attr(NS(r=0), "r") == 0
    assert mod._attr(NS(r=None), "r") is None
    assert mod._attr(NS(), "r") is None
    assert mod._attr(Raising(), "r") is None
    assert mod._attr(NS(r="not a number"), "r") is None


# --- framework_settings / start_for_framework ---


def test_the_frameworks_rank_zero_wins_over_the_launchers():
    env = {"RANK": "7", "LOCAL_RANK": "3", "WORLD_SIZE": "16"}
    assert framework_settings({}, 0, 0, 1, env=env) == {"rank": 0, "local_rank": 0, "world_size": 1}
    # a negative value (a framework's "unknown") leaves the key to the launcher's environment
    assert framework_settings({}, -1, 2, -1, env=env) == {"local_rank": 2}
    assert framework_settings({"interval": 2.0}, 1, None, None, env={}) == {"interval": 2.0, "rank": 1}


def test_framework_settings_read_the_environment_they_are_given(monkeypatch):
    env = {"VRAMWATCH_LOCAL_RANK": "0"}  # set by the user: the framework's local rank does not override it
    assert framework_settings({}, 2, 1, 4, env=env) == {"rank": 2, "world_size": 4}
    monkeypatch.setenv("VRAMWATCH_WORLD_SIZE", "8")  # without env=, the process environment
    assert framework_settings({}, 2, 1, 4) == {"rank": 2, "local_rank": 1}


def test_framework_settings_reject_bad_settings():
    with pytest.raises(vramwatch.ConfigError, match="port"):
        framework_settings({"port": 70000}, 0, 0, 1, env={})


def test_start_for_framework_starts_labels_and_owns(kw):
    h, owned = start_for_framework(kw, 3, 1, 4)
    assert owned is True and h is vramwatch.current() and ident() == (3, 1, 4)
    # started already (by the script or an earlier callback): reused, not owned
    again, owned = start_for_framework(kw, 5, 0, 8)
    assert again is h and owned is False and ident() == (3, 1, 4)


def test_start_for_framework_never_raises(kw, monkeypatch, caplog):
    def broken(**settings):
        raise OSError("spool not writable")

    monkeypatch.setattr(vramwatch, "start", broken)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        assert start_for_framework(kw, 0, 0, 1) == (None, False)
    assert caplog.messages == ["vramwatch: could not start from the training framework: OSError('spool not writable')"]


# --- Hugging Face ---


def hf_args(rank=3, local=1, world=4):
    return NS(process_index=rank, local_process_index=local, world_size=world)


def test_hf_callback_checks_settings_and_starts_nothing_when_made(kw, hf):
    with pytest.raises(vramwatch.ConfigError, match="interval"):
        hf.VramwatchCallback(interval=-1)
    cb = hf.VramwatchCallback(**kw)
    assert cb.handle is None and vramwatch.current() is None and cb.settings == kw and cb.stop_on_end is True
    cb.on_log(None, None, None, logs={"loss": 1.0})  # a log before the run: nothing to feed, no error
    cb.on_train_end(None, None, None)
    assert cb.handle is None


def test_hf_begin_labels_with_the_trainers_ranks_and_watches(kw, watched, hf):
    model, opt = torch.nn.Linear(2, 1), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cb = hf.VramwatchCallback(**kw)
    cb.on_train_begin(hf_args(), None, None, model=model, optimizer=opt)
    assert cb.handle is vramwatch.current() and ident() == (3, 1, 4)
    assert watched == [(model, opt)]


def test_hf_begin_with_ranks_the_args_cannot_tell(kw, watched, hf):
    cb = hf.VramwatchCallback(**kw)
    cb.on_train_begin(Raising(), None, None)  # no distributed state: the launcher's (none here) decides
    assert ident() == (0, 0, 1) and cb.handle is vramwatch.current()
    assert watched == [(None, None)]


def test_hf_begin_survives_a_failing_start(kw, watched, monkeypatch, caplog, hf):
    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(hf, "start_for_framework", broken)
    cb = hf.VramwatchCallback(**kw)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        cb.on_train_begin(hf_args(), None, None, model=object())
    assert cb.handle is None and watched == []  # nothing started, nothing watched
    assert caplog.messages == ["vramwatch: callback could not start: RuntimeError('boom')"]
    cb.on_step_end(None, None, None)
    cb.on_log(None, None, None, logs={"loss": 1.0})
    cb.on_train_end(None, None, None)


def test_hf_steps_and_logs_feed_the_heartbeat(kw, hf):
    cb = hf.VramwatchCallback(**kw)
    cb.on_train_begin(hf_args(), None, None)
    for _ in range(3):
        cb.on_step_end(None, None, None)
    cb.on_log(None, None, None, logs={"loss": 2.5})
    assert (hb().steps, hb().loss, hb().grad_norm) == (3, 2.5, None)
    cb.on_log(None, None, None, logs={"grad_norm": 0.75, "learning_rate": 1e-3})  # grad norm alone
    assert (hb().loss, hb().grad_norm) == (2.5, 0.75)
    cb.on_log(None, None, None, logs={"eval_loss": 9.0, "eval_runtime": 1.0})  # an evaluation log
    cb.on_log(None, None, None, logs={})
    cb.on_log(None, None, None, logs=None)
    assert (hb().steps, hb().loss, hb().grad_norm) == (3, 2.5, 0.75)


def test_hf_end_stops_only_what_it_started(kw, hf):
    cb = hf.VramwatchCallback(**kw)
    cb.on_train_begin(hf_args(), None, None)
    cb.on_train_end(None, None, None)
    assert vramwatch.current() is None and cb.handle is None
    # a second run with the same callback starts afresh (ownership was handed back at the end)
    cb.on_train_begin(hf_args(2, 0, 4), None, None)
    assert ident() == (2, 0, 4)
    cb.on_train_end(None, None, None)
    assert vramwatch.current() is None


def test_hf_a_retried_inner_loop_keeps_what_it_started(kw, hf):
    """auto_find_batch_size reruns the inner loop after an OOM: on_train_begin twice, on_train_end once."""
    cb = hf.VramwatchCallback(**kw)
    cb.on_train_begin(hf_args(), None, None)
    h = vramwatch.current()
    cb.on_step_end(None, None, None)
    cb.on_train_begin(hf_args(), None, None)
    assert vramwatch.current() is h is cb.handle and h.heartbeat.steps == 1
    cb.on_train_end(None, None, None)
    assert vramwatch.current() is None  # still its own: stopped


def test_hf_end_keeps_the_scripts_exporter(kw, hf):
    h = vramwatch.start(**kw, rank=0)
    cb = hf.VramwatchCallback()
    cb.on_train_begin(hf_args(), None, None)
    assert cb.handle is h and ident() == (0, 0, 1)  # reused as it is, not relabelled
    cb.on_step_end(None, None, None)
    cb.on_train_end(None, None, None)
    assert vramwatch.current() is h and h.heartbeat.steps == 1 and cb.handle is None


def test_hf_stop_on_end_false_leaves_it_running(kw, hf):
    cb = hf.VramwatchCallback(stop_on_end=False, **kw)
    cb.on_train_begin(hf_args(), None, None)
    h = vramwatch.current()
    cb.on_train_end(None, None, None)
    assert vramwatch.current() is h is not None and cb.handle is None


def test_hf_end_leaves_an_exporter_restarted_meanwhile(kw, hf):
    cb = hf.VramwatchCallback(**kw)
    cb.on_train_begin(hf_args(), None, None)
    vramwatch.stop()
    other = vramwatch.start(**kw, rank=5)  # the script replaced it mid-run
    cb.on_train_end(None, None, None)
    assert vramwatch.current() is other


# --- Lightning ---


def pl_trainer(global_step=0, metrics=None, optimizers=(), rank=3, local=1, world=4):
    return NS(
        global_rank=rank,
        local_rank=local,
        world_size=world,
        global_step=global_step,
        callback_metrics=dict(metrics or {}),
        optimizers=list(optimizers),
    )


def test_lightning_callback_checks_settings_and_starts_nothing_when_made(kw, lightning):
    with pytest.raises(vramwatch.ConfigError, match="port"):
        lightning.VramwatchCallback(port=70000)
    cb = lightning.VramwatchCallback(**kw)
    assert cb.handle is None and vramwatch.current() is None and cb.settings == kw and cb.stop_on_end is True
    assert isinstance(cb, pytest.importorskip("lightning.pytorch").Callback)


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_lightning_starts_only_for_fit(kw, stage, lightning):
    cb = lightning.VramwatchCallback(**kw)
    cb.setup(pl_trainer(), None, stage)
    assert cb.handle is None and vramwatch.current() is None


def test_lightning_setup_labels_with_the_trainers_ranks(kw, lightning):
    cb = lightning.VramwatchCallback(**kw)
    cb.setup(pl_trainer(rank=6, local=2, world=8), None, "fit")
    assert cb.handle is vramwatch.current() and ident() == (6, 2, 8)


def test_lightning_setup_with_ranks_the_trainer_cannot_tell(kw, lightning):
    cb = lightning.VramwatchCallback(**kw)
    cb.setup(Raising(), None, "fit")
    assert ident() == (0, 0, 1)
    # global_step unknown: counted from 0, so the first optimiser step (global_step 1) beats
    cb.on_train_batch_end(pl_trainer(global_step=0), None, None, None, 0)
    cb.on_train_batch_end(pl_trainer(global_step=1), None, None, None, 1)
    assert hb().steps == 1


def test_lightning_survives_a_failing_start(kw, watched, monkeypatch, caplog, lightning):
    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(lightning, "start_for_framework", broken)
    cb = lightning.VramwatchCallback(**kw)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        cb.setup(pl_trainer(), None, "fit")
    assert cb.handle is None and caplog.messages == ["vramwatch: callback could not start: RuntimeError('boom')"]
    cb.on_train_start(pl_trainer(), object())
    assert watched == []  # no exporter: nothing to watch with
    cb.on_train_batch_end(pl_trainer(global_step=1), None, {"loss": 1.0}, None, 0)
    cb.teardown(pl_trainer(), None, "fit")


def test_lightning_counts_optimiser_steps_not_micro_batches(kw, lightning):
    cb = lightning.VramwatchCallback(**kw)
    cb.setup(pl_trainer(global_step=0), None, "fit")
    # accumulate_grad_batches=2: global_step advances on every second batch
    for i, gs in enumerate([0, 1, 1, 2, 2, 3]):
        cb.on_train_batch_end(pl_trainer(global_step=gs), None, {"loss": float(i)}, None, i)
    assert hb().steps == 3
    assert hb().loss == 5.0  # the loss of the batch that completed the step


def test_lightning_resumed_run_does_not_count_its_restored_step(kw, lightning):
    cb = lightning.VramwatchCallback(**kw)
    cb.setup(pl_trainer(global_step=500), None, "fit")  # resumed from a checkpoint at step 500
    cb.on_train_batch_end(pl_trainer(global_step=500), None, {"loss": 1.0}, None, 0)
    assert hb().steps == 0
    cb.on_train_batch_end(pl_trainer(global_step=501), None, {"loss": 1.0}, None, 1)
    assert hb().steps == 1


def test_lightning_loss_from_a_dict_or_a_tensor_detached(kw, lightning):
    cb = lightning.VramwatchCallback(**kw)
    cb.setup(pl_trainer(), None, "fit")
    w = torch.tensor(2.0, requires_grad=True)
    cb.on_train_batch_end(pl_trainer(global_step=1), None, {"loss": w * 3, "other": 1}, None, 0)
    loss = hb().loss
    assert float(loss) == 6.0 and not loss.requires_grad  # no graph kept alive into the next step
    cb.on_train_batch_end(pl_trainer(global_step=2), None, w * 4, None, 1)  # training_step returned a tensor
    assert float(hb().loss) == 8.0 and not hb().loss.requires_grad
    cb.on_train_batch_end(pl_trainer(global_step=3), None, {"log": 1}, None, 2)  # no loss: the last one stays
    assert float(hb().loss) == 8.0 and hb().steps == 3


def test_lightning_grad_norm_key_order(kw, lightning):
    cb = lightning.VramwatchCallback(**kw)
    cb.setup(pl_trainer(), None, "fit")
    metrics = {"train/grad_norm": 3.0, "grad_2.0_norm_total": 2.0, "grad_norm": 1.0}
    cb.on_train_batch_end(pl_trainer(1, metrics), None, None, None, 0)
    assert hb().grad_norm == 1.0  # the module's own grad_norm first
    del metrics["grad_norm"]
    cb.on_train_batch_end(pl_trainer(2, metrics), None, None, None, 1)
    assert hb().grad_norm == 2.0  # then Lightning's grad_norm() total
    del metrics["grad_2.0_norm_total"]
    cb.on_train_batch_end(pl_trainer(3, metrics), None, None, None, 2)
    assert hb().grad_norm == 3.0
    cb.on_train_batch_end(pl_trainer(4, {"grad_2.0_norm_layer": 9.0}), None, None, None, 3)
    assert hb().grad_norm == 3.0 and hb().steps == 4  # no grad norm logged: the last one stays


def test_lightning_a_failing_trainer_property_still_beats(kw, lightning):
    cb = lightning.VramwatchCallback(**kw)
    cb.setup(pl_trainer(), None, "fit")
    cb.on_train_batch_end(pl_trainer(1), None, {"loss": 2.0}, None, 0)
    cb.on_train_batch_end(Raising(), None, {"loss": 7.0}, None, 1)
    assert hb().steps == 2 and hb().loss == 2.0  # a beat, without values it could not read safely


def test_lightning_watches_the_module_and_its_first_optimizer(kw, watched, lightning):
    cb = lightning.VramwatchCallback(**kw)
    cb.setup(pl_trainer(), None, "fit")
    module, opt_a, opt_b = object(), object(), object()
    cb.on_train_start(pl_trainer(optimizers=[opt_a, opt_b]), module)
    cb.on_train_start(pl_trainer(optimizers=[]), module)
    cb.on_train_start(Raising(), module)
    assert watched == [(module, opt_a), (module, None), (module, None)]


def test_lightning_teardown_stops_only_what_it_started(kw, lightning):
    cb = lightning.VramwatchCallback(**kw)
    cb.setup(pl_trainer(), None, "fit")
    h = vramwatch.current()
    cb.teardown(pl_trainer(), None, "validate")  # the end of another stage: still running
    assert vramwatch.current() is h and cb.handle is h
    cb.teardown(pl_trainer(), None, "fit")
    assert vramwatch.current() is None and cb.handle is None
    cb.setup(pl_trainer(rank=2), None, "fit")  # fit again: starts afresh
    assert ident() == (2, 1, 4)


def test_lightning_fit_twice_keeps_what_it_started(kw, lightning):
    cb = lightning.VramwatchCallback(**kw)
    cb.setup(pl_trainer(global_step=0), None, "fit")
    h = vramwatch.current()
    cb.on_train_batch_end(pl_trainer(global_step=1), None, None, None, 0)
    cb.setup(pl_trainer(global_step=1), None, "fit")  # a second trainer.fit: the same exporter, still its own
    assert vramwatch.current() is h is cb.handle
    cb.on_train_batch_end(pl_trainer(global_step=1), None, None, None, 1)
    assert h.heartbeat.steps == 1
    cb.teardown(pl_trainer(), None, "fit")
    assert vramwatch.current() is None


def test_lightning_teardown_keeps_the_scripts_exporter(kw, lightning):
    h = vramwatch.start(**kw, rank=0)
    cb = lightning.VramwatchCallback()
    cb.setup(pl_trainer(), None, "fit")
    assert cb.handle is h and ident() == (0, 0, 1)
    cb.teardown(pl_trainer(), None, "fit")
    assert vramwatch.current() is h and cb.handle is None


def test_lightning_stop_on_end_false_leaves_it_running(kw, lightning):
    cb = lightning.VramwatchCallback(stop_on_end=False, **kw)
    cb.setup(pl_trainer(), None, "fit")
    h = vramwatch.current()
    cb.teardown(pl_trainer(), None, "fit")
    assert vramwatch.current() is h is not None and cb.handle is None


def test_lightning_teardown_leaves_an_exporter_restarted_meanwhile(kw, lightning):
    cb = lightning.VramwatchCallback(**kw)
    cb.setup(pl_trainer(), None, "fit")
    vramwatch.stop()
    other = vramwatch.start(**kw, rank=5)
    cb.teardown(pl_trainer(), None, "fit")
    assert vramwatch.current() is other


# --- the Lightning base class, chosen when the module is imported ---


def base_with(lightning, present):
    """lightning._callback_base() as if only the packages named in ``present`` had been imported."""
    real = sys.modules
    # the checks read sys.modules; the imports behind them use the interpreter's own table
    sys.modules = {k: v for k, v in real.items() if k.split(".")[0] in present}
    try:
        return lightning._callback_base()
    finally:
        sys.modules = real


def test_base_class_follows_the_package_the_script_imported(lightning):
    import lightning.pytorch as new

    old = pytest.importorskip("pytorch_lightning")
    assert base_with(lightning, {"pytorch_lightning"}) is old.Callback  # the script uses the old name only
    assert base_with(lightning, {"pytorch_lightning", "lightning"}) is new.Callback
    assert base_with(lightning, {"lightning"}) is new.Callback
    assert base_with(lightning, set()) is new.Callback  # neither imported yet: the new name when installed


def test_base_class_falls_back_to_pytorch_lightning(monkeypatch, lightning):
    old = pytest.importorskip("pytorch_lightning")
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)  # its import fails: as if not installed
    assert lightning._callback_base() is old.Callback
