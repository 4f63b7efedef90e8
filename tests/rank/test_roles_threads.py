"""A torch parameter's gradient is read only at an optimizer step, on the training thread, never by the walk."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from vramwatch.rank.roles import RoleWalker

torch = pytest.importorskip("torch")


class _Watched(torch.nn.Parameter):
    """A parameter that records which thread reads its ``.grad`` (autograd writes it in C++, not through this)."""

    readers: set[str] = set()

    @property
    def grad(self):  # type: ignore[override]
        _Watched.readers.add(threading.current_thread().name)
        return torch.Tensor.grad.__get__(self)

    @grad.setter
    def grad(self, value):
        torch.Tensor.grad.__set__(self, value)


def _model():
    lin = torch.nn.Linear(8, 8)
    lin.weight = _Watched(lin.weight.detach().clone())
    lin.bias = _Watched(lin.bias.detach().clone())
    return lin


def _walk_on(thread_name: str, w: RoleWalker) -> None:
    def run() -> None:
        for i in range(1000):
            w.poll(float(i) * 1e-3)
            if w._walk is None and w.result is not None:
                return

    t = threading.Thread(target=run, name=thread_name)
    t.start()
    t.join(10)


def test_the_walk_never_reads_a_torch_gradient_and_the_step_hook_does():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    _Watched.readers = set()
    w = RoleWalker(model, opt, 30.0, 4096, device_types=("cpu",))
    try:
        _walk_on("sampler", w)
        assert "sampler" not in _Watched.readers
        assert w.result[0][1] == 0  # no optimizer step yet: no snapshot
        opt.step()  # the training thread's safe point
        assert _Watched.readers == {threading.current_thread().name}
        w._next = 0.0
        _walk_on("sampler", w)
        assert "sampler" not in _Watched.readers
        assert w.result[0][1] == 8 * 8 * 4 + 8 * 4
    finally:
        w.close()


def test_a_large_model_is_located_over_several_steps_and_a_step_not_due_reads_nothing():
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])  # 6 parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    w = RoleWalker(model, opt, 30.0, 2, device_types=("cpu",))
    try:
        opt.step()
        opt.step()
        assert w._grads == [] and w._grads_due  # 4 of 6 located: the snapshot is not in yet
        opt.step()
        assert len(w._grads) == 6 and not w._grads_due
        w._grads_cursor = 99  # a step while none is due touches nothing
        opt.step()
        assert w._grads_cursor == 99
    finally:
        w.close()


def test_one_step_locates_at_most_256_gradients_whatever_max_tensors():
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(2)) for _ in range(300)])
    for p in model:
        p.grad = torch.ones(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = RoleWalker(model, opt, 30.0, 4096, device_types=("cpu",))
    try:
        opt.step()
        assert w._grads == [] and w._grads_cursor == 256  # a large model: the rest at the next step
        opt.step()
        assert len(w._grads) == 300
    finally:
        w.close()


def test_close_removes_the_hook_and_watch_replacing_a_walker_closes_it():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = RoleWalker(model, opt, 30.0, 4096, device_types=("cpu",))
    assert len(opt._optimizer_step_pre_hooks) == 1
    w.close()
    assert len(opt._optimizer_step_pre_hooks) == 0
    w.close()  # twice: harmless


def test_without_an_optimizer_the_global_step_hook_is_used_and_removed():
    from torch.optim import optimizer as optim

    model = torch.nn.Linear(4, 4)
    before = len(optim._global_optimizer_pre_hooks)
    w = RoleWalker(model, None, 30.0, 4096, device_types=("cpu",))
    assert len(optim._global_optimizer_pre_hooks) == before + 1
    model(torch.randn(2, 4)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # any optimizer's step is past backward
    assert len(w._grads) == 2
    w.close()
    assert len(optim._global_optimizer_pre_hooks) == before


def test_a_failing_snapshot_never_raises_into_the_optimizer_step(monkeypatch):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    w = RoleWalker(model, opt, 30.0, 4096, device_types=("cpu",))
    try:
        monkeypatch.setattr(w, "_locate", lambda t: 1 / 0)
        opt.step()  # must not raise
        assert w._grads == [] and w._grads_due
    finally:
        w.close()


# Walks as fast as they go on one thread while another trains: reading p.grad there (the walk before this
# fix) crashed such a process with SIGSEGV within 15 s in 5 runs of 5 on the development machine.
_RACE = textwrap.dedent(
    """
    import threading, time, torch
    from vramwatch.rank.roles import RoleWalker
    m = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    opt = torch.optim.AdamW(m.parameters())
    w = RoleWalker(m, opt, 30.0, 4096, device_types=("cpu",))
    stop = False
    def walker():
        while not stop:
            for _ in w._walk_all():
                pass
    t = threading.Thread(target=walker, daemon=True)
    t.start()
    x = torch.randn(32, 64)
    end = time.monotonic() + SECONDS
    while time.monotonic() < end:
        opt.zero_grad(set_to_none=True)
        m(x).square().mean().backward()
        opt.step()
    stop = True
    t.join()
    print("ok", w.result[0][1] > 0)
    """
)


def test_walking_beside_a_training_loop_does_not_crash_it():
    code = _RACE.replace("SECONDS", "8")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split() == ["ok", "True"]
