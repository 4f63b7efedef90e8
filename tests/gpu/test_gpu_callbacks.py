"""The Hugging Face and Lightning callbacks on a real GPU: memory by role (the callbacks call
``vramwatch.watch`` for the user) and tokens, each against the job's own figure.

    python3 -m pytest -m gpu tests/gpu/test_gpu_callbacks.py -q

A tiny GPT-2 (HF Trainer, ``include_num_input_tokens_seen``) and a tiny token model (Lightning, mapping
batches with ``input_ids``) train on GPU 0 with the callback and nothing else of vramwatch's in the
script. The scrape's parameter and optimizer-state bytes are compared with
``sum(t.numel() * t.element_size())`` over the model's parameters and the optimizer's CUDA state; the
tokens counter with the Trainer's own ``state.num_input_tokens_seen`` (HF) and with the loop's shapes
(Lightning). With ``OUT`` set the figures are written to ``$OUT/gpu_callbacks.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from jobs import job_env, run_job

from harness import free_port

pytestmark = pytest.mark.gpu

COMMON = r"""
import torch

def nbytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)

def figures(port, model, opt, want_tokens):
    def ready():
        m = scrape(port)
        t = [v for _, v in rank0(m, "vramwatch_training_tokens_total")]
        roles = {lab["role"]: v for lab, v in rank0(m, "vramwatch_memory_role_bytes")}
        state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.is_cuda]
        # a walk runs every role_interval: a short run may end before one has seen the optimizer's state
        done = t == [float(want_tokens)] and roles.get("parameters") and roles.get("optimizer_state") == nbytes(state)
        return (m, roles, state) if done else None
    m, roles, state = wait(ready, 30, "the tokens and the roles (optimizer state included)")
    return {
        "gpu": torch.cuda.get_device_name(0),
        "roles": roles,
        "expected": {"parameters": nbytes(model.parameters()), "optimizer_state": nbytes(state)},
        "tokens_scraped": [v for _, v in rank0(m, "vramwatch_training_tokens_total")][0],
        "tokens_expected": want_tokens,
        "samples_scraped": [v for _, v in rank0(m, "vramwatch_training_samples_total")],
    }
"""

HF_JOB = (
    r"""
port, spool = int(sys.argv[1]), sys.argv[2]
os.environ["HF_HUB_OFFLINE"] = "1"
import transformers
import vramwatch
from vramwatch.integrations.hf import VramwatchCallback
"""
    + COMMON
    + r"""
class Data(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 512, (256, 128), generator=torch.Generator().manual_seed(0))
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}

torch.manual_seed(0)
cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=128)
args = transformers.TrainingArguments(
    output_dir=os.path.join(spool, "out"), per_device_train_batch_size=8, gradient_accumulation_steps=2,
    max_steps=12, logging_steps=4, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
    dataloader_num_workers=0, include_num_input_tokens_seen=True,
)
cb = VramwatchCallback(stop_on_end=False, port=port, spool_dir=spool, interval=0.2, role_interval=0.5, linger=0)
trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=args, train_dataset=Data(), callbacks=[cb])
trainer.train()
res = figures(port, trainer.model, trainer.optimizer, trainer.state.num_input_tokens_seen)
res["loop_tokens"] = 12 * 2 * 8 * 128
vramwatch.stop()
done(res)
"""
)

LIGHTNING_JOB = (
    r"""
port, spool = int(sys.argv[1]), sys.argv[2]
import lightning.pytorch as L
import vramwatch
from vramwatch.integrations.lightning import VramwatchCallback
"""
    + COMMON
    + r"""
BATCH, SEQ, ACCUM, STEPS = 8, 128, 2, 10

class TokenLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(512, 128)
        self.head = torch.nn.Linear(128, 512)
    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        return torch.nn.functional.cross_entropy(self.head(self.emb(ids)).flatten(0, 1), ids.flatten())
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
    def train_dataloader(self):
        ids = torch.randint(0, 512, (BATCH * ACCUM * STEPS, SEQ), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader([{"input_ids": x} for x in ids], batch_size=BATCH)

class Figures(L.Callback):
    # at the end of training, before the strategy's teardown moves the module and the optimizer's state to
    # the CPU (Lightning's Strategy.teardown): what a scrape shows then is what the GPU held
    def on_train_end(self, trainer, pl_module):
        self.res = figures(port, pl_module, trainer.optimizers[0], STEPS * ACCUM * BATCH * SEQ)

torch.manual_seed(0)
module = TokenLM()
cb = VramwatchCallback(stop_on_end=False, port=port, spool_dir=spool, interval=0.2, role_interval=0.5, linger=0)
check = Figures()
t = L.Trainer(max_steps=STEPS, accumulate_grad_batches=ACCUM, accelerator="gpu", devices=1, callbacks=[cb, check],
              logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
t.fit(module)
res = check.res
res["after_teardown"] = {
    "module_on": str(next(module.parameters()).device),
    "state_on": sorted({str(v.device) for st in t.optimizers[0].state.values() for v in st.values()
                        if torch.is_tensor(v)}),
}
res["samples_expected"] = STEPS * ACCUM * BATCH
vramwatch.stop()
done(res)
"""
)


def _check(r: dict) -> None:
    roles, expected = r["roles"], r["expected"]
    assert roles["parameters"] == expected["parameters"]
    assert roles["optimizer_state"] == expected["optimizer_state"]
    assert r["tokens_scraped"] == r["tokens_expected"]


def _save(name: str, r: dict) -> None:
    out = os.environ.get("OUT")
    if out:
        path = Path(out, "gpu_callbacks.json")
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**old, name: r}, indent=1) + "\n")


def test_hf_callback_watches_the_model_and_counts_the_trainers_tokens(tmp_path):
    pytest.importorskip("transformers")
    r = run_job(HF_JOB, str(free_port()), str(tmp_path / "spool"), env=job_env(one_device=True), timeout=300)
    print(json.dumps(r, indent=1))
    _save("hf", r)
    _check(r)
    assert r["tokens_expected"] == r["loop_tokens"]  # the Trainer's count is the loop's (no padding here)
    assert r["samples_scraped"] == []  # the Trainer counts no samples


def test_lightning_callback_watches_the_module_and_counts_the_batches(tmp_path):
    pytest.importorskip("lightning")
    r = run_job(LIGHTNING_JOB, str(free_port()), str(tmp_path / "spool"), env=job_env(one_device=True), timeout=300)
    print(json.dumps(r, indent=1))
    _save("lightning", r)
    _check(r)
    assert r["expected"]["optimizer_state"] > 0  # AdamW's moments, on the GPU when the figures were taken
    assert r["samples_scraped"] == [float(r["samples_expected"])]
