"""OOM forensics, the window high-water mark and a Trainer run on a real GPU.

    python3 -m pytest -m gpu tests/gpu/test_gpu_oom.py -q

Each case is a fresh Python process (the job) that starts vramwatch (which spawns the node server)
and scrapes it; the pytest process never touches CUDA. Skipped without a GPU (tests/gpu/conftest.py),
without torch, and (the Trainer case) without transformers + accelerate.
"""

from __future__ import annotations

import importlib.util
import os
import pickle

import pytest
from jobs import job_env, run_job

from harness import free_port

pytestmark = pytest.mark.gpu
GIB, MIB = 1 << 30, 1 << 20


def run_one_device_job(body: str, *args: str, timeout: float = 300, **env: str) -> dict:
    return run_job(body, *args, env=job_env(one_device=True, **env), timeout=timeout)


@pytest.fixture(autouse=True)
def _need_torch():
    if importlib.util.find_spec("torch") is None:  # found, not imported: CUDA is never touched here
        pytest.skip("torch is not installed")


OOM_JOB = r"""
port, spool, snaps = int(sys.argv[1]), sys.argv[2], sys.argv[3]
import torch, vramwatch
h = vramwatch.start(port=port, spool_dir=spool, interval=0.1, oom_snapshot_dir=snaps, oom_history_entries=5000)
res = {"cuda_initialized_by_start": torch.cuda.is_initialized(), "attached_before_init": h.oom.attached}
x = torch.zeros(1 << 20, device="cuda")  # the job initialises CUDA; the next sample attaches the observer
wait(lambda: h.oom.attached, 10, "the OOM observer to attach")
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction((2 << 30) / total)  # a 2 GiB budget
keep = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(4)]  # 1 GiB held
err = None
t0 = time.time()
try:
    torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
except Exception as e:
    err = e
res["error_type"] = f"{type(err).__module__}.{type(err).__qualname__}" if err is not None else None
res["is_torch_oom"] = isinstance(err, torch.cuda.OutOfMemoryError)
res["message"] = str(err)[:400]
res["training_goes_on"] = float(torch.ones(1024, device="cuda").sum().item())
def oom_seen():
    m = scrape(port)
    ooms = rank0(m, "torch_cuda_memory_ooms_total")
    return m if ooms and ooms[0][1] >= 1 and rank0(m, "vramwatch_oom_snapshot_info") else None
m = wait(oom_seen, 30, "the OOM and its snapshot in a scrape")
res["ooms_total"] = rank0(m, "torch_cuda_memory_ooms_total")[0][1]
res["requested"] = rank0(m, "torch_cuda_memory_last_oom_requested_bytes")[0][1]
res["free"] = rank0(m, "torch_cuda_memory_last_oom_free_bytes")[0][1]
res["when"] = rank0(m, "torch_cuda_memory_last_oom_timestamp_seconds")[0][1] - t0
res["limit"] = rank0(m, "torch_cuda_memory_limit_bytes")[0][1]
res["path"] = rank0(m, "vramwatch_oom_snapshot_info")[0][0]["path"]
res["num_ooms"] = torch.cuda.memory_stats(0)["num_ooms"]
res["watcher_count"] = h.oom.count
vramwatch.stop()
done(res)
"""


