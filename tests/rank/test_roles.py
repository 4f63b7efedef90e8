"""Memory by role (vramwatch.watch) and the tokens / samples counters of step()."""

from __future__ import annotations

import gc
import time
import timeit
import weakref

import pytest

import vramwatch
from vramwatch import spool
from vramwatch.rank.roles import RoleWalker
from vramwatch.sim.model import SimAdam, SimModel, SimTensor
from vramwatch.spool import DeviceSample

torch = pytest.importorskip("torch")


def _walk(model, optimizer, max_tensors=4096, types=("cpu",)):
    w = RoleWalker(model, optimizer, 30.0, max_tensors, device_types=types)
    if isinstance(optimizer, torch.optim.Optimizer):
        for _ in range(1 + sum(1 for _ in model.parameters()) // min(max_tensors, 256)):
            optimizer.step()  # the training thread's safe point, where the walker locates the gradients
    for i in range(10_000):
        w.poll(float(i) * 1e-3)  # within the interval: only the walk under way continues
        if w.result is not None and w._walk is None:
            return w
    raise AssertionError("the walk did not complete")


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def _trained():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    return model, opt


def test_roles_match_the_independent_sums():
    model, opt = _trained()
    (p, g, o) = _walk(model, opt).result[0]
    assert p == _bytes(model.parameters())
    assert g == _bytes(q.grad for q in model.parameters())
    assert o == _bytes(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v))


def test_tied_weights_and_views_count_once():
    emb = torch.nn.Embedding(100, 16)
    head = torch.nn.Linear(16, 100, bias=False)
    head.weight = emb.weight  # tied
    model = torch.nn.ModuleList([emb, head])
    view = emb.weight.view(-1)
    opt = torch.optim.SGD([emb.weight], lr=0.1)
    opt.state[emb.weight]["momentum_buffer"] = view  # a view of a parameter: already counted
    (p, g, o) = _walk(model, opt).result[0]
    assert p == 100 * 16 * 4
    assert (g, o) == (0, 0)


def test_a_dtensor_counts_its_local_shard():
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        local = torch.randn(8, 4)
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)]))
        (p, _, _) = _walk(model, None).result[0]
    finally:
        dist.destroy_process_group()
    assert p == local.numel() * local.element_size()


def test_the_model_is_never_kept_alive_and_its_figures_go_with_it():
    model, opt = _trained()
    w = _walk(model, opt)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    w._next = 0.0
    w.poll(1.0)
    assert w.result is None


def test_a_pass_reads_at_most_max_tensors():
    reads = []

    class Counting(SimTensor):
        def untyped_storage(self):
            reads.append(1)
            return super().untyped_storage()

    model = SimModel(1 << 20, layers=100)
    model.params = [Counting(1024) for _ in range(100)]
    w = RoleWalker(model, None, 30.0, 7)
    per_pass = []
    while True:
        before = len(reads)
        w.poll(0.0)
        per_pass.append(len(reads) - before)
        if w._walk is None:
            break
    assert max(per_pass) <= 7
    assert sum(per_pass) == 100
    assert w.result == {0: (100 * 1024, 0, 0)}


def test_walks_keep_their_cadence():
    model = SimModel(1 << 20, layers=4)
    w = RoleWalker(model, None, 30.0, 4096)
    for t in (0.0, 1.0, 29.0):
        w.poll(t)
    assert w.passes == 1  # the first walk is one pass; the next is due at 30 s
    w.poll(30.0)
    assert w.passes == 2


def test_a_costly_walk_puts_off_the_next_one(monkeypatch):
    from vramwatch.rank import roles

    model = SimModel(1 << 20, layers=4)
    w = RoleWalker(model, None, 30.0, 4096)
    cpu = iter([0.0, 0.05])  # one pass of 50 ms of this thread's CPU
    monkeypatch.setattr(roles.time, "thread_time", lambda: next(cpu))
    w.poll(0.0)
    assert w._walk is None
    assert w._next == pytest.approx(0.05 / roles.MAX_CORE_SHARE)  # 500 s, not 30: at most 0.01% of a core
    w.poll(499.0)
    assert w.passes == 1


def test_a_walk_that_waited_for_the_gil_is_not_put_off(monkeypatch):
    # 50 ms of wall time, 0.1 ms of it this thread's CPU (the rest waiting on the training thread's GIL)
    from vramwatch.rank import roles

    model = SimModel(1 << 20, layers=4)
    w = RoleWalker(model, None, 30.0, 4096)
    wall, cpu = iter([0.0, 0.05]), iter([0.0, 0.0001])
    monkeypatch.setattr(roles.time, "perf_counter", lambda: next(wall))
    monkeypatch.setattr(roles.time, "thread_time", lambda: next(cpu))
    w.poll(0.0)
    assert w._next == pytest.approx(30.0)  # role_interval: 0.1 ms of CPU allows a walk every second
    assert w.health.duration == pytest.approx(0.05)  # the collector's duration stays the wall time


def test_a_walk_reads_no_cuda():
    model, opt = _trained()
    _walk(model, opt, types=("cuda",))
    assert not torch.cuda.is_initialized()


def test_other_is_allocated_minus_the_roles():
    model = SimModel(1000, layers=1)
    opt = SimAdam(model)  # held here: the walker holds it weakly
    w = RoleWalker(model, opt, 30.0, 4096)
    w.poll(0.0)
    (d,) = w.apply([DeviceSample(0, "GPU-x", {"torch_cuda_memory_allocated_bytes": 10_000.0})])
    assert d.roles == {"parameters": 1000.0, "gradients": 1000.0, "optimizer_state": 4000.0, "other": 4000.0}


