"""What vramwatch costs a training job: direct CPU cost, step() cost, and paired step times.

    python3 benchmarks/overhead.py --workloads direct,launch_bound --out overhead-part1.json
    python3 benchmarks/overhead.py --workloads transformer,transformer_full --out overhead-part2.json
    python3 benchmarks/overhead.py --merge overhead-part1.json overhead-part2.json --out overhead.json
    python3 benchmarks/overhead.py --check overhead.json

Every run is a fresh process: forked from a parent that imported torch (and
transformers) but never initialised CUDA and never imported vramwatch
(``--isolation fork``, the default), or a new interpreter (``--isolation exec``).
Runs interleave A (without vramwatch) and B (with it), A B A B ...; the A/A
null compares each baseline with the next. Each run warms up, synchronises,
times N steps by wall clock ended by one synchronize, and reports the mean
step time (the ratio basis) and the median per-step time. B runs start
vramwatch at default settings (plus their own port and spool, and linger=0 so
their server leaves with them) and are scraped at 1 Hz by a separate process;
A runs are not scraped (nothing listens there). The segment designs (launch_bound, trainer_segments)
run several A B pairs inside one fresh process instead: see child_segments. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

WORKLOADS = (
    "direct",
    "launch_bound",
    "launch_bound_fresh",
    "transformer",
    "transformer_full",
    "trainer",
    "trainer_segments",
)
PAIR_KEYS = (
    "median_ratio",
    "min_ratio",
    "max_ratio",
    "null_median_ratio",
    "null_min_ratio",
    "null_max_ratio",
    "pairs",
    "step_times",
)
TOP_KEYS = ("in_process_cpu_share", "step_call_us", "launch_bound", "transformer", "transformer_full", "metadata")
TARGETS = {"in_process_cpu_share_max": 0.0005, "step_call_us_max": 5.0, "median_ratio_max": 1.005}

SIZES = {
    # ~2 ms launch-bound steps on an H200: ~110 small kernels per step
    "full": dict(
        mlp_layers=16,
        mlp_width=512,
        mlp_batch=256,
        tf_layers=12,
        tf_embd=768,
        tf_heads=12,
        tf_vocab=50257,
        tf_seq=1024,
        tf_batch=32,
    ),
    # CPU smoke tests
    "tiny": dict(
        mlp_layers=2,
        mlp_width=32,
        mlp_batch=8,
        tf_layers=1,
        tf_embd=32,
        tf_heads=2,
        tf_vocab=128,
        tf_seq=16,
        tf_batch=2,
    ),
}


# ----------------------------------------------------------------------------------------------
# inside a run (the child)
# ----------------------------------------------------------------------------------------------
def _noop() -> None:
    pass


def build_launch_bound(sz: dict, dev: Any) -> tuple[Any, dict]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    w = sz["mlp_width"]
    layers: list[nn.Module] = []
    for _ in range(sz["mlp_layers"]):
        layers += [nn.Linear(w, w), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(w, 1)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(sz["mlp_batch"], w, device=dev)
    y = torch.randn(sz["mlp_batch"], 1, device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    n = sum(p.numel() for p in model.parameters())
    step.watched = (model, opt)  # type: ignore[attr-defined]  # for vramwatch.watch() in B runs
    step.tokens = sz["mlp_batch"]  # type: ignore[attr-defined]
    return step, {"model": f"MLP {sz['mlp_layers']}x{w} + AdamW", "parameters": n, "batch": sz["mlp_batch"]}


def _builtin_gpt(sz: dict, dev: Any) -> Any:
    """A GPT-2-shaped causal LM in plain torch, for machines without transformers (CPU tests)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class MiniGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            e = sz["tf_embd"]
            self.tok = nn.Embedding(sz["tf_vocab"], e)
            self.pos = nn.Embedding(sz["tf_seq"], e)
            layer = nn.TransformerEncoderLayer(
                e, sz["tf_heads"], 4 * e, dropout=0.1, activation="gelu", batch_first=True, norm_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, sz["tf_layers"], enable_nested_tensor=False)
            self.norm = nn.LayerNorm(e)
            self.head = nn.Linear(e, sz["tf_vocab"], bias=False)
            self.head.weight = self.tok.weight

        def forward(self, ids):
            t = ids.shape[1]
            x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
            mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
            x = self.blocks(x, mask=mask, is_causal=True)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))

    return MiniGPT().to(dev)


def gpt2_model(sz: dict, dev: Any, model_impl: str = "auto") -> tuple[Any, str]:
    """GPT-2 of ``sz``'s shape with random weights on ``dev``: transformers' (hf) or a plain-torch one."""
    import torch

    impl = model_impl
    model = None
    if impl in ("auto", "hf"):
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
            cfg = GPT2Config(
                n_layer=sz["tf_layers"],
                n_embd=sz["tf_embd"],
                n_head=sz["tf_heads"],
                vocab_size=sz["tf_vocab"],
                n_positions=sz["tf_seq"],
            )
            try:
                with torch.device(dev):  # random weights made on the device: no slow CPU init
                    model = GPT2LMHeadModel(cfg)
            except Exception:  # noqa: BLE001 - older stacks: build on the CPU, then move
                model = GPT2LMHeadModel(cfg).to(dev)
            impl = "transformers.GPT2LMHeadModel"
        except ImportError:
            if impl == "hf":
                raise
            impl = "builtin"
    if model is None:
        model = _builtin_gpt(sz, dev)
        impl = "builtin MiniGPT (torch.nn.TransformerEncoder)"
    model.train()
    return model, impl


def build_transformer(sz: dict, dev: Any, model_impl: str = "auto") -> tuple[Any, dict]:
    import torch

    model, impl = gpt2_model(sz, dev, model_impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, sz["tf_vocab"], (sz["tf_batch"], sz["tf_seq"]), device=dev)
    hf = impl.startswith("transformers")

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss if hf else model(ids)
        loss.backward()
        opt.step()
        return loss

    n = sum(p.numel() for p in model.parameters())
    step.watched = (model, opt)  # type: ignore[attr-defined]
    step.tokens = sz["tf_batch"] * sz["tf_seq"]  # type: ignore[attr-defined]
    return step, {
        "model": impl,
        "parameters": n,
        "batch": sz["tf_batch"],
        "seq": sz["tf_seq"],
        "precision": "fp32 weights, bf16 autocast",
        "optimizer": "AdamW",
    }


def _trainer_for(spec: dict[str, Any], dev: Any, callbacks: list[Any], count_tokens: bool) -> tuple[Any, dict]:
    """transformers' Trainer over GPT-2 of ``spec``'s shape (random weights, random tokens, never-ending data):
    the trainer and a description of the model and loop. ``count_tokens``: include_num_input_tokens_seen."""
    import torch
    from transformers import Trainer, TrainingArguments

    sz = spec["sizes"]
    model, impl = gpt2_model(sz, dev, "hf")
    seq, batch = sz["tf_seq"], sz["tf_batch"]
    rows = torch.randint(0, sz["tf_vocab"], (64, seq))

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 10**7

        def __getitem__(self, i: int) -> dict[str, Any]:
            ids = rows[i % len(rows)]
            return {"input_ids": ids, "labels": ids}

    targs = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="vwbench-trainer-"),
        per_device_train_batch_size=batch,
        max_steps=10**6,
        learning_rate=1e-4,
        optim="adamw_torch",
        bf16=dev.type == "cuda",
        use_cpu=dev.type != "cuda",
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        include_num_input_tokens_seen=bool(count_tokens),
    )
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(), callbacks=callbacks)
    info = {
        "model": impl,
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch": batch,
        "seq": seq,
        "precision": "bf16 mixed (Trainer bf16=True)" if dev.type == "cuda" else "fp32",
        "optimizer": "AdamW (adamw_torch)",
        "loop": f"transformers.Trainer {__import__('transformers').__version__}",
    }
    return trainer, info


def run_trainer(spec: dict[str, Any], dev: Any, watched: bool) -> dict[str, Any]:
    """GPT-2 trained by transformers' Trainer for a timed window; with ``watched``, vramwatch's Trainer
    callback (watch(), tokens from ``include_num_input_tokens_seen``, the heartbeat, the logged loss).

    Steps are timed by a callback of the benchmark's own (on_step_end): after warm-up one synchronize opens
    the window, and the first step end past ``run_s`` closes it with another and stops training."""
    import torch
    from transformers import TrainerCallback

    sync = torch.cuda.synchronize if dev.type == "cuda" else _noop
    marks: dict[str, Any] = {"steps": []}

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.t0 = time.perf_counter()
            self.n = 0
            self.last = 0.0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t0 = time.perf_counter()  # the warm-up counts from the start of training, not the build

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.n += 1
            now = time.perf_counter()
            if "start" not in marks:
                if self.n >= spec["warmup_steps"] and now - self.t0 >= spec["warmup_s"]:
                    sync()
                    marks.update(start=time.perf_counter(), wall0=time.time(), warmup_steps=self.n)
                    marks["threads0"] = common.thread_cpu_seconds("vramwatch")
                    self.last = marks["start"]
                return
            marks["steps"].append(now - self.last)
            self.last = now
            if now - marks["start"] >= spec["run_s"]:
                sync()
                marks.update(end=time.perf_counter(), wall1=time.time())
                marks["threads1"] = common.thread_cpu_seconds("vramwatch")
                control.should_training_stop = True

    callbacks: list[Any] = [Clock()]
    count_tokens = watched or spec.get("trainer_tokens_in_a", False)
    if watched:
        from vramwatch.integrations.hf import VramwatchCallback

        callbacks.insert(0, VramwatchCallback())
    trainer, info = _trainer_for(spec, dev, callbacks, bool(count_tokens))
    t0 = time.perf_counter()
    trainer.train()
    if "end" not in marks:
        raise RuntimeError(f"the Trainer stopped before the timed window closed: {marks}")
    wall = marks["end"] - marks["start"]
    steps = len(marks["steps"])
    out: dict[str, Any] = {
        "warmup_steps": marks["warmup_steps"],
        "steps": steps,
        "wall_s": wall,
        "step_time_s": wall / steps,
        "median_step_s": statistics.median(marks["steps"]),
        "window": [marks["wall0"], marks["wall1"]],
        "warmup_s": marks["start"] - t0,
        "trainer_counts_tokens": bool(count_tokens),
        "model": info,
    }
    if watched:
        delta = common.cpu_delta(marks["threads0"], marks["threads1"])
        out["vramwatch_threads_cpu_s"] = delta
        out["vramwatch_cpu_share"] = sum(delta.values()) / wall if wall > 0 else None
    return out


