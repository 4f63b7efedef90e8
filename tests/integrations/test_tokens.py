"""Tokens and samples from the framework callbacks: what the Hugging Face Trainer and Lightning know
about a step's input reaches ``vramwatch.step`` and the scrape (issue 17, items 1 and 2)."""

from __future__ import annotations

import os
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never reach the Hub
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import pytest

from harness import wait_until

torch = pytest.importorskip("torch")

import vramwatch  # noqa: E402

BATCH, LENGTH, ACCUM = 4, 16, 2  # tiny_gpt2.TinyLM's sequences are LENGTH tokens long


def _started(tmp_path):
    return vramwatch.start(simulate=True, serve="external", spool_dir=str(tmp_path / "spool"), interval=0.05, rank=0)


# --- Hugging Face Trainer ---


def _hf_train(tmp_path, callbacks, max_steps=8, **kw):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tiny_gpt2 import TinyLM, tiny_model

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM,
        max_steps=max_steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        **kw,
    )
    trainer = transformers.Trainer(model=tiny_model(), args=args, train_dataset=TinyLM(), callbacks=callbacks)
    trainer.train()
    return trainer


def test_hf_tokens_seen_reach_the_scrape(exporter, tmp_path):
    from vramwatch.integrations.hf import VramwatchCallback

    exp = exporter().start()
    cb = VramwatchCallback(
        simulate=True, serve="external", spool_dir=exp.spool, port=exp.port, interval=0.05, stop_on_end=False
    )
    try:
        t = _hf_train(tmp_path, [cb], include_num_input_tokens_seen=True)
        want = 8 * ACCUM * BATCH * LENGTH
        assert t.state.num_input_tokens_seen == want  # the Trainer's own count: the independent source
        assert vramwatch.current().heartbeat.tokens == want
        wait_until(
            lambda: exp.values("vramwatch_training_tokens_total", rank=0) == [float(want)], 15, "the tokens counter"
        )
        assert exp.values("vramwatch_training_samples_total") == []  # the Trainer does not count samples
    finally:
        vramwatch.stop()


def test_hf_without_the_option_counts_no_tokens(tmp_path):
    from vramwatch.integrations.hf import VramwatchCallback

    h = _started(tmp_path)
    try:
        _hf_train(tmp_path, [VramwatchCallback()], max_steps=2)
        assert h.heartbeat.steps == 2 and h.heartbeat.tokens is None  # absent, not a false 0
    finally:
        vramwatch.stop()


@pytest.mark.parametrize(("world", "want"), [(1, [128, 128]), (4, [32.0, 32.0])])
def test_hf_counts_this_runs_tokens_per_rank(tmp_path, world, want):
    """A resumed run starts from the checkpoint's count; many processes share the gathered count."""
    pytest.importorskip("transformers")
    from vramwatch.integrations.hf import VramwatchCallback

    h = _started(tmp_path)
    try:
        cb = VramwatchCallback()
        args = SimpleNamespace(include_num_input_tokens_seen="all", world_size=world, process_index=0)
        state = SimpleNamespace(num_input_tokens_seen=5000)  # from the checkpoint
        cb.on_train_begin(args, state, None)
        got = []
        for _ in range(2):
            before = h.heartbeat.tokens or 0
            state.num_input_tokens_seen += 128
            cb.on_step_end(args, state, None)
            got.append(h.heartbeat.tokens - before)
        assert got == want
    finally:
        vramwatch.stop()


# --- Lightning ---


def _lightning():
    return pytest.importorskip("lightning.pytorch")


def _fit(module, callbacks, max_steps=6):
    L = _lightning()
    t = L.Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=ACCUM,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    t.fit(module)
    return t


def _token_module():
    """A tiny language-model-shaped module whose batches are mappings holding input_ids."""
    L = _lightning()

    class TokenLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(32, 8)
            self.head = torch.nn.Linear(8, 32)

        def training_step(self, batch, batch_idx):
            ids = batch["input_ids"]
            logits = self.head(self.emb(ids))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, 32, (64, LENGTH), generator=g)
            return torch.utils.data.DataLoader([{"input_ids": x} for x in ids], batch_size=BATCH)

    return TokenLM()


def test_lightning_counts_tokens_and_samples_of_a_token_batch(exporter, tmp_path):
    from vramwatch.integrations.lightning import VramwatchCallback

    exp = exporter().start()
    cb = VramwatchCallback(
        simulate=True, serve="external", spool_dir=exp.spool, port=exp.port, interval=0.05, stop_on_end=False
    )
    try:
        _fit(_token_module(), [cb])
        steps = 6
        assert vramwatch.current().heartbeat.steps == steps
        assert vramwatch.current().heartbeat.tokens == steps * ACCUM * BATCH * LENGTH  # every micro-batch of each step
        assert vramwatch.current().heartbeat.samples == steps * ACCUM * BATCH
        wait_until(
            lambda: (
                exp.values("vramwatch_training_tokens_total", rank=0) == [float(steps * ACCUM * BATCH * LENGTH)]
                and exp.values("vramwatch_training_samples_total", rank=0) == [float(steps * ACCUM * BATCH)]
            ),
            15,
            "the tokens and samples counters",
        )
    finally:
        vramwatch.stop()


def test_lightning_counts_samples_of_a_tuple_batch_and_no_tokens(tmp_path):
    _lightning()
    from tiny_lightning import Tiny

    from vramwatch.integrations.lightning import VramwatchCallback

    h = _started(tmp_path)
    try:
        _fit(Tiny(), [VramwatchCallback()])
        assert h.heartbeat.samples == 6 * ACCUM * BATCH and h.heartbeat.tokens is None
    finally:
        vramwatch.stop()


def test_lightning_hooks_override_the_batch(tmp_path):
    """ThroughputMonitor's hooks: batch_size_fn (samples) and length_fn (tokens); a GPU count is dropped."""
    _lightning()
    from tiny_lightning import Tiny

    from vramwatch.integrations.lightning import VramwatchCallback

    h = _started(tmp_path)
    try:
        cb = VramwatchCallback(batch_size_fn=lambda b: 1, length_fn=lambda b: torch.tensor(b[0].shape[0] * 10))
        _fit(Tiny(), [cb], max_steps=3)
        assert (h.heartbeat.samples, h.heartbeat.tokens) == (3 * ACCUM, 3 * ACCUM * BATCH * 10)
    finally:
        vramwatch.stop()


def test_a_failing_hook_counts_nothing_and_training_goes_on(tmp_path):
    _lightning()
    from tiny_lightning import Tiny

    from vramwatch.integrations.lightning import VramwatchCallback

    h = _started(tmp_path)
    try:
        _fit(Tiny(), [VramwatchCallback(length_fn=lambda b: 1 / 0)], max_steps=2)
        assert h.heartbeat.steps == 2 and h.heartbeat.tokens is None
    finally:
        vramwatch.stop()


def test_batch_counts_reads_shapes_only():
    from vramwatch.integrations.lightning import batch_counts

    ids = torch.zeros(3, 7, dtype=torch.long)
    assert batch_counts({"input_ids": ids, "labels": ids}) == (21, 3)
    assert batch_counts({"attention_mask": torch.ones(2, 5)}) == (10, 2)
    assert batch_counts((torch.zeros(6, 8), torch.zeros(6, 1))) == (None, 6)
    assert batch_counts(torch.zeros(5, 2)) == (None, 5)
    assert batch_counts({"x": [1, 2]}) == (None, None)
    assert batch_counts(torch.tensor(3.0)) == (None, None)  # a 0-d tensor has no batch dimension
