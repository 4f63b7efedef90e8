"""Memory by role, tokens and energy per token on a real GPU, each against an independent figure.

    python3 -m pytest -m gpu tests/gpu/test_gpu_insights.py -q

A small transformer trains on GPU 0 with vramwatch on, ``vramwatch.watch(model, optimizer)`` and
``step(tokens=...)``. The scrape is compared with what the job computes itself: parameter bytes with
``sum(p.numel() * p.element_size())``, gradients with the same sum over ``p.grad``, optimizer state
over the CUDA tensors of ``optimizer.state``, tokens with the loop's own count; joules per token from
NVML's energy counter over the same scrapes is finite and positive. With ``OUT`` set the measured
values are written to ``$OUT/gpu_insights.json`` (for benchmarks/RESULTS.md).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from jobs import job_env, run_job

from harness import free_port

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _need_torch():
    try:
        import torch  # noqa: F401 - only to know whether the job can run; CUDA is never touched here
    except ImportError:
        pytest.skip("torch is not installed")


INSIGHTS_JOB = r"""
port, spool, seconds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
import torch
import vramwatch

h = vramwatch.start(port=port, spool_dir=spool, interval=0.2, role_interval=0.5, nvml_slow_interval=1.0, linger=0)
dev = torch.device("cuda", 0)
VOCAB, D, LAYERS, BATCH, SEQ = 8192, 512, 4, 16, 256


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, D)
        layer = torch.nn.TransformerEncoderLayer(D, 8, 4 * D, batch_first=True, norm_first=True)
        self.body = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = torch.nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: one storage, counted once

    def forward(self, x):
        return self.head(self.body(self.emb(x)))


model = Tiny().to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
n_params = sum(p.numel() for p in model.parameters())
vramwatch.watch(model, opt, flops_per_token=6.0 * n_params)
tokens_per_step = BATCH * SEQ

def train_step():
    x = torch.randint(0, VOCAB, (BATCH, SEQ), device=dev)
    opt.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
    loss.backward()
    opt.step()
    vramwatch.step(loss=loss, tokens=tokens_per_step, samples=BATCH)

def energy_and_tokens(m, uuid):
    e = [v for lab, v in m.get("gpu_energy_joules_total", []) if lab.get("uuid") == uuid]
    t = [v for lab, v in rank0(m, "vramwatch_training_tokens_total")]
    return (e[0] if e else None), (t[0] if t else None)

loop_tokens = 0
for _ in range(5):  # warm-up: the allocator series exist, the energy counter has a first reading
    train_step()
    loop_tokens += tokens_per_step
torch.cuda.synchronize()
def ready():
    m = scrape(port)
    return m if rank0(m, "torch_cuda_memory_allocated_bytes") and m.get("gpu_energy_joules_total") else None

m0 = wait(ready, 30, "allocator and energy series")
uuid = rank0(m0, "torch_cuda_memory_allocated_bytes")[0][0]["uuid"]
# the scrape serves the newest sample: wait until it shows the loop's count, so both figures are of one time
wait(lambda: energy_and_tokens(scrape(port), uuid)[1] == loop_tokens, 10, "the warm-up's tokens")
m0 = scrape(port)
e0, t0 = energy_and_tokens(m0, uuid)
t_start = time.monotonic()
steps = 0
while time.monotonic() - t_start < seconds:
    train_step()
    loop_tokens += tokens_per_step
    steps += 1
torch.cuda.synchronize()
train_s = time.monotonic() - t_start
# the gradients of the last step are kept (no zero_grad after it); wait for the energy counter and a walk
wait(lambda: energy_and_tokens(scrape(port), uuid)[1] == loop_tokens, 10, "the loop's tokens")
time.sleep(2.5)  # two slow NVML reads since the last step
m_energy = scrape(port)  # the energy and tokens of the loop (a later scrape would add idle joules)

def nbytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)

cuda_state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.is_cuda]
want_roles = (nbytes(model.parameters()), nbytes(p.grad for p in model.parameters() if p.grad is not None),
              nbytes(cuda_state))

def walked():  # a walk since the last step: walks are spaced by their CPU cost (at most 0.01% of a core)
    m = scrape(port)
    r = {lab["role"]: v for lab, v in rank0(m, "vramwatch_memory_role_bytes")}
    return m if (r.get("parameters"), r.get("gradients"), r.get("optimizer_state")) == want_roles else None

t_walk = time.monotonic()
m1 = wait(walked, 30, "a role walk after the last step")
walk_wait = time.monotonic() - t_walk
e1, t1 = energy_and_tokens(m_energy, uuid)
roles = {lab["role"]: v for lab, v in rank0(m1, "vramwatch_memory_role_bytes")}
alloc = rank0(m1, "torch_cuda_memory_allocated_bytes")[0][1]
reserved = rank0(m1, "torch_cuda_memory_reserved_bytes")[0][1]
roles_cost = [v for lab, v in m1.get("vramwatch_collector_duration_seconds", []) if lab.get("collector") == "roles"]
res = {
    "gpu": torch.cuda.get_device_name(0),
    "walk_wait_seconds": walk_wait,
    "params": n_params,
    "roles": roles,
    "expected": {
        "parameters": nbytes(model.parameters()),
        "gradients": nbytes(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer_state": nbytes(cuda_state),
    },
    "allocated": alloc,
    "reserved": reserved,
    "torch_allocated": torch.cuda.memory_allocated(0),
    "tokens_scraped": t1,
    "tokens_loop": loop_tokens,
    "energy_joules": e1 - e0,
    "tokens_delta": t1 - t0,
    "joules_per_token": (e1 - e0) / (t1 - t0) if t1 > t0 else None,
    "train_seconds": train_s,
    "steps": steps,
    "tokens_per_second": steps * tokens_per_step / train_s,
    "flops_per_token": [v for lab, v in rank0(m1, "vramwatch_model_flops_per_token")],
    "role_pass_seconds": roles_cost[0] if roles_cost else None,
}
res["mfu_vs_989_tflops"] = res["tokens_per_second"] * 6.0 * n_params / 989e12
vramwatch.stop()
done(res)
"""


def test_roles_tokens_and_energy_per_token_against_independent_figures(tmp_path):
    port = free_port()
    r = run_job(INSIGHTS_JOB, str(port), str(tmp_path / "spool"), "8", env=job_env(one_device=True), timeout=240)
    print(json.dumps(r, indent=1))
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_insights.json").write_text(json.dumps(r, indent=1) + "\n")
    roles, expected = r["roles"], r["expected"]
    # each storage once; the tied head adds nothing
    assert roles["parameters"] == expected["parameters"]
    assert roles["gradients"] == expected["gradients"]
    assert roles["optimizer_state"] == expected["optimizer_state"]
    assert expected["gradients"] == expected["parameters"]  # fp32 parameters, fp32 gradients
    # the roles stack to allocated: other is the rest of it, never negative
    watched = roles["parameters"] + roles["gradients"] + roles["optimizer_state"]
    assert roles["other"] == pytest.approx(max(0.0, r["allocated"] - watched))
    assert watched <= r["allocated"] <= r["reserved"]
    assert r["tokens_scraped"] == r["tokens_loop"]
    assert r["flops_per_token"] == [6.0 * r["params"]]
    jpt = r["joules_per_token"]
    assert jpt is not None and math.isfinite(jpt) and jpt > 0, f"joules per token {jpt!r}"
    assert r["role_pass_seconds"] is not None and r["role_pass_seconds"] < 0.01
