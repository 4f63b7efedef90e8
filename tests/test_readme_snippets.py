"""The README's ways in (one line, Trainer, Lightning, the options) run as written, on CPU."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from types import ModuleType

import pytest
from harness import ROOT, wait_until

import vramwatch

SECTIONS = ("## One line in the training script", "## Hugging Face Trainer and Lightning")


def blocks():
    text = (ROOT / "README.md").read_text()
    out = []
    for title in SECTIONS:
        start = text.index(title + "\n")
        end = text.find("\n## ", start + len(title))
        body = text[start : end if end >= 0 else None]
        out += re.findall(r"^```python\n(.*?)^```", body, flags=re.S | re.M)
    return out


def _integration_tests(name: str) -> ModuleType:
    """tests/integrations/<name>.py, whose tiny models the snippets train. Loaded by path: pytest puts that
    folder on sys.path only once it has collected a test from it."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "integrations" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_the_readme_has_the_three_ways_in():
    code = blocks()
    assert len(code) == 4
    assert "vramwatch.start()" in code[0]
    assert "vramwatch.integrations.hf import VramwatchCallback" in code[1]
    assert "vramwatch.integrations.lightning import VramwatchCallback" in code[2]
    assert "status_every" in code[3]


@pytest.fixture
def env(exporter, tmp_path, monkeypatch):
    exp = exporter().start()
    for k in [k for k in os.environ if k.startswith("VRAMWATCH_")]:
        monkeypatch.delenv(k)
    for k, v in dict(
        SPOOL_DIR=exp.spool, PORT=str(exp.port), SERVE="external", SIMULATE="true", INTERVAL="0.05"
    ).items():
        monkeypatch.setenv("VRAMWATCH_" + k, v)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # whatever a snippet writes (checkpoints, snapshots) lands here
    handles = []
    real = vramwatch.start

    def recording_start(**kw):
        h = real(**kw)
        handles.append(h)
        return h

    monkeypatch.setattr(vramwatch, "start", recording_start)
    yield exp, handles
    vramwatch.stop()


def _loop_namespace(n=12):
    seen = []
    return {"loader": range(n), "train_step": lambda batch: seen.append(batch) or 0.5}, seen


def test_one_line_snippet(env):
    exp, handles = env
    ns, seen = _loop_namespace()
    exec(blocks()[0], ns)
    assert len(seen) == 12
    wait_until(
        lambda: [v for _, v in exp.metrics().get("vramwatch_training_steps_total", [])] == [12.0],
        10,
        "the snippet's steps in the scrape",
    )
    assert [v for _, v in exp.metrics()["vramwatch_training_loss"]] == [0.5]


def test_options_snippet(env):
    exp, handles = env
    ns, seen = _loop_namespace(120)
    exec(blocks()[3], ns)
    (h,) = handles
    assert len(seen) == 120 and h.heartbeat.steps == 120
    assert h.status is not None and h.status.lines == 2 and h.hygiene is not None
    assert h.oom.snapshot_dir == "oom-snapshots"
    assert vramwatch.current() is None  # the with block stopped it


def test_trainer_snippet(env, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    hf_tests = _integration_tests("test_hf")
    TinyLM, tiny_model = hf_tests.TinyLM, hf_tests.tiny_model

    exp, handles = env
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=5,
        per_device_train_batch_size=4,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
    )
    ns = {"model": tiny_model(), "args": args, "train_dataset": TinyLM()}
    exec(blocks()[1], ns)
    (h,) = handles
    assert ns["trainer"].state.global_step == 5 and h.heartbeat.steps == 5
    assert h.heartbeat.loss is not None and h.identity.world_size == 1
    assert vramwatch.current() is None


def test_lightning_snippet(env):
    pytest.importorskip("lightning")
    Tiny = _integration_tests("test_lightning").Tiny

    exp, handles = env
    model = Tiny()
    ns = {"model": model}
    exec(blocks()[2], ns)
    (h,) = handles
    assert ns["trainer"].global_step == 16 and h.heartbeat.steps == 16  # one epoch of 16 batches
    assert h.heartbeat.loss is not None and h.heartbeat.grad_norm is not None
    assert vramwatch.current() is None