def test_a_real_oom_is_counted_and_leaves_a_snapshot_memory_viz_opens(tmp_path):
    snaps = tmp_path / "snaps"
    r = run_one_device_job(OOM_JOB, str(free_port()), str(tmp_path / "spool"), str(snaps))
    print({k: v for k, v in r.items() if k != "message"})
    assert not r["cuda_initialized_by_start"] and not r["attached_before_init"]
    assert r["is_torch_oom"], r["error_type"]  # the job got torch's own OutOfMemoryError ...
    assert "Tried to allocate 4.00 GiB" in r["message"]  # ... with torch's own message
    assert r["training_goes_on"] == 1024.0
    assert r["ooms_total"] == r["num_ooms"] == 1 and r["watcher_count"] == 1
    assert r["requested"] == 4 * GIB and r["free"] > 0 and -1 <= r["when"] <= 60
    assert abs(r["limit"] - 2 * GIB) < 4 * MIB  # the fraction set mid-run is what the limit reads
    path = r["path"]
    assert os.path.dirname(path) == str(snaps) and [p.name for p in snaps.iterdir()] == [os.path.basename(path)]
    with open(path, "rb") as fh:
        snap = pickle.load(fh)
    assert snap["segments"], "no segments in the snapshot"
    held = sum(b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    assert held >= 1 * GIB
    ooms = [e for trace in snap["device_traces"] for e in trace if e.get("action") == "oom"]
    assert ooms and ooms[-1]["size"] >= 4 * GIB  # the bounded history shows the failed request
    assert any(e.get("frames") for trace in snap["device_traces"] for e in trace if e.get("action") == "alloc")


PEAK_JOB = r"""
port, spool = int(sys.argv[1]), sys.argv[2]
import torch, vramwatch
from vramwatch import spool as sp
STEP_PEAK = "torch_cuda_memory_step_peak_allocated_bytes"
h = vramwatch.start(port=port, spool_dir=spool, interval=0.02, serve="external")
x = torch.zeros(1 << 20, device="cuda")
big = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
del big
p0 = torch.cuda.max_memory_allocated()
time.sleep(0.5)  # ~25 samples of an idle job
res = {"p0": p0, "after_idle": torch.cuda.max_memory_allocated()}
leak, seen = [], []
for i in range(20):  # a leak of 8 MiB per step under 256 MiB of activations
    leak.append(torch.empty(8 << 20, dtype=torch.uint8, device="cuda"))
    act = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del act
    vramwatch.step()
    time.sleep(0.05)
    (s,) = sp.read_samples(spool, 64)
    seen.append(s.devices[0].values[STEP_PEAK])
res["seen"] = seen
res["after"] = torch.cuda.max_memory_allocated()
res["stats_peak"] = torch.cuda.memory_stats(0)["allocated_bytes.all.peak"]
vramwatch.stop()
done(res)
"""


def test_the_window_peak_shows_a_leak_and_leaves_max_memory_allocated_alone(tmp_path):
    r = run_one_device_job(PEAK_JOB, str(free_port()), str(tmp_path / "spool"))
    assert r["after_idle"] == r["p0"] >= 512 * MIB  # sampling never reset the job's peak
    assert r["after"] == r["stats_peak"] == r["p0"]  # the leak stayed below the old high
    seen = r["seen"]
    first, last = sorted(seen[:5])[2], sorted(seen[-5:])[2]  # medians: a sample may catch activations
    assert last - first >= 80 * MIB, seen  # 15 steps x 8 MiB apart: a rising series


TRAINER_JOB = r"""
port, spool = int(sys.argv[1]), sys.argv[2]
import torch, transformers, vramwatch
from vramwatch.integrations.hf import VramwatchCallback

class DS(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 64, (256, 32), generator=torch.Generator().manual_seed(0))
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}

res = {}
class Probe(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step != 10:
            return
        m = wait(lambda: (lambda m: m if [(lab["rank"], lab["local_rank"], v) for lab, v in rank0(
            m, "vramwatch_training_steps_total")] == [("0", "0", 10.0)] else None)(scrape(port)), 30,
            "10 steps in the scrape")
        ((labels, alloc),) = rank0(m, "torch_cuda_memory_allocated_bytes")
        res.update(labels=labels, allocated=alloc, torch_allocated=torch.cuda.memory_allocated(0),
                   loss=[v for _, v in rank0(m, "vramwatch_training_loss")],
                   peak=rank0(m, "torch_cuda_memory_step_peak_allocated_bytes")[0][1],
                   gpu_uuids=[lab["uuid"] for lab, _ in m.get("gpu_info", [])])

torch.manual_seed(0)
cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                              eos_token_id=0)
model = transformers.GPT2LMHeadModel(cfg)
args = transformers.TrainingArguments(output_dir=os.path.join(spool, "..", "out"), max_steps=20,
                                      per_device_train_batch_size=8, logging_steps=1, report_to=[],
                                      save_strategy="no", disable_tqdm=True)
trainer = transformers.Trainer(model=model, args=args, train_dataset=DS(),
                               callbacks=[VramwatchCallback(port=port, spool_dir=spool, interval=0.1), Probe()])
trainer.train()
res["global_step"] = trainer.state.global_step
res["device"] = str(next(model.parameters()).device)
res["stopped"] = vramwatch.current() is None
done(res)
"""


def test_a_tiny_trainer_run_on_the_gpu(tmp_path):
    for mod in ("transformers", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed")
    r = run_one_device_job(TRAINER_JOB, str(free_port()), str(tmp_path / "spool"), HF_HUB_OFFLINE="1")
    print(r)
    assert r["device"].startswith("cuda") and r["global_step"] == 20 and r["stopped"]
    labels = r["labels"]
    assert labels["device"] == "0" and labels["local_rank"] == "0" and labels["uuid"].startswith("GPU-")
    assert labels["job_id"].startswith("local-")  # a lone process: no launcher names its job
    if r["gpu_uuids"]:  # NVML's view of the card joins on the same uuid
        assert labels["uuid"] in r["gpu_uuids"]
    assert r["allocated"] > 0 and r["peak"] >= r["allocated"]  # the window's high is at least its end
    assert len(r["loss"]) == 1 and r["loss"][0] > 0
