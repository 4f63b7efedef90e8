"""How this rank ends, said in its final sample (``vramwatch_rank_exits_total``).

The hooks are the process's, installed once and chained: each calls the hook it found, so the job's own
handling (a custom excepthook, Lightning's SIGTERM handler, Python's KeyboardInterrupt) runs as before.
They tell the running handle (``vramwatch.current()``), which publishes its final sample at once:

- ``sys.excepthook`` / ``threading.excepthook`` (the training thread's only): an exception escaped, reason
  ``exception`` (``oom`` for a ``torch.OutOfMemoryError``), its class name as the detail;
- SIGTERM and SIGINT, handled only where the job left the default or Python's own handler, or set its
  own Python handler (one that ignores the signal is left alone), installed from the main thread only:
  reason ``signal``, its name as the detail. A default disposition is then restored and the signal raised
  again, so the process dies of it as it would have; a job's handler is called as it would have been;
- ``atexit``: a clean exit, with or without ``stop()``: reason ``finished``, unless a signal came and no
  step followed it, or an OOM was the last thing to happen (a launcher that catches the exception and
  exits itself, as ``torch.multiprocessing.spawn`` does, hides the exception but not the OOM).

A process that dies with no word (SIGKILL, the kernel's OOM killer, a segfault, ``os._exit``) leaves a
sample without a reason: the server calls that ``killed``. An exception a launcher catches before the
excepthook and then exits cleanly reads as ``finished`` (documented in the README).
"""

from __future__ import annotations

import atexit
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from vramwatch.spool.schema import EXIT_DETAIL

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_installed = False
_lock = threading.Lock()
_prev_excepthook: Callable[..., Any] | None = None
_prev_thread_hook: Callable[..., Any] | None = None
_prev_signal: dict[int, Any] = {}


def detail_of(name: str) -> str:
    """A label value: the name itself when short and plain, else ``other``."""
    return name if name and EXIT_DETAIL.fullmatch(name) else "other"


def reason_of(exc_type: type[BaseException]) -> tuple[str, str]:
    """(reason, detail) for an exception that ended the rank."""
    try:
        names = [c.__name__ for c in exc_type.__mro__]
        if "OutOfMemoryError" in names:  # torch.OutOfMemoryError, without importing torch
            return "oom", detail_of(exc_type.__name__)
        if exc_type is KeyboardInterrupt:
            return "signal", "SIGINT"
        return "exception", detail_of(exc_type.__name__)
    except Exception:  # noqa: BLE001 - a class with a strange __mro__
        return "exception", "other"


def _current() -> Any:
    import vramwatch

    return vramwatch.current()


def _tell(reason: str, detail: str) -> None:
    """The running handle records how it ended and publishes it now; never raises."""
    try:
        h = _current()
        if h is not None:
            h.ended(reason, detail)
    except Exception:  # noqa: BLE001 - never in the way of the job's own ending
        pass


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    try:
        _tell(*reason_of(exc_type))
    finally:
        prev = _prev_excepthook or sys.__excepthook__
        prev(exc_type, exc, tb)


def _thread_excepthook(args: Any) -> None:
    try:
        h = _current()
        if h is not None and args.thread is not None and args.thread.native_id == h.heartbeat.thread_id:
            _tell(*reason_of(args.exc_type))  # the training thread died; other threads' errors are theirs
    except Exception:  # noqa: BLE001
        pass
    finally:
        prev = _prev_thread_hook or threading.__excepthook__
        prev(args)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    try:
        _tell("signal", detail_of(signal.Signals(signum).name))
    except Exception:  # noqa: BLE001
        pass
    prev = _prev_signal.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)  # the job's handler, or Python's default_int_handler (KeyboardInterrupt)
    elif prev == signal.SIG_DFL:
        try:
            signal.signal(signum, signal.SIG_DFL)
        finally:
            signal.raise_signal(signum)  # die of it, as without us (the exit status says so)


def _at_exit() -> None:
    try:
        h = _current()
        if h is not None:
            h.ended("finished", "", at_exit=True)
            import vramwatch

            vramwatch.stop()  # the last interval published, the lock released: the server serves it as final
    except Exception:  # noqa: BLE001
        pass


def install() -> None:
    """Install the hooks once per process (idempotent; never raises)."""
    global _installed, _prev_excepthook, _prev_thread_hook
    with _lock:
        if _installed:
            return
        _installed = True
        try:
            _prev_excepthook = sys.excepthook
            sys.excepthook = _excepthook
            _prev_thread_hook = threading.excepthook
            threading.excepthook = _thread_excepthook
            atexit.register(_at_exit)
        except Exception:  # noqa: BLE001
            pass
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal works only there; exits by signal then read as killed
        for sig in HANDLED_SIGNALS:
            try:
                prev = signal.getsignal(sig)
                if prev == signal.SIG_IGN or prev is None:  # ignored, or set outside Python: not ours to touch
                    continue
                _prev_signal[sig] = prev
                signal.signal(sig, _on_signal)
            except (ValueError, OSError, RuntimeError):
                continue