def test_a_device_the_walk_did_not_see_passes_unchanged_and_the_others_still_get_roles():
    model = SimModel(1000, layers=1)  # its tensors live on device 0 only
    opt = SimAdam(model)
    w = RoleWalker(model, opt, 30.0, 4096)
    w.poll(0.0)
    alone = DeviceSample(1, "GPU-y", {"torch_cuda_memory_allocated_bytes": 7.0})
    first, second = w.apply([alone, DeviceSample(0, "GPU-x", {"torch_cuda_memory_allocated_bytes": 10_000.0})])
    assert first is alone and not first.roles
    assert second.device == 0 and second.roles["parameters"] == 1000.0


def test_watch_publishes_roles_tokens_and_flops(start_rank):
    h = start_rank()
    h.sim.init(0)
    model = SimModel(1 << 30, layers=8)
    h.sim.allocate(5 << 30)
    opt = SimAdam(model)
    vramwatch.watch(model, opt, flops_per_token=6e9)
    for _ in range(3):
        vramwatch.step(tokens=2048, samples=2)
    h.tick()
    (s,) = spool.read_samples(h.spool_dir, 64)
    (d,) = s.devices
    assert d.roles["parameters"] == 1 << 30
    assert d.roles["optimizer_state"] == 4 << 30
    assert d.roles["other"] == 0.0  # 5 GiB allocated, 6 GiB watched: the sim holds no separate tensors
    assert (s.heartbeat.tokens, s.heartbeat.samples, s.flops_per_token) == (6144.0, 6.0, 6e9)
    assert s.collectors["roles"].up == 1


def test_without_watch_or_tokens_the_sample_is_unchanged(start_rank):
    h = start_rank()
    h.sim.init(0)
    vramwatch.step()
    h.tick()
    (s,) = spool.read_samples(h.spool_dir, 64)
    assert s.devices[0].roles == {}
    assert (s.heartbeat.tokens, s.heartbeat.samples, s.flops_per_token) == (None, None, None)
    assert "roles" not in s.collectors
    assert b"tokens" not in spool.encode_sample(s)


def test_a_tensor_token_count_is_counted_off_the_training_thread():
    from vramwatch.rank.heartbeat import Heartbeat

    hb = Heartbeat()
    hb.step(tokens=torch.tensor(5))
    assert hb.tokens is None  # step() set it aside: no torch op on the training thread
    assert hb.snapshot().tokens == 5.0  # read by the sampler thread's snapshot (counts.py)


def test_step_with_tokens_stays_cheap(start_rank):
    start_rank()

    def one() -> None:
        vramwatch.step(tokens=4096, samples=2)

    n = 100_000
    best = min(timeit.repeat(one, number=n, repeat=5)) / n
    assert best < 5e-6 * 4, f"step(tokens=, samples=) took {best * 1e6:.2f} us"


@pytest.mark.timing
def test_a_pass_costs_little_for_a_real_model():
    model = torch.nn.Transformer(d_model=64, nhead=4, num_encoder_layers=4, num_decoder_layers=4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.rand(4, 2, 64), torch.rand(3, 2, 64)).sum().backward()
    opt.step()  # mid-training: gradients and AdamW's state exist (its first step builds the state: not our cost)
    n = sum(1 for _ in model.parameters())

    def walk() -> tuple[RoleWalker, float]:
        # the walker's own work: the step pre-hook's gradient snapshot, then the sampler thread's passes; in
        # this thread's CPU time, as the walker budgets itself (a neighbour's load stretches the wall time)
        w = RoleWalker(model, opt, 30.0, 4096, device_types=("cpu",))
        c0 = time.thread_time()
        w.on_optimizer_step()
        for i in range(10_000):
            w.poll(float(i) * 1e-3)
            if w.result is not None and w._walk is None:
                break
        return w, time.thread_time() - c0

    walk()  # the first touches of torch's storage accessors, once per process
    w, took = min((walk() for _ in range(3)), key=lambda r: r[1])  # the least of three: this machine is shared
    ((params, grads, state),) = w.result.values()
    assert params > 0 and grads == params and state > 2 * params, w.result  # bytes: every role was walked
    # a parameter is 4 tensors (itself, its gradient, AdamW's two moments) and a step count: ~1.5 us a tensor on
    # the H200 host, 5-7 us on this project's shared CPU machine (20-33 us a parameter). A slower walk only comes
    # less often (MAX_CORE_SHARE); this catches a walk that got several times slower.
    assert took / n < 50e-6, f"{took / n * 1e6:.1f} us per parameter (its gradient and AdamW state included)"


def test_the_flag_read_counts_what_the_device_read_counts():
    # one device type reads t.is_cpu / t.is_cuda and t.get_device(); two read t.device: same figures
    model, opt = _trained()
    offloaded = torch.zeros(10, device="meta")  # neither: never counted
    opt.state[next(iter(model.parameters()))]["meta"] = offloaded
    fast = _walk(model, opt, types=("cpu",))
    assert fast._flag == "is_cpu"
    slow = _walk(model, opt, types=("cpu", "xla"))
    assert slow._flag == ""
    assert fast.result == slow.result and fast.result[0][0] > 0
    assert _walk(model, opt, types=("cuda",)).result == {}