def _timed(fn, sync, warmup_s: float, warmup_steps: int, run_s: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    n = 0
    while n < warmup_steps or time.perf_counter() - t0 < warmup_s:
        fn()
        n += 1
    sync()
    steps: list[float] = []
    wall0 = time.time()
    start = last = time.perf_counter()
    while True:
        fn()
        now = time.perf_counter()
        steps.append(now - last)
        last = now
        if now - start >= run_s:
            break
    sync()
    end = time.perf_counter()
    return {
        "warmup_steps": n,
        "steps": len(steps),
        "wall_s": end - start,
        "step_time_s": (end - start) / len(steps),
        "median_step_s": statistics.median(steps),
        "window": [wall0, time.time()],
    }


# --- CPU placement: the training thread alone on one core, everything else off it ---
def resolve_pin(value: str) -> int | None:
    """``--pin-core``: auto (the highest allowed CPU, given 4 or more), none, or a CPU number."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = []
    if value == "none":
        return None
    if value == "auto":
        return allowed[-1] if len(allowed) >= 4 else None
    try:
        core = int(value)
    except ValueError:
        raise SystemExit(f"--pin-core {value!r}: give auto, none or a CPU number") from None
    if core not in allowed or len(allowed) < 2:
        raise SystemExit(f"--pin-core {core}: needs a CPU of this process other than the only one; allowed: {allowed}")
    return core


def _pin_training_thread(pin: int | None) -> None:
    # Linux: pid 0 is the calling thread; threads it starts later (torch's) inherit the mask
    if pin is not None:
        os.sched_setaffinity(0, {pin})


def _cpus_of(tid: int) -> list[int] | None:
    try:
        return sorted(os.sched_getaffinity(tid))
    except OSError:
        return None


def _start_vramwatch(settings: dict[str, Any], pin: int | None, others: set[int] | None) -> tuple[Any, dict]:
    """Start vramwatch with the training thread unpinned, so its sampler thread and the server it spawns
    get the CPUs the training thread does not use; then pin again."""
    import vramwatch

    if pin is not None and others:
        os.sched_setaffinity(0, others)
    t0 = time.perf_counter()
    handle = vramwatch.start(**settings)
    if settings.get("simulate"):  # --simulate: one device in use, as after the job's first CUDA tensor
        handle.sim.init(0)
        handle.sim.allocate(1 << 30)
    health = handle.url[: -len("/metrics")] + "/-/healthy"
    up = common.wait_http(health, timeout=20.0)
    # the share is per interval's sample: the figure holds for the interval it ran at (the default unless set)
    info: dict[str, Any] = {
        "server_up": up,
        "vramwatch_start_s": time.perf_counter() - t0,
        "sample_interval_s": handle.settings.interval,
    }
    _pin_training_thread(pin)
    if not up:  # a B run without its server is not the condition we claim to measure
        raise RuntimeError(
            "vramwatch's server did not answer within 20 s; server.log:\n"
            + _tail(os.path.join(handle.spool_dir, "server.log"))
        )
    server_pid = _server_pid(handle)
    info["server_pid"] = server_pid
    if pin is not None:
        info["server_cpus"] = _cpus_of(server_pid) if server_pid else None
        info["sampler_cpus"] = next(
            (_cpus_of(t.native_id) for t in threading.enumerate() if t.name == "vramwatch-sampler" and t.native_id),
            None,
        )
    return vramwatch, info


def instrument_sample_parts() -> dict[str, float]:
    """Count, by part, the CPU time (the calling thread's clock) a sample spends: the whole ``tick``, the
    allocator read, the largest-free-block snapshot inside it, the heartbeat (loss read) and the publish.
    Wraps vramwatch's classes in this (benchmark) process only; a few clock reads per sample."""
    from vramwatch import spool
    from vramwatch.rank import allocator, heartbeat, roles
    from vramwatch.rank import handle as runtime

    acc: dict[str, float] = {}

    def wrap(cls: Any, name: str, part: str) -> None:
        orig = getattr(cls, name)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.thread_time()
            try:
                return orig(*a, **k)
            finally:
                acc[part] = acc.get(part, 0.0) + time.thread_time() - t0

        setattr(cls, name, timed)

    wrap(runtime.Handle, "tick", "tick")
    wrap(allocator.AllocatorSampler, "read", "allocator_read")
    wrap(allocator.TorchSource, "snapshot", "largest_block_snapshot")
    wrap(heartbeat.Heartbeat, "snapshot", "heartbeat_and_loss")
    wrap(spool.RankPublisher, "publish", "publish")
    wrap(roles.RoleWalker, "poll", "memory_by_role_walk")
    return acc


def _measure(
    fn: Any,
    sync: Any,
    spec: dict[str, Any],
    run_s: float,
    server_pid: int | None,
    watched: bool,
    parts: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Warm up, then time ``run_s`` of steps; with vramwatch running, the CPU its threads and server spent
    (and, given ``parts`` from instrument_sample_parts, how the samples in the window spent theirs)."""
    before = common.thread_cpu_seconds("vramwatch")
    marks: dict[str, Any] = {}

    def sync_and_mark() -> None:
        # the window starts after warmup: re-read the clocks there (cheap), inside _timed's sync
        sync()
        if "t0" not in marks:
            marks["t0"] = time.perf_counter()
            marks["threads0"] = common.thread_cpu_seconds("vramwatch")
            marks["server0"] = common.proc_cpu_seconds(server_pid) if server_pid else None
            marks["parts0"] = dict(parts or {})

    tw = time.perf_counter()
    r = _timed(fn, sync_and_mark, spec["warmup_s"], spec["warmup_steps"], run_s)
    t1 = time.perf_counter()
    threads1 = common.thread_cpu_seconds("vramwatch")
    server1 = common.proc_cpu_seconds(server_pid) if server_pid else None
    r["warmup_s"] = marks["t0"] - tw
    if watched:
        delta = common.cpu_delta(marks["threads0"], threads1)
        window = t1 - marks["t0"]
        r["vramwatch_threads_cpu_s"] = delta
        r["vramwatch_cpu_share"] = sum(delta.values()) / window if window > 0 else None
        r["vramwatch_threads_cpu_s_incl_warmup"] = common.cpu_delta(before, threads1)
        if server1 is not None and marks.get("server0") is not None:
            r["server_cpu_share"] = (server1 - marks["server0"]) / window if window > 0 else None
        if parts is not None and window > 0:
            r["sample_parts_cpu_share"] = {k: (v - marks["parts0"].get(k, 0.0)) / window for k, v in parts.items()}
    return r


def _with_step(vw: Any, step_fn: Any, pass_loss: bool, watch: bool = True) -> Any:
    """The B runs' step: the workload, then vramwatch.step(); with ``watch`` (the default) the model and
    optimizer are watched (memory by role) and each step reports its tokens, as a job using both would."""
    vstep = vw.step
    if watch:
        model, opt = step_fn.watched
        vw.watch(model, opt, flops_per_token=6.0 * sum(p.numel() for p in model.parameters()))
        tokens = step_fn.tokens
        if pass_loss:

            def fn():
                vstep(loss=step_fn(), tokens=tokens)
        else:

            def fn():
                step_fn()
                vstep(tokens=tokens)

        return fn
    if pass_loss:

        def fn():
            vstep(loss=step_fn())
    else:

        def fn():
            step_fn()
            vstep()

    return fn


def _torch_for(spec: dict[str, Any]) -> tuple[Any, Any]:
    import torch

    dev = torch.device(spec["device"])
    if dev.type == "cpu":
        torch.set_num_threads(1)
    return torch, dev


def _device_facts(torch: Any, dev: Any, out: dict[str, Any]) -> None:
    if dev.type == "cuda":
        out["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["device_name"] = torch.cuda.get_device_name(0)
    out["torch"] = torch.__version__
    out["torch_cuda"] = getattr(torch.version, "cuda", None)


def child_main(spec: dict[str, Any]) -> dict[str, Any]:
    """One fresh-process run: A (vramwatch never imported) or B (started before the model is built)."""
    torch, dev = _torch_for(spec)
    out: dict[str, Any] = {"kind": spec["kind"], "workload": spec["workload"], "pid": os.getpid()}
    phases: dict[str, float] = {}
    out["phases_s"] = phases
    pin = spec.get("pin_core")
    others = set(os.sched_getaffinity(0)) if pin is not None else None
    tp = time.perf_counter()
    vw = None
    server_pid = None
    parts = instrument_sample_parts() if spec.get("parts") else None
    if spec.get("vramwatch") is not None:
        vw, info = _start_vramwatch(spec["vramwatch"], pin, others)
        out.update(info)
        server_pid = info.get("server_pid")
    else:
        _pin_training_thread(pin)
    out["pinned_core"] = pin
    phases["vramwatch_start"] = time.perf_counter() - tp
    tp = time.perf_counter()
    if dev.type == "cuda":
        torch.cuda.init()
    if spec["workload"] == "trainer":
        r = run_trainer(spec, dev, watched=vw is not None)
        phases["build_and_warmup"] = r.pop("warmup_s")
        out.update(r)
        _device_facts(torch, dev, out)
        out["vramwatch_loaded"] = "vramwatch" in sys.modules
        if vw is not None:
            vw.stop()
        return out
    if spec["workload"] == "transformer":
        step_fn, winfo = build_transformer(spec["sizes"], dev, spec.get("model", "auto"))
    else:
        step_fn, winfo = build_launch_bound(spec["sizes"], dev)
    out["model"] = winfo
    phases["build"] = time.perf_counter() - tp
    sync = torch.cuda.synchronize if dev.type == "cuda" else _noop
    fn = _with_step(vw, step_fn, spec.get("pass_loss", True), spec.get("watch", True)) if vw is not None else step_fn
    run_s = spec["direct_s"] if spec.get("direct") else spec["run_s"]
    r = _measure(fn, sync, spec, run_s, server_pid, watched=vw is not None, parts=parts)
    phases["warmup"] = r.pop("warmup_s")
    out.update(r)
    if vw is not None and spec.get("direct") and spec.get("step_calls"):
        out["step_call"] = _time_step_calls(vw, step_fn, spec["step_calls"], spec["step_repeats"])
    _device_facts(torch, dev, out)
    out["threads"] = sorted({t for t in common.thread_cpu_seconds("")})
    out["vramwatch_loaded"] = "vramwatch" in sys.modules
    if vw is not None:
        vw.stop()
    return out


def segment_kinds(pairs: int, order: str) -> list[str]:
    """The kinds of ``pairs`` pairs of segments, in time order. ``ab``: A B A B ...; ``abba``: A B B A A B B A
    ..., the order inside a pair alternating, so a drift over a few segments adds to half the pairs' ratios
    and takes from the other half (spread, not bias), and vramwatch starts every other pair, not every pair."""
    if order == "ab":
        return ["A", "B"] * pairs
    if order == "abba":
        return [k for i in range(pairs) for k in (("A", "B") if i % 2 == 0 else ("B", "A"))]
    raise ValueError(f"segment order {order!r}: give ab or abba")


def child_segments(spec: dict[str, Any]) -> dict[str, Any]:
    """Several A B pairs in one process: the model is built once, then segments alternate A (vramwatch not
    running: never imported in the first, stopped and its server gone in the others) and B (vramwatch
    started fresh, as a fresh-process B run starts it). What differs between processes (where memory
    lands, the state of the host) is shared by both halves of a pair instead of adding to its ratio.
    The trainer workload trains without a break instead (run_trainer_segments)."""
    torch, dev = _torch_for(spec)
    pin = spec.get("pin_core")
    others = set(os.sched_getaffinity(0)) if pin is not None else None
    _pin_training_thread(pin)
    out: dict[str, Any] = {"kind": "AB", "workload": spec["workload"], "pid": os.getpid(), "pinned_core": pin}
    tp = time.perf_counter()
    if dev.type == "cuda":
        torch.cuda.init()
    kinds = segment_kinds(spec["pairs_in_process"], spec.get("segment_order", "ab"))
    out["order"] = "".join(kinds)
    if spec["workload"] == "trainer":
        out.update(run_trainer_segments(spec, dev, kinds, pin, others))
        _device_facts(torch, dev, out)
        return out
    step_fn, winfo = build_launch_bound(spec["sizes"], dev)
    out["model"] = winfo
    out["build_s"] = time.perf_counter() - tp
    sync = torch.cuda.synchronize if dev.type == "cuda" else _noop
    segments: list[dict[str, Any]] = []
    out["segments"] = segments
    for i, kind in enumerate(kinds):
        seg: dict[str, Any] = {
            "kind": kind,
            "workload": spec["workload"],
            "pair_in_process": i // 2,
            "pid": os.getpid(),
            "pinned_core": pin,
            "model": winfo,
            "vramwatch_loaded": "vramwatch" in sys.modules,
        }
        if kind == "A" or spec.get("vramwatch") is None:  # None: --sham, B segments left alone too
            seg.update(_measure(step_fn, sync, spec, spec["run_s"], None, watched=False))
            seg["vramwatch_threads"] = sorted(common.thread_cpu_seconds("vramwatch"))
        else:
            seg.update(_b_segment(spec, step_fn, sync, pin, others))
        segments.append(seg)
    _device_facts(torch, dev, out)
    return out


def _callback_gate(base: type) -> Any:
    """A Trainer callback that relays every event (``on_*``) to ``gate.inner`` while ``gate.on``, and
    does nothing otherwise: the user's callback, switched on and off between segments."""

    class Gate(base):
        def __init__(self) -> None:
            self.inner: Any = None
            self.on = False

    def relay(event: str) -> Any:
        def method(self: Any, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            if self.on and self.inner is not None:
                return getattr(self.inner, event)(args, state, control, **kw)
            return None

        return method

    for event in [n for n in dir(base) if n.startswith("on_")]:
        setattr(Gate, event, relay(event))
    return Gate()


def probe_vramwatch(port: int | None, server_pid: int | None) -> dict[str, Any]:
    """What of vramwatch is alive in and beside this process now: its threads, whether the (last) B
    segment's server port accepts a connection, whether that server process runs, whether a handle is
    started. Read off the clock, at a segment's end."""
    answers = None
    if port is not None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                answers = True
        except OSError:
            answers = False
    vw = sys.modules.get("vramwatch")
    return {
        "vramwatch_threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("vramwatch")),
        "server_port": port,
        "server_port_answers": answers,
        "server_pid": server_pid,
        "server_alive": common.pid_alive(server_pid) if server_pid else None,
        "vramwatch_started": vw is not None and vw.current() is not None,
    }


def run_trainer_segments(
    spec: dict[str, Any], dev: Any, kinds: list[str], pin: int | None, others: set[int] | None
) -> dict[str, Any]:
    """The trainer workload as segments of one run: a Trainer trains without a break while a callback of
    the benchmark's own (on_step_end) cuts the steps into segments of ``kinds``.

    After the warm-up (``first_warmup_s``, at least ``warmup_steps``), every segment: switch vramwatch on or
    off if its kind differs from the last one's, let ``warmup_s`` of steps pass untimed (at least
    ``warmup_steps``; the settle, at every boundary, switched or not), synchronize, time steps until the
    first step end past ``run_s``, synchronize: the segment's step time is that wall time over its steps.
    Then probe_vramwatch (off the clock). Whole pairs only: training stops after the last pair, or
    after a pair when the slowest pair so far would end past ``deadline_wall``.

    B: vramwatch started fresh (its own server, the scraper on it), VramwatchCallback relayed every Trainer
    event, its on_train_begin called at the switch (watch() of the Trainer's model and optimizer, the
    token count's start) and the Trainer counting tokens. A: the callback gets no event, vramwatch is
    stopped and its server gone, and the Trainer's token count is off (unless ``trainer_tokens_in_a``):
    what the callback's tokens cost the Trainer is counted to vramwatch, as in the fresh-process pairs.
    ``vramwatch`` None (--sham): B segments run as A ones."""
    import torch
    from transformers import TrainerCallback

    sync = torch.cuda.synchronize if dev.type == "cuda" else _noop
    live = spec.get("vramwatch") is not None
    tokens_in_a = bool(spec.get("trainer_tokens_in_a"))
    deadline = spec.get("deadline_wall") or float("inf")
    gate = _callback_gate(TrainerCallback)
    running = contextlib.ExitStack()
    segments: list[dict[str, Any]] = []
    # the kind running now; the last B segment's server (port, pid, what its records carry)
    seen: dict[str, Any] = {"kind": "A", "port": None, "server_pid": None, "server": {}}
    tokens: dict[str, Any] = {}

    def switch(kind: str, args: Any, state: Any, control: Any, kw: dict[str, Any]) -> dict[str, Any]:
        info: dict[str, Any] = {}
        if kind == "B":
            _, info = running.enter_context(_vramwatch_running(spec, pin, others))
            seen.update(port=info["server_port"], server_pid=info.get("server_pid"))
            seen["server"] = {k: info.get(k) for k in ("scrape_url", "server_port", "server_pid")}
            if gate.inner is None:
                from vramwatch.integrations.hf import VramwatchCallback

                gate.inner = VramwatchCallback()
            if not tokens_in_a:
                args.include_num_input_tokens_seen = tokens["on"]
            gate.inner.on_train_begin(args, state, control, **kw)  # as the Trainer calls it: watch(), tokens
            gate.on = True
        else:
            gate.on = False
            gate.inner.on_train_end(args, state, control, **kw)  # leaves the exporter: it did not start it
            running.close()  # vramwatch.stop(), its server gone
            if not tokens_in_a:
                args.include_num_input_tokens_seen = tokens["off"]
        seen["kind"] = kind
        return info

    class SegmentClock(TrainerCallback):
        def __init__(self) -> None:
            self.i = -1  # the segment now; -1: the warm-up
            self.timing = False
            self.n = 0
            self.t0 = self.start = self.last = self.pair_t0 = 0.0
            self.need_s = spec.get("first_warmup_s", spec["warmup_s"])
            self.seg: dict[str, Any] = {}
            self.pair_s: list[float] = []
            self.warmup_steps = 0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t0 = time.perf_counter()
            on = args.include_num_input_tokens_seen  # the TrainingArguments normalise a bool ("all"/"no")
            tokens.update(on=on if tokens_in_a else ("all" if isinstance(on, str) else True), off=on)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            now = time.perf_counter()
            self.n += 1
            if not self.timing:
                if self.n >= spec["warmup_steps"] and now - self.t0 >= self.need_s:
                    if self.i < 0:
                        self.warmup_steps = self.n
                        self.enter(0, args, state, control, kw)
                    else:
                        self.open(state)
                return
            self.seg["step_s"].append(now - self.last)
            self.last = now
            if now - self.start < spec["run_s"]:
                return
            self.close(state)
            nxt = self.i + 1
            if nxt % 2 == 0:  # a pair is in
                self.pair_s.append(time.perf_counter() - self.pair_t0)
                if nxt == len(kinds) or time.time() + max(self.pair_s) > deadline:
                    control.should_training_stop = True
                    return
            self.enter(nxt, args, state, control, kw)

        def enter(self, i: int, args: Any, state: Any, control: Any, kw: dict[str, Any]) -> None:
            kind = kinds[i]
            t = time.perf_counter()
            if i % 2 == 0:
                self.pair_t0 = t
            switched = live and kind != seen["kind"]
            info = switch(kind, args, state, control, kw) if switched else {}
            if live and kind == "B" and not switched:  # the server of the B segment before it goes on
                info = dict(seen["server"])
            self.seg = {
                "kind": kind,
                "workload": spec["workload"],
                "segment": i,
                "pair_in_process": i // 2,
                "pid": os.getpid(),
                "pinned_core": pin,
                "switched": switched,
                "switch_s": time.perf_counter() - t,
                "vramwatch_loaded": "vramwatch" in sys.modules,
                "trainer_counts_tokens": args.include_num_input_tokens_seen not in ("no", False, None),
                "step_s": [],
                **info,
            }
            self.i, self.n, self.timing = i, 0, False
            self.t0 = time.perf_counter()
            self.need_s = spec["warmup_s"]

        def open(self, state: Any) -> None:
            sync()
            self.start = self.last = time.perf_counter()
            seg = self.seg
            seg.update(settle_steps=self.n, settle_s=self.start - self.t0, wall0=time.time())
            seg["tokens0"] = state.num_input_tokens_seen
            seg["threads0"] = common.thread_cpu_seconds("vramwatch")
            seg["server0"] = common.proc_cpu_seconds(seg["server_pid"]) if seg.get("server_pid") else None
            self.timing = True

        def close(self, state: Any) -> None:
            sync()
            end = time.perf_counter()
            seg, steps = self.seg, self.seg.pop("step_s")
            wall = end - self.start
            seg.update(
                tokens_counted=state.num_input_tokens_seen - seg.pop("tokens0"),  # by the Trainer, in the window
                steps=len(steps),
                wall_s=wall,
                step_time_s=wall / len(steps),
                median_step_s=statistics.median(steps),
                window=[seg.pop("wall0"), time.time()],
            )
            threads0, server0 = seg.pop("threads0"), seg.pop("server0")
            if seg["kind"] == "B" and live:
                delta = common.cpu_delta(threads0, common.thread_cpu_seconds("vramwatch"))
                seg["vramwatch_threads_cpu_s"] = delta
                seg["vramwatch_cpu_share"] = sum(delta.values()) / wall
                server1 = common.proc_cpu_seconds(seg["server_pid"]) if seg.get("server_pid") else None
                if server0 is not None and server1 is not None:
                    seg["server_cpu_share"] = (server1 - server0) / wall
            seg["probe"] = probe_vramwatch(seen["port"], seen["server_pid"])
            segments.append(seg)
            self.timing = False

    clock = SegmentClock()
    trainer, info = _trainer_for(spec, dev, [gate, clock], tokens_in_a)
    t0 = time.perf_counter()
    failure = None
    try:
        trainer.train()
    except Exception:  # keep the whole pairs measured before it (minutes of GPU time)
        whole = len(segments) - len(segments) % 2
        if whole < 2:
            raise
        del segments[whole:]
        failure = traceback.format_exc()
    finally:
        running.close()
    if len(segments) < 2:
        raise RuntimeError(f"the Trainer stopped before a pair of segments was in ({len(segments)} segments)")
    return {
        "failure": failure,
        "model": info,
        "segments": segments,
        "warmup_steps": clock.warmup_steps,
        "train_s": time.perf_counter() - t0,
        "pair_s": clock.pair_s,
        "truncated": len(segments) < len(kinds),
    }


@contextlib.contextmanager
def _vramwatch_running(
    spec: dict[str, Any], pin: int | None, others: set[int] | None
) -> Iterator[tuple[Any, dict[str, Any]]]:
    """vramwatch started fresh for one B segment (its own port and spool, the parent's scraper pointed at
    it), then stopped with its server gone, so the next A segment runs without any of it."""
    external = spec.get("external_server")  # a sidecar-style server the harness runs for the whole process
    if external:
        port, spool = external["port"], external["spool_dir"]
        settings = {"serve": "external", "port": port, "spool_dir": spool, **spec["vramwatch"]}
    else:
        port = common.free_port()
        spool = tempfile.mkdtemp(prefix="vwbench-", dir=spec["spool_root"])
        settings = {"port": port, "spool_dir": spool, "linger": 0.0, **spec["vramwatch"]}
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        vw, seg = _start_vramwatch(settings, pin, others)
        if not external:
            common.write_url_file(spec["scrape_url_file"], url)  # the parent's 1 Hz scraper follows it
        seg["scrape_url"] = url
        seg["server_port"] = port
        yield vw, seg
    finally:
        import vramwatch

        vramwatch.stop()
        if not external:
            common.write_url_file(spec["scrape_url_file"], "")
            server_pid = common.server_pid_in(spool)
            if server_pid:  # its server would otherwise linger into the next A segment
                common.stop_pid(server_pid)
            shutil.rmtree(spool, ignore_errors=True)


def _b_segment(
    spec: dict[str, Any], step_fn: Any, sync: Any, pin: int | None, others: set[int] | None
) -> dict[str, Any]:
    with _vramwatch_running(spec, pin, others) as (vw, seg):
        seg.update(
            _measure(
                _with_step(vw, step_fn, spec.get("pass_loss", True), spec.get("watch", True)),
                sync,
                spec,
                spec["run_s"],
                seg.get("server_pid"),
                watched=True,
            )
        )
        seg["threads"] = sorted(common.thread_cpu_seconds(""))
        seg["vramwatch_loaded"] = "vramwatch" in sys.modules
    return seg


def _server_pid(handle: Any) -> int | None:
    return None if handle is None else common.server_pid_in(handle.spool_dir)


def _time_step_calls(vw: Any, step_fn: Any, number: int, repeats: int) -> dict[str, Any]:
    import timeit

    loss = step_fn()  # a real loss tensor, as a job would pass it

    def per_call_us(stmt: str, g: dict) -> list[float]:
        return [t / number * 1e6 for t in timeit.Timer(stmt, globals=g).repeat(repeat=repeats, number=number)]

    plain = per_call_us("step()", {"step": vw.step})
    with_loss = per_call_us("step(loss=loss)", {"step": vw.step, "loss": loss})
    with_tokens = per_call_us("step(loss=loss, tokens=4096, samples=8)", {"step": vw.step, "loss": loss})
    noop = per_call_us("f()", {"f": _noop})
    return {
        "number": number,
        "repeats": repeats,
        "step_us": plain,
        "median_us": statistics.median(plain),
        "min_us": min(plain),
        "step_with_loss_us": with_loss,
        "with_loss_median_us": statistics.median(with_loss),
        "step_with_tokens_us": with_tokens,
        "with_tokens_median_us": statistics.median(with_tokens),
        "noop_call_us": statistics.median(noop),
    }


def _child_entry(spec: dict[str, Any]) -> int:
    code = 1
    try:
        res = child_segments(spec) if spec.get("pairs_in_process") else child_main(spec)
        common.write_json(spec["result"], res)
        code = 0
    except BaseException:  # noqa: BLE001 - report whatever broke the run
        try:
            common.write_json(spec["result"], {"error": traceback.format_exc()})
        except Exception:  # noqa: BLE001
            pass
    return code


# ----------------------------------------------------------------------------------------------
# the orchestrator (the parent)
# ----------------------------------------------------------------------------------------------
class Runner:
    def __init__(self, args: argparse.Namespace, workdir: str) -> None:
        self.args = args
        self.workdir = workdir
        self.n = 0
        self.scraper = common.Scraper(workdir, args.scrape_interval)
        self.shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else workdir

    def close(self) -> None:
        self.scraper.close()

    def _spec(self, workload: str, kind: str, **extra: Any) -> tuple[dict[str, Any], str, str]:
        a = self.args
        self.n += 1
        result = os.path.join(self.workdir, f"run-{self.n:03d}.json")
        logf = os.path.join(self.workdir, f"run-{self.n:03d}.log")
        spec: dict[str, Any] = {
            "workload": workload,
            "kind": kind,
            "device": a.device,
            "sizes": a.sizes,
            "model": a.model,
            "warmup_s": a.warmup_seconds,
            "warmup_steps": a.warmup_steps,
            "run_s": a.run_seconds,
            "result": result,
            "pass_loss": not a.no_loss,
            "watch": not a.no_watch,
            "pin_core": a.pin,
            "trainer_tokens_in_a": a.trainer_tokens_in_a,
            **extra,
        }
        return spec, result, logf

    def _run_spec(self, spec: dict[str, Any], result: str, logf: str, timeout: float) -> dict[str, Any]:
        res = self._attempt(spec, result, logf, timeout)
        if "error" in res and self.args.isolation == "fork" and _FORK_TROUBLE.search(res["error"] + _tail(logf)):
            common.progress("a forked run could not initialise CUDA; using --isolation exec from now on")
            self.args.isolation = "exec"
            res = self._attempt(spec, result, logf, timeout)
        self.scraper.set_url("")
        if "error" in res:
            res["log_tail"] = _tail(logf)
        return res

    def run(self, workload: str, kind: str, vw: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        """One run in a fresh process."""
        a = self.args
        spec, result, logf = self._spec(workload, kind, **extra)
        spool = None
        url = ""
        if vw is not None:
            port = common.free_port()
            spool = tempfile.mkdtemp(prefix="vwbench-", dir=self.shm)
            settings = {"port": port, "spool_dir": spool, "linger": 0.0}
            if a.simulate:
                settings["simulate"] = True
            if vw.get("oom_history_entries"):
                settings["oom_snapshot_dir"] = os.path.join(self.workdir, f"oom-{self.n:03d}")
            settings.update(vw)
            spec["vramwatch"] = settings
            url = f"http://127.0.0.1:{port}/metrics"
            self.scraper.set_url(url)
        t0 = time.monotonic()
        res = self._run_spec(spec, result, logf, a.run_timeout + (spec.get("direct_s", 0) or 0))
        res["process_s"] = time.monotonic() - t0
        if vw is not None:
            if res.get("server_pid"):
                common.stop_pid(int(res["server_pid"]))  # its server would otherwise linger a second
            if res.get("window"):
                res["scrapes"] = common.summarize_scrapes(self.scraper.records(url, *res["window"]))
            shutil.rmtree(spool, ignore_errors=True)
        return res

    def run_segments(
        self, workload: str, pairs: int, vw: dict[str, Any] | None, deadline: float = float("inf")
    ) -> dict[str, Any]:
        """``pairs`` A B pairs of segments in one fresh process (see child_segments); the trainer workload
        stops after the last pair that ends before ``deadline`` (time.monotonic())."""
        a = self.args
        spec, result, logf = self._spec(
            workload,
            "AB",
            pairs_in_process=pairs,
            vramwatch=vw,
            spool_root=self.shm,
            scrape_url_file=self.scraper.url_file,
            segment_order=a.segment_order or ("abba" if workload == "trainer" else "ab"),
            first_warmup_s=a.warmup_seconds,
        )
        if deadline != float("inf"):
            spec["deadline_wall"] = time.time() + deadline - time.monotonic()
        if a.segment_seconds is not None:
            spec["run_s"] = a.segment_seconds
        if a.segment_warmup_seconds is not None:
            spec["warmup_s"] = a.segment_warmup_seconds
        server = self._external_server() if a.segment_server == "external" and vw is not None else None
        if server:
            spec["external_server"] = {k: server[k] for k in ("port", "spool_dir")}
            self.scraper.set_url(f"http://127.0.0.1:{server['port']}/metrics")
        t0 = time.monotonic()
        try:
            res = self._run_spec(
                spec, result, logf, a.run_timeout + pairs * 2 * (spec["run_s"] + a.warmup_seconds + 25)
            )
        finally:
            if server:
                server["proc"].terminate()
                try:
                    server["proc"].wait(timeout=10)
                except subprocess.TimeoutExpired:
                    server["proc"].kill()
                shutil.rmtree(server["spool_dir"], ignore_errors=True)
        res["process_s"] = time.monotonic() - t0
        res["segment_server"] = a.segment_server
        for seg in res.get("segments", []):
            if seg.get("scrape_url") and seg.get("window"):
                seg["scrapes"] = common.summarize_scrapes(self.scraper.records(seg["scrape_url"], *seg["window"]))
        return res

    def _external_server(self) -> dict[str, Any]:
        """``vramwatch serve`` as a sidecar runs it, for one process of segments (on the harness's CPUs)."""
        port = common.free_port()
        spool = tempfile.mkdtemp(prefix="vwbench-", dir=self.shm)
        log = open(os.path.join(self.workdir, f"server-{self.n:03d}.log"), "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "vramwatch", "serve", "--port", str(port), "--spool-dir", spool],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=common.child_env(),
        )
        log.close()
        if not common.wait_http(f"http://127.0.0.1:{port}/-/healthy", timeout=20.0):
            proc.kill()
            raise RuntimeError(f"the external vramwatch server did not answer on port {port}")
        return {"port": port, "spool_dir": spool, "proc": proc}

    def _attempt(self, spec: dict[str, Any], result: str, logf: str, timeout: float) -> dict[str, Any]:
        try:
            os.unlink(result)
        except OSError:
            pass
        code = self._spawn(spec, logf, timeout)
        res: dict[str, Any]
        try:
            res = common.read_json(result)
        except (OSError, ValueError):
            res = {"error": f"no result (exit {code}); see log"}
        if code != 0 and "error" not in res:
            res["error"] = f"exit {code}"
        res["isolation"] = self.args.isolation
        return res

    def _spawn(self, spec: dict[str, Any], logf: str, timeout: float) -> int:
        if self.args.isolation == "exec":
            with open(logf, "ab") as log:
                try:
                    p = subprocess.run(
                        [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=log,
                        env=common.child_env(),
                        timeout=timeout,
                    )
                    return p.returncode
                except subprocess.TimeoutExpired:
                    return -9
        sys.stdout.flush()
        sys.stderr.flush()
        with warnings.catch_warnings():
            # Python 3.12 warns on fork() beside any thread; import torch starts one (idle, as with
            # DataLoader workers, which fork the same way); the parent holds no lock a run needs
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the run: a fresh process that has never seen vramwatch nor CUDA
            code = 1
            try:
                fd = os.open(logf, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                code = _child_entry(spec)
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                return -9
            time.sleep(0.02)


# what a forked child says when its parent had initialised the CUDA driver after all
_FORK_TROUBLE = re.compile(
    r"re-initialize CUDA in forked|initialization error|cudaErrorInitializationError|"
    r"CUDA driver initialization failed|_is_in_bad_fork",
    re.I,
)


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - n))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def run_direct(runner: Runner, args: argparse.Namespace) -> dict[str, Any]:
    """Guarantee 1's direct cost: the CPU of vramwatch's threads in the job over wall time, at defaults.

    Three runs of the launch-bound loop, each scraped at 1 Hz: ``direct`` with everything a job may turn on
    (``watch()`` memory by role, ``step(loss=, tokens=)``; unless --no-watch), which is the figure the
    guarantee states (``in_process_cpu_share``), then ``step()``'s own cost; ``direct_plain`` without
    ``watch()`` and tokens (``in_process_cpu_share_plain``); and ``direct_parts``, as ``direct`` with each
    part of a sample timed by the sampler's own clock (the clock reads are syscalls: that run's share
    includes them, so it is not the guarantee's figure)."""
    watch = not args.no_watch
    common.progress(
        f"direct cost: launch-bound loop with vramwatch at defaults{' + watch() + tokens' if watch else ''}, "
        f"{args.direct_seconds:.0f} s window, scraped every {args.scrape_interval:g} s; then "
        f"{args.step_repeats} x {args.step_calls} step() calls"
    )
    res = runner.run(
        "launch_bound",
        "B",
        {},
        direct=True,
        direct_s=args.direct_seconds,
        step_calls=args.step_calls,
        step_repeats=args.step_repeats,
        watch=watch,
    )
    if "error" in res:
        common.progress("direct cost run FAILED:\n" + res["error"] + res.get("log_tail", ""))
        return {"direct": res}
    share = res.get("vramwatch_cpu_share")
    sc = res.get("step_call", {})
    common.progress(
        f"direct cost: vramwatch threads {share * 100:.4f}% of a core over {res['wall_s']:.1f} s "
        f"(a sample every {res.get('sample_interval_s')} s) "
        f"({res.get('scrapes', {}).get('ok', 0)} scrapes ok); step() {sc.get('median_us', 0):.3f} us "
        f"median (with loss {sc.get('with_loss_median_us', 0):.3f} us, empty call "
        f"{sc.get('noop_call_us', 0):.3f} us)"
    )
    out: dict[str, Any] = {"in_process_cpu_share": share, "step_call_us": sc.get("median_us"), "direct": res}
    if watch:
        common.progress(f"direct cost without watch() and tokens: {args.direct_seconds:.0f} s window")
        plain = runner.run("launch_bound", "B", {}, direct=True, direct_s=args.direct_seconds, watch=False)
        out["direct_plain"] = plain
        if "error" in plain:
            common.progress("plain direct cost run FAILED:\n" + plain["error"] + plain.get("log_tail", ""))
        else:
            out["in_process_cpu_share_plain"] = plain.get("vramwatch_cpu_share")
            common.progress(f"direct cost without watch(): vramwatch threads {plain['vramwatch_cpu_share'] * 100:.4f}%")
    if args.direct_parts_seconds > 0:
        common.progress(f"direct cost by part of a sample: {args.direct_parts_seconds:.0f} s window, instrumented")
        parts_run = runner.run(
            "launch_bound", "B", {}, direct=True, direct_s=args.direct_parts_seconds, parts=True, watch=watch
        )
        out["direct_parts"] = parts_run
        parts = parts_run.get("sample_parts_cpu_share") or {}
        if parts:
            res["sample_parts_cpu_share"] = parts  # where they were before: the summary and readers look here
            res["sample_parts_from"] = "direct_parts"
            common.progress(
                "direct cost by part of a sample (% of a core): "
                + ", ".join(f"{k} {v * 100:.4f}" for k, v in sorted(parts.items()))
                + f"; that run's threads {parts_run['vramwatch_cpu_share'] * 100:.4f}% (with the clock reads)"
            )
        elif "error" in parts_run:
            common.progress("parts run FAILED:\n" + parts_run["error"] + parts_run.get("log_tail", ""))
    return out


def run_pairs(
    runner: Runner,
    args: argparse.Namespace,
    workload: str,
    variants: list[tuple[str, str, dict | None]],
    deadline: float,
    label: str = "",
) -> dict[str, Any]:
    """variants: (name, kind, vramwatch settings or None); the first is the shared baseline (A).
    ``label`` names the figure in progress lines (default: the workload)."""
    tag = label or workload
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    tuple_s: list[float] = []
    truncated = False
    errors = 0
    for i in range(args.pairs):
        est = statistics.mean(tuple_s) if tuple_s else 0.0
        if time.monotonic() + est > deadline:
            truncated = True
            common.progress(f"{tag}: deadline reached after {i} of {args.pairs} pairs; stopping")
            break
        t0 = time.monotonic()
        row = []
        for name, kind, vw in variants:
            res = runner.run(workload, kind, None if args.sham else vw)
            runs[name].append(res)
            if "error" in res:
                errors += 1
                common.progress(f"{tag} {name} run {i + 1} FAILED:\n{res['error']}{res.get('log_tail', '')}")
            else:
                row.append(f"{name} {res['step_time_s'] * 1000:.3f} ms x{res['steps']}")
        tuple_s.append(time.monotonic() - t0)
        left = (args.pairs - i - 1) * statistics.mean(tuple_s)
        common.progress(
            f"{tag} pair {i + 1}/{args.pairs}: " + ", ".join(row) + f" ({tuple_s[-1]:.1f} s; ~{left:.0f} s left)"
        )
        if i == 0 and errors:
            common.progress(f"{tag}: the first pair failed; skipping this workload")
            break
    return {"runs": runs, "truncated": truncated, "errors": errors}


def run_segment_pairs(
    runner: Runner, args: argparse.Namespace, workload: str, deadline: float, label: str = ""
) -> dict[str, Any]:
    """A B segment pairs, ``--pairs-per-process`` to a fresh process, until ``--pairs`` are in. ``label``
    names the figure in progress lines (default: the workload); ``sequences`` keeps each process's segments
    in time order."""
    tag = label or workload
    per = args.pairs_per_process or (args.pairs if workload == "trainer" else 5)  # the trainer: one run
    runs: dict[str, list[dict]] = {"without": [], "with": []}
    sequences: list[list[dict]] = []
    processes: list[dict[str, Any]] = []
    proc_s: list[float] = []
    truncated = False
    errors = 0
    while len(runs["with"]) < args.pairs:
        k = min(per, args.pairs - len(runs["with"]))
        est = statistics.mean(proc_s) * k / per if proc_s else 0.0
        if time.monotonic() + est > deadline:
            truncated = True
            common.progress(f"{tag}: deadline reached after {len(runs['with'])} of {args.pairs} pairs; stopping")
            break
        res = runner.run_segments(workload, k, None if args.sham else {}, deadline)
        segs = res.pop("segments", [])
        processes.append(res)
        if "error" in res:
            errors += 1
            common.progress(f"{tag} process {len(processes)} FAILED:\n{res['error']}{res.get('log_tail', '')}")
            if not runs["with"] or errors >= 3:
                common.progress(
                    f"{tag}: {'the first process' if not runs['with'] else 'three processes'} "
                    "failed; skipping the rest of this workload"
                )
                break
            continue
        proc_s.append(res["process_s"])
        for seg in segs:
            runs["without" if seg["kind"] == "A" else "with"].append(seg)
        sequences.append(segs)
        done = len(runs["with"])
        left = (args.pairs - done) / per * statistics.mean(proc_s)
        pairs = [sorted(p, key=lambda s: s["kind"]) for p in zip(segs[0::2], segs[1::2], strict=True)]
        common.progress(
            f"{tag} process {len(processes)} ({done}/{args.pairs} pairs, A/B): "
            + ", ".join(f"{a['step_time_s'] * 1000:.3f}/{b['step_time_s'] * 1000:.3f} ms" for a, b in pairs)
            + f" ({res['process_s']:.1f} s; ~{left:.0f} s left)"
        )
        if res.get("failure"):
            errors += 1
            common.progress(f"{tag} process {len(processes)} failed after {done} pairs (kept):\n{res['failure']}")
        if res.get("truncated"):  # the process itself stopped at the deadline, or failed
            truncated = True
            common.progress(f"{tag}: the process stopped after {done} of {args.pairs} pairs")
            break
    return {"runs": runs, "truncated": truncated, "errors": errors, "processes": processes, "sequences": sequences}


def summarize(
    workload: str,
    runs: dict[str, list[dict]],
    base: str,
    name: str,
    settings: dict | None,
    truncated: bool,
    shared_with: list[str],
) -> dict[str, Any]:
    a, b = runs[base], runs[name]
    ok = [i for i in range(min(len(a), len(b))) if "error" not in a[i] and "error" not in b[i]]
    # the null needs consecutive baselines: use all good baselines in order
    base_ok = [r["step_time_s"] for r in a if "error" not in r]
    mean_a = [a[i]["step_time_s"] for i in ok]
    mean_b = [b[i]["step_time_s"] for i in ok]
    med_a = [a[i]["median_step_s"] for i in ok]
    med_b = [b[i]["median_step_s"] for i in ok]
    st = common.paired_stats(mean_a, mean_b)
    st["null_ratios"] = common.paired_stats(base_ok, base_ok)["null_ratios"]
    z = common.spread(st["null_ratios"])
    st.update(null_median_ratio=z["median"], null_min_ratio=z["min"], null_max_ratio=z["max"])
    med = common.paired_stats(med_a, med_b)
    base_med_ok = [r["median_step_s"] for r in a if "error" not in r]
    zm = common.spread(common.paired_stats(base_med_ok, base_med_ok)["null_ratios"])
    # B between its own baseline and the next one: a drift that is linear over a pair cancels out
    bracket = [
        b[i]["step_time_s"] / (a[i]["step_time_s"] * a[i + 1]["step_time_s"]) ** 0.5
        for i in ok
        if i + 1 < len(a) and "error" not in a[i + 1]
    ]
    zb = common.spread(bracket)
    first = next((r for r in b if "error" not in r), {})
    out: dict[str, Any] = dict(st)
    out.update(
        {
            "ratio_basis": "mean step time of each run: wall time of N steps ended by one synchronize, / N",
            "step_times": {"without": mean_a, "with": mean_b},
            "median_step_times": {"without": med_a, "with": med_b},
            "median_basis": {k: med[k] for k in ("median_ratio", "min_ratio", "max_ratio")}
            | {"null_median_ratio": zm["median"], "null_min_ratio": zm["min"], "null_max_ratio": zm["max"]},
            "bracketed": {
                "basis": "with[i] / geometric mean of without[i] and without[i+1]",
                "ratios": bracket,
                "median_ratio": zb["median"],
                "min_ratio": zb["min"],
                "max_ratio": zb["max"],
            },
            "steps_per_run": {"without": [a[i]["steps"] for i in ok], "with": [b[i]["steps"] for i in ok]},
            "vramwatch_cpu_share_per_run": [b[i].get("vramwatch_cpu_share") for i in ok],
            "scrapes_per_run": [b[i].get("scrapes", {}).get("ok") for i in ok],
            "model": first.get("model"),
            "settings": {k: v for k, v in (settings or {}).items()},
            "baseline": base,
            "baseline_shared_with": shared_with,
            "truncated": truncated,
            "errors": sum(1 for r in a + b if "error" in r),
            "within_null": (
                st["median_ratio"] is not None
                and st["null_min_ratio"] is not None
                and st["null_min_ratio"] <= st["median_ratio"] <= st["null_max_ratio"]
            ),
            "meets_target": (st["median_ratio"] is not None and st["median_ratio"] <= TARGETS["median_ratio_max"]),
            "runs": {"without": a, "with": b},
        }
    )
    if st["median_ratio"] is not None:
        common.progress(
            f"{workload}: median ratio {st['median_ratio']:.4f} [{st['min_ratio']:.4f}, "
            f"{st['max_ratio']:.4f}] over {st['pairs']} pairs; A/A null {z['median']:.4f} "
            f"[{z['min']:.4f}, {z['max']:.4f}]"
            if z["median"] is not None
            else f"{workload}: median ratio {st['median_ratio']:.4f} over {st['pairs']} pairs; no null"
        )
    return out


def median_interval(values: list[float], confidence: float = 0.95) -> dict[str, Any]:
    """The sign test's interval for the median, free of any assumed distribution: the k-th smallest and the
    k-th largest value, k the largest with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2, with its exact
    coverage. No interval (None) when n is too small to reach ``confidence`` (fewer than 6 at 95 %)."""
    n, s = len(values), sorted(values)
    below, k = 0.0, 0  # below: P(X <= k - 1)
    for j in range(n):
        p = sum(math.comb(n, i) for i in range(j + 1)) / 2**n
        if p > (1 - confidence) / 2:
            break
        below, k = p, j + 1
    if k == 0:
        return {"low": None, "high": None, "coverage": None, "n": n}
    return {"low": s[k - 1], "high": s[n - k], "coverage": 1 - 2 * below, "n": n}


def bootstrap_median_interval(
    values: list[float], confidence: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> dict[str, Any]:
    """Percentile bootstrap interval of the median (resampling the values with replacement; fixed seed)."""
    if len(values) < 2:
        return {"low": None, "high": None, "resamples": 0}
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = int(resamples * (1 - confidence) / 2)
    return {"low": meds[tail], "high": meds[resamples - 1 - tail], "resamples": resamples, "seed": seed}


def ratio_figures(ratios: list[float]) -> dict[str, Any]:
    """Median, min..max and both 95 % intervals of the median of a list of ratios."""
    z = common.spread(ratios)
    return {
        "n": len(ratios),
        "median": z["median"],
        "min": z["min"],
        "max": z["max"],
        "sign_test_95": median_interval(ratios),
        "bootstrap_95": bootstrap_median_interval(ratios),
        "ratios": ratios,
    }


def segment_figures(sequences: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """What the segments' order gives beyond summarize(), from each process's segments in time order.

    - ``pair_ratios``: B/A of each pair of neighbouring segments (summarize's ratios), with intervals.
    - ``adjacent_null``: neighbouring segments of the same kind (the A A and B B that the abba order puts at
      every pair boundary), ``aa`` and ``bb``: the same distance apart as a pair's halves, each kind's
      oriented later/earlier and earlier/later in turn (as the pairs' B is after and before its A in turn),
      so a steady drift spreads them both ways instead of shifting them all (with an odd count, one more
      way than the other). ``aa`` is the A/A null of the figure.
    - ``bracketed``: each B over the geometric mean of the nearest A before and after it.
    - ``resolution``: what the pairs can resolve: the sign-test interval of the median B/A, the overhead
      above which they rule out (its high end - 1), and whether the interval is narrower than 0.5 % (so it
      cannot hold both no overhead and xpu-timer's stated 0.5 %).
    """
    pairs: list[float] = []
    same: dict[str, list[float]] = {"A": [], "B": []}
    bracket: list[float] = []
    for seq in sequences:
        t = [s["step_time_s"] for s in seq]
        k = [s["kind"] for s in seq]
        for i in range(0, len(seq) - 1, 2):
            a, b = (t[i], t[i + 1]) if k[i] == "A" else (t[i + 1], t[i])
            pairs.append(b / a)
        for i in range(len(seq) - 1):
            if k[i] == k[i + 1]:
                later_over_earlier = len(same[k[i]]) % 2 == 0
                same[k[i]].append(t[i + 1] / t[i] if later_over_earlier else t[i] / t[i + 1])
        for i, kind in enumerate(k):
            if kind != "B":
                continue
            before = next((t[j] for j in range(i - 1, -1, -1) if k[j] == "A"), None)
            after = next((t[j] for j in range(i + 1, len(k)) if k[j] == "A"), None)
            if before and after:
                bracket.append(t[i] / math.sqrt(before * after))
    p = ratio_figures(pairs)
    ci = p["sign_test_95"]
    resolution: dict[str, Any] = {"interval": "sign_test_95 of pair_ratios", "low": ci["low"], "high": ci["high"]}
    if ci["high"] is not None:
        resolution.update(
            rules_out_overhead_above=ci["high"] - 1.0,
            width=ci["high"] - ci["low"],
            narrower_than_half_percent=ci["high"] - ci["low"] < 0.005,
        )
    return {
        "order": ["".join(s["kind"] for s in seq) for seq in sequences],
        "pair_ratios": p,
        "adjacent_null": {"aa": ratio_figures(same["A"]), "bb": ratio_figures(same["B"])},
        "bracketed": ratio_figures(bracket),
        "resolution": resolution,
    }


def _prewarm(args: argparse.Namespace, wanted: list[str]) -> None:
    """Pay the imports once here; every forked run inherits them. Touches no CUDA and no vramwatch.

    PYTORCH_NVML_BASED_CUDA_CHECK=1 makes any ``torch.cuda.is_available()`` an import may do ask NVML,
    not the CUDA driver (which would spoil forking); A and B runs inherit the same value.
    """
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # its first construction imports torch._dynamo
    if "trainer" in wanted or "trainer_segments" in wanted:
        from transformers import Trainer  # noqa: F401 - the Trainer's imports (accelerate, datasets) too

        if torch.cuda.is_initialized():  # an import reached CUDA: a forked run could not use it
            common.progress("importing the Trainer initialised CUDA; every run is a fresh interpreter (exec)")
            args.isolation = "exec"
            return
    if any(w.startswith("transformer") for w in wanted) and args.model in ("auto", "hf"):
        try:
            from transformers import GPT2Config, GPT2LMHeadModel  # noqa: F401
        except ImportError:
            if args.model == "hf":
                raise
    assert "vramwatch" not in sys.modules, "the parent must not import vramwatch"
    assert not torch.cuda.is_initialized(), "the parent must not initialise CUDA"


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    deadline = started + args.deadline if args.deadline else float("inf")
    wanted = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in wanted:
        if w not in WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    _prewarm(args, wanted)
    if args.pin is not None:  # this thread's mask passes to the scraper and every run: all CPUs but the pinned one
        os.sched_setaffinity(0, set(os.sched_getaffinity(0)) - {args.pin})
        common.progress(
            f"training threads pinned to CPU {args.pin}; the harness, vramwatch's threads and its server get the others"
        )
    workdir = tempfile.mkdtemp(prefix="vwbench-overhead-")
    out: dict[str, Any] = {
        "metadata": common.metadata(
            benchmark="overhead",
            device=args.device,
            isolation=args.isolation,
            sizes=args.sizes,
            pairs_requested=args.pairs,
            run_seconds=args.run_seconds,
            warmup_seconds=args.warmup_seconds,
            workloads=wanted,
            pinned_core=args.pin,
            pairs_per_process=args.pairs_per_process,
            pytorch_nvml_based_cuda_check=os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"),
        ),
        "targets": TARGETS,
        "notes": [
            "A runs have no vramwatch (never imported) and are not scraped: nothing listens there.",
            "B runs: vramwatch.start(port=<free>, spool_dir=<tmpfs>, linger=0) otherwise at defaults, "
            "server spawned by the rank, scraped at 1 Hz by a separate process.",
            "ratios are with/without of adjacent runs; the null is each baseline over the next baseline.",
            "launch_bound runs its pairs as segments of a few processes (A: vramwatch not running, B: started "
            "fresh); launch_bound_fresh runs every A and B in a process of its own.",
            "trainer_segments: one Trainer run cut into A and B segments (order abba by default); A: vramwatch "
            "stopped, its server gone, its callback relayed no event; B: started, the callback relayed every event.",
            "pinned_core: the training thread (and the threads torch starts from it) alone on that CPU; the "
            "harness, vramwatch's sampler thread and its server on the others.",
        ],
    }
    runner = Runner(args, workdir)

    def save() -> None:
        if args.out:
            common.write_json(args.out, out)

    try:
        save()
        if "direct" in wanted:
            out.update(run_direct(runner, args))
            save()
        if "launch_bound" in wanted:
            common.progress(
                f"launch_bound: {args.pairs} pairs of {args.run_seconds:g} s segments (A B A B ...), "
                f"{args.pairs_per_process or 5} pairs to a process"
            )
            r = run_segment_pairs(runner, args, "launch_bound", deadline)
            out["launch_bound"] = summarize("launch_bound", r["runs"], "without", "with", {}, r["truncated"], [])
            out["launch_bound"].update(design="segments", processes=r["processes"])
            save()
        if "launch_bound_fresh" in wanted:
            common.progress(
                f"launch_bound_fresh: {args.pairs} pairs of {args.run_seconds:g} s runs (A B A B ...), "
                "every run a fresh process"
            )
            r = run_pairs(
                runner,
                args,
                "launch_bound",
                [("without", "A", None), ("with", "B", {})],
                deadline,
                label="launch_bound_fresh",
            )
            out["launch_bound_fresh"] = summarize(
                "launch_bound_fresh", r["runs"], "without", "with", {}, r["truncated"], []
            )
            out["launch_bound_fresh"]["design"] = "fresh processes"
            save()
        tf = [w for w in ("transformer", "transformer_full") if w in wanted]
        if tf:
            full = {"status_every": args.status_every, "oom_history_entries": args.oom_history_entries}
            variants: list[tuple[str, str, dict | None]] = [("without", "A", None)]
            if "transformer" in tf:
                variants.append(("transformer", "B", {}))
            if "transformer_full" in tf:
                variants.append(("transformer_full", "C", full))
            order = " ".join(k for _, k, _ in variants)
            common.progress(
                f"transformer: {args.pairs} rounds of {order} ({args.run_seconds:g} s runs; "
                "one baseline shared by the variants)"
            )
            r = run_pairs(runner, args, "transformer", variants, deadline)
            for name, _, vw in variants[1:]:
                others = [n for n, _, _ in variants[1:] if n != name]
                out[name] = summarize(name, r["runs"], "without", name, vw, r["truncated"], others)
            save()
        if "trainer" in wanted:
            common.progress(
                f"trainer: {args.pairs} pairs of A B ({args.run_seconds:g} s windows of transformers' Trainer; "
                "B with VramwatchCallback: watch(), tokens, heartbeat, loss)"
            )
            r = run_pairs(runner, args, "trainer", [("without", "A", None), ("trainer", "B", {})], deadline)
            out["trainer"] = summarize("trainer", r["runs"], "without", "trainer", {}, r["truncated"], [])
            out["trainer"]["design"] = (
                "fresh processes; B: vramwatch.start() then Trainer(callbacks=[VramwatchCallback()]) with "
                "include_num_input_tokens_seen=True" + (" (in A too)" if args.trainer_tokens_in_a else " (A: off)")
            )
            save()
        if "trainer_segments" in wanted:
            seg_s = args.segment_seconds or args.run_seconds
            settle = args.segment_warmup_seconds if args.segment_warmup_seconds is not None else args.warmup_seconds
            order = args.segment_order or "abba"
            common.progress(
                f"trainer_segments: {args.pairs} pairs of {seg_s:g} s segments ({order}) in one Trainer run, "
                f"{settle:g} s settle at every boundary; B: vramwatch started, VramwatchCallback relayed"
            )
            r = run_segment_pairs(runner, args, "trainer", deadline, label="trainer_segments")
            res = summarize("trainer_segments", r["runs"], "without", "with", {}, r["truncated"], [])
            res.update(
                design=(
                    f"in-process segments, order {order}, {seg_s:g} s each after a {settle:g} s settle; A: "
                    "VramwatchCallback gets no event, vramwatch stopped and its server gone"
                    + (", the Trainer counts tokens" if args.trainer_tokens_in_a else ", the Trainer's token count off")
                    + "; B: vramwatch.start() (own server, scraped at 1 Hz), VramwatchCallback relayed every event "
                    "(on_train_begin at the switch: watch(), tokens), the Trainer counting tokens"
                ),
                segment_seconds=seg_s,
                settle_seconds=settle,
                processes=r["processes"],
                model=next((x.get("model") for x in r["processes"] if "model" in x), None),
                **segment_figures(r["sequences"]),
            )
            out["trainer_segments"] = res
            rz = res["resolution"]
            if rz.get("high") is not None:
                aa = res["adjacent_null"]["aa"]
                common.progress(
                    f"trainer_segments: median B/A {rz['low']:.4f}..{rz['high']:.4f} (sign test, 95 %); "
                    f"adjacent A/A median {aa['median'] if aa['median'] is None else round(aa['median'], 4)} "
                    f"over {aa['n']}; rules out an overhead above {rz['rules_out_overhead_above'] * 100:.2f} %"
                )
            save()
    finally:
        runner.close()
        out["metadata"]["elapsed_s"] = time.monotonic() - started
        first = next(
            (
                x
                for w in ("launch_bound", "transformer")
                if isinstance(out.get(w), dict)
                for x in out[w].get("runs", {}).get("without", [])
                if "error" not in x
            ),
            None,
        )
        first = first or next(
            (x for x in (out.get("trainer_segments") or {}).get("processes", []) if "error" not in x), None
        )
        if first:
            out["metadata"].setdefault("torch", first.get("torch"))
            out["metadata"].setdefault("torch_cuda", first.get("torch_cuda"))
            out["metadata"]["device_name"] = first.get("device_name")
        save()
        if not args.keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            common.progress(f"run logs kept in {workdir}")
    return out


# ----------------------------------------------------------------------------------------------
# merge and check
# ----------------------------------------------------------------------------------------------
def merge(paths: list[str], out_dir: str = ".") -> dict[str, Any]:
    """Combine part files (one per device command) into the one results file; each part is
    named by its path from ``out_dir`` (where the merged file goes)."""
    out: dict[str, Any] = {}
    parts = []
    for p in paths:
        data = common.read_json(p)
        meta = data.get("metadata", {})
        parts.append(
            {
                "file": os.path.relpath(p, out_dir),
                "date": meta.get("date"),
                "workloads": meta.get("workloads"),
                "elapsed_s": meta.get("elapsed_s"),
                "vramwatch_commit": meta.get("vramwatch_commit"),
                "vramwatch_source_sha256": meta.get("vramwatch_source_sha256"),
            }
        )
        for k, v in data.items():
            if k == "metadata":
                out.setdefault("metadata", dict(v))
            elif k in ("notes", "targets"):
                out.setdefault(k, v)
            elif v is not None:
                out[k] = v
    out.setdefault("metadata", {})["parts"] = parts
    return out


def missing_keys(data: dict[str, Any]) -> list[str]:
    miss = [k for k in TOP_KEYS if data.get(k) is None]
    for w in ("launch_bound", "transformer", "transformer_full"):
        obj = data.get(w)
        if isinstance(obj, dict):
            miss += [f"{w}.{k}" for k in PAIR_KEYS if obj.get(k) is None]
    meta = data.get("metadata") or {}
    miss += [
        f"metadata.{k}"
        for k in ("date", "gpu_name", "driver", "torch", "python", "vramwatch_commit")
        if not meta.get(k)
    ]
    return miss


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="benchmarks/overhead.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke tests: tiny sizes)")
    p.add_argument(
        "--workloads",
        default="direct,launch_bound,transformer,transformer_full",
        help="comma list of " + ", ".join(WORKLOADS),
    )
    p.add_argument("--quick", action="store_true", help="few pairs, short direct window: a check of the pipeline")
    p.add_argument("--pairs", type=int, default=None, help="pairs of runs per workload (default 20; quick 4)")
    p.add_argument("--run-seconds", type=float, default=3.0, help="timed seconds per run (default 3)")
    p.add_argument("--warmup-seconds", type=float, default=1.0)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--direct-seconds", type=float, default=None, help="direct-cost window (default 60; quick 10)")
    p.add_argument(
        "--direct-parts-seconds",
        type=float,
        default=None,
        help="window of the instrumented direct run that times a sample's parts (default 30; quick 5; 0: none)",
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="B runs on the simulated GPU (one device holding 1 GiB): with --device cpu, a sample reads an "
        "allocator as on a GPU node (the simulator's stats stand in for torch's)",
    )
    p.add_argument("--step-calls", type=int, default=None, help="step() calls per repeat (default 1e6; quick 2e5)")
    p.add_argument("--step-repeats", type=int, default=5)
    p.add_argument("--size", choices=sorted(SIZES), default=None, help="model sizes (default: full; cpu: tiny)")
    for k, v in SIZES["full"].items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"(full: {v})")
    p.add_argument(
        "--model",
        choices=("auto", "hf", "builtin"),
        default="auto",
        help="transformer implementation: transformers' GPT-2 (hf), a plain-torch one (builtin), "
        "or hf when importable (auto)",
    )
    p.add_argument("--no-loss", action="store_true", help="call step() without the loss tensor")
    p.add_argument(
        "--trainer-tokens-in-a",
        action="store_true",
        help="trainer: the A runs count tokens too (include_num_input_tokens_seen), so the pairs leave the "
        "Trainer's own token count out of the difference",
    )
    p.add_argument(
        "--no-watch",
        action="store_true",
        help="B runs without vramwatch.watch(model, optimizer) and step(tokens=) (both on by default)",
    )
    p.add_argument(
        "--sham",
        action="store_true",
        help="a check of the harness: the 'with' runs run without vramwatch too (an A/A through "
        "the whole A B sequence; any ratio away from 1 is the harness's own bias)",
    )
    p.add_argument("--status-every", type=int, default=10, help="transformer_full: status line every N steps")
    p.add_argument("--oom-history-entries", type=int, default=100000, help="transformer_full: allocator history")
    p.add_argument("--scrape-interval", type=float, default=1.0)
    p.add_argument("--isolation", choices=("fork", "exec"), default="fork")
    p.add_argument(
        "--pin-core",
        default="auto",
        help="CPU for the training thread alone: auto (the highest, given 4 or more CPUs), none, or N",
    )
    p.add_argument(
        "--pairs-per-process",
        type=int,
        default=None,
        help="segment designs: pairs in each fresh process (default: launch_bound 5, trainer_segments all)",
    )
    p.add_argument(
        "--segment-warmup-seconds",
        type=float,
        default=None,
        help="segment designs: warm-up (settle) before each segment (default: --warmup-seconds)",
    )
    p.add_argument(
        "--segment-seconds",
        type=float,
        default=None,
        help="segment designs (launch_bound, trainer_segments): timed seconds per segment (default: --run-seconds)",
    )
    p.add_argument(
        "--segment-order",
        choices=("ab", "abba"),
        default=None,
        help="segment designs: A B A B (ab) or A B B A A B B A (abba: the order inside a pair alternates); "
        "default ab for launch_bound, abba for trainer_segments",
    )
    p.add_argument(
        "--segment-server",
        choices=("spawned", "external"),
        default="spawned",
        help="launch_bound: each B segment's rank spawns its server (default), or one `vramwatch "
        "serve` runs beside the whole process as a sidecar would (B segments start in "
        "milliseconds, so segments can be short)",
    )
    p.add_argument("--run-timeout", type=float, default=180.0, help="kill a run after this many seconds")
    p.add_argument(
        "--deadline",
        type=float,
        default=0.0,
        help="stop starting pairs once this many seconds have passed (0: no limit)",
    )
    p.add_argument("--keep-workdir", action="store_true", help="keep the per-run logs")
    p.add_argument("--out", default="", help="JSON file to write (rewritten after every pair)")
    p.add_argument("--merge", nargs="+", metavar="PART", help="merge part files into --out and exit")
    p.add_argument("--check", metavar="FILE", help="exit 1 if FILE lacks a key the results need")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    size = args.size or ("tiny" if args.device == "cpu" else "full")
    args.sizes = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in SIZES[size].items()}
    if args.pairs is None:
        args.pairs = 4 if args.quick else 20
    if args.pairs_per_process is not None and args.pairs_per_process < 1:
        p.error(f"--pairs-per-process {args.pairs_per_process}: needs at least 1")
    args.pin = None if args.child or args.merge or args.check else resolve_pin(args.pin_core)
    if args.direct_seconds is None:
        args.direct_seconds = 10.0 if args.quick else 60.0
    if args.direct_parts_seconds is None:
        args.direct_parts_seconds = 5.0 if args.quick else 30.0
    if args.step_calls is None:
        args.step_calls = 200_000 if args.quick else 1_000_000
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cut by `timeout`: save, clean up
    if args.child:
        return _child_entry(json.loads(args.child))
    if args.check:
        miss = missing_keys(common.read_json(args.check))
        if miss:
            print("missing: " + ", ".join(miss))
            return 1
        print("ok")
        return 0
    if args.merge:
        data = merge(args.merge, os.path.dirname(os.path.abspath(args.out)) if args.out else ".")
        if args.out:
            common.write_json(args.out, data)
        else:
            print(json.dumps(data, indent=1))
        miss = missing_keys(data)
        if miss:
            common.progress("merged file still lacks: " + ", ".join(miss))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    pp = os.environ.get("PYTHONPATH", "")
    if str(common.ROOT) not in pp.split(os.pathsep):  # the server a B run spawns must find vramwatch
        os.environ["PYTHONPATH"] = str(common.ROOT) + (os.pathsep + pp if pp else "")
    if str(common.ROOT) not in sys.path:
        sys.path.insert(1, str(common.ROOT))  # B runs import vramwatch from the checkout
    for k in [k for k in os.environ if k.startswith("VRAMWATCH_")]:
        del os.environ[k]  # runs get their settings as arguments, nothing else
    data = run_benchmark(args)
    miss = missing_keys(data)
    wanted = args.workloads.split(",")
    if set(wanted) >= set(WORKLOADS) and miss:
        common.progress("result lacks: " + ", ".join(miss))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
