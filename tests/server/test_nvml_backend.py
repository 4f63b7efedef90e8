"""The NVML session (vramwatch/server/nvml_backend.py) driven directly, on a small fake ``pynvml``.

The collectors' tests reach the session through the simulated NVML; these set what the simulator does not
make easy: each NVML error code's class, init's back-off on a fake clock, an identity getter failing one way
or another, a GPU lost before it could be identified, the session shared per settings.
"""

from __future__ import annotations

import logging
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from vramwatch import spool
from vramwatch.config import Settings
from vramwatch.server import nvml_backend as nb
from vramwatch.sim.nvml import SimNvml

E = pynvml


def err(code: int) -> Exception:
    return E.NVMLError(code)


class FakeNv:
    """A pynvml with a list of GPUs; ``fail[(function, index)]`` (index None: every GPU) raises."""

    def __init__(self, n: int = 2, driver: Any = b"580.65.06") -> None:
        self.gpus = [
            {
                "uuid": f"GPU-{i:08d}-aaaa".encode(),
                "name": f"NVIDIA H200 #{i}".encode(),
                "pci": f"00000000:{i + 1:02X}:00.0".encode(),
                "mig": [0, 0],
            }
            for i in range(n)
        ]
        self.driver = driver
        self.fail: dict[tuple[str, int | None], BaseException] = {}
        self.calls: Counter[str] = Counter()

    def _check(self, fn: str, h: Any = None) -> None:
        self.calls[fn] += 1
        if h is not None and not isinstance(h, int):
            h = h[1]  # a handle: ("handle", index)
        for key in ((fn, None), (fn, h)):
            if key in self.fail:
                raise self.fail[key]

    def nvmlInit(self) -> None:
        self._check("nvmlInit")

    def nvmlSystemGetDriverVersion(self) -> Any:
        self._check("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        self._check("nvmlDeviceGetHandleByIndex", i)
        return ("handle", i)

    def nvmlDeviceGetUUID(self, h: Any) -> Any:
        self._check("nvmlDeviceGetUUID", h)
        return self.gpus[h[1]]["uuid"]

    def nvmlDeviceGetName(self, h: Any) -> Any:
        self._check("nvmlDeviceGetName", h)
        return self.gpus[h[1]]["name"]

    def nvmlDeviceGetPciInfo(self, h: Any) -> Any:
        self._check("nvmlDeviceGetPciInfo", h)
        return SimpleNamespace(busId=self.gpus[h[1]]["pci"], bus=h[1] + 1)

    def nvmlDeviceGetMigMode(self, h: Any) -> Any:
        self._check("nvmlDeviceGetMigMode", h)
        return self.gpus[h[1]]["mig"]


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def session(tmp_path: Any, nv: Any, clock: Clock | None = None, **kw: Any) -> nb.NvmlSession:
    return nb.NvmlSession(Settings(spool_dir=str(tmp_path), **kw), module=nv, clock=clock or Clock())


def messages(caplog: Any, part: str = "") -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if part in r.getMessage()]


# --- error codes and their classes ---
@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (E.NVML_ERROR_NOT_SUPPORTED, "unsupported"),
        (E.NVML_ERROR_NO_PERMISSION, "unsupported"),
        (E.NVML_ERROR_FUNCTION_NOT_FOUND, "unsupported"),
        (E.NVML_ERROR_ARGUMENT_VERSION_MISMATCH, "unsupported"),
        (E.NVML_ERROR_GPU_IS_LOST, "lost"),
        (E.NVML_ERROR_RESET_REQUIRED, "lost"),
        (E.NVML_ERROR_UNINITIALIZED, "session"),
        (E.NVML_ERROR_DRIVER_NOT_LOADED, "session"),
        (E.NVML_ERROR_LIBRARY_NOT_FOUND, "session"),
        (E.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "session"),
        (E.NVML_ERROR_NO_DATA, "quiet"),
        (E.NVML_ERROR_NOT_READY, "quiet"),
        (E.NVML_ERROR_TIMEOUT, "transient"),
        (E.NVML_ERROR_UNKNOWN, "transient"),
        (E.NVML_ERROR_NOT_FOUND, "transient"),
        (E.NVML_ERROR_INVALID_ARGUMENT, "transient"),
    ],
)
def test_each_nvml_error_code_has_its_class(code, kind):
    e = err(code)
    assert nb.error_code(e) == code
    assert nb.classify(e) == kind


def test_a_binding_that_lacks_a_function_or_signature_is_unsupported():
    for e in (AttributeError("nvmlDeviceGetGpmSupport"), TypeError("2 arguments"), NotImplementedError()):
        assert nb.classify(e) == "unsupported"
    # nvidia-ml-py newer than the driver: a missing symbol, as FUNCTION_NOT_FOUND
    assert nb.error_code(E.NVMLLibraryMismatchError("old driver")) == nb.FUNCTION_NOT_FOUND
    assert nb.classify(E.NVMLLibraryMismatchError("old driver")) == "unsupported"


def test_only_an_nvml_error_has_a_code():
    class Other(Exception):
        value = nb.NOT_SUPPORTED  # an int value on something that is not an NVMLError

    assert nb.error_code(Other()) is None and nb.classify(Other()) == "transient"
    assert nb.error_name(Other()) == "Other"
    assert nb.error_code(OSError(5, "EIO")) is None and nb.error_name(ValueError()) == "ValueError"
    weird = E.NVMLError(3)
    weird.value = "3"  # not an int
    assert nb.error_code(weird) is None


def test_error_names_are_nvmls_and_an_unknown_code_is_numbered():
    assert nb.error_name(err(E.NVML_ERROR_GPU_IS_LOST)) == "GPU_IS_LOST"
    assert nb.error_name(err(E.NVML_ERROR_INVALID_ARGUMENT)) == "INVALID_ARGUMENT"
    assert nb.error_name(err(4242)) == "NVML_ERROR_4242"


def test_text_decodes_bytes_leniently_and_strs_anything_else():
    assert nb.text(b"GPU-ab\xffcd") == "GPU-ab\ufffdcd"
    assert nb.text("GPU-1") == "GPU-1" and nb.text(7) == "7"


def test_the_module_is_pynvml_or_the_simulator(tmp_path):
    assert nb.load_module(Settings(spool_dir=str(tmp_path))) is pynvml
    assert isinstance(nb.load_module(Settings(simulate=True, spool_dir=str(tmp_path))), SimNvml)


# --- init ---
def test_a_fresh_session_before_init(tmp_path):
    s = session(tmp_path, FakeNv())
    assert (s.ready, s.generation, s.devices, s.incomplete, s.seen_gpus) == (False, 0, (), False, False)
    assert (s.driver_version, s.last_error, s.init_failures, s.lost) == ("", "", 0, frozenset())
    assert s.absent_reason() == "" and s.next_try_in() == 0.0 and s.watch_key() == (0, ())
    # the first ensure() tries at once, whatever the clock reads (a monotonic clock may start near 0)
    early = session(tmp_path, FakeNv(1), Clock(0.0))
    assert early.next_try_in() == 0.0 and early.ensure()


def test_a_session_another_thread_initialised_meanwhile_is_not_initialised_again(tmp_path):
    nv = FakeNv(1)
    s = session(tmp_path, nv)

    class Contended:
        """The lock, won only after another thread's ensure() finished."""

        def __enter__(self) -> None:
            s.ready = True

        def __exit__(self, *exc: Any) -> None:
            pass

    s._lock = Contended()  # type: ignore[assignment]
    assert s.ensure() is True
    assert nv.calls["nvmlInit"] == 0 and s.generation == 0


def test_init_enumerates_every_gpu_with_its_identity(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="vramwatch")
    nv = FakeNv(2)
    nv.gpus[1]["mig"] = [1, 0]
    s = session(tmp_path, nv)
    assert s.ensure() is True
    assert s.ready and s.generation == 1 and s.driver_version == "580.65.06"
    assert s.devices == (
        nb.Device(0, "GPU-00000000-aaaa", "NVIDIA H200 #0", "00000000:01:00.0", "disabled", ("handle", 0)),
        nb.Device(1, "GPU-00000001-aaaa", "NVIDIA H200 #1", "00000000:02:00.0", "enabled", ("handle", 1)),
    )
    assert not s.incomplete and s.seen_gpus and s.absent_reason() == ""
    assert s.watch_key() == (1, ("GPU-00000000-aaaa", "GPU-00000001-aaaa"))
    assert s.device("GPU-00000001-aaaa") is s.devices[1] and s.device("GPU-nope") is None
    assert messages(caplog, "NVML ready") == [
        (
            logging.INFO,
            "vramwatch: NVML ready (driver 580.65.06): 2 GPU(s) 0:GPU-00000000-aaaa, 1:GPU-00000001-aaaa",
        )
    ]
    # cheap once ready: NVML is not asked again
    before = sum(nv.calls.values())
    assert s.ensure() and sum(nv.calls.values()) == before


def test_identity_strings_are_capped(tmp_path):
    nv = FakeNv(1, driver="9" * 100)
    nv.gpus[0].update(uuid="U" * 200, name="N" * 200, pci="P" * 200)
    s = session(tmp_path, nv)
    assert s.ensure()
    (d,) = s.devices
    assert (d.uuid, d.name, d.pci_bus_id) == ("U" * 96, "N" * 96, "P" * 32)
    assert s.driver_version == "9" * 64


def test_init_failures_back_off_exponentially_up_to_a_minute(tmp_path, caplog):
    nv = FakeNv()
    nv.fail[("nvmlInit", None)] = err(E.NVML_ERROR_UNKNOWN)
    clock = Clock(100.0)
    s = session(tmp_path, nv, clock)
    waits = []
    for _ in range(9):
        assert s.ensure() is False
        waits.append(s.next_try_in())
        clock.t += waits[-1] - 0.001
        assert s.ensure() is False  # still backing off: NVML not asked
        clock.t += 0.001
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    assert nv.calls["nvmlInit"] == 9 and s.init_failures == 9
    assert s.last_error == "UNKNOWN: Unknown Error" and s.absent_reason() == ""
    # a fault, not a node without NVML: one warning for all nine
    assert messages(caplog, "NVML unavailable") == [
        (
            logging.WARNING,
            "vramwatch: NVML unavailable (UNKNOWN: Unknown Error); device metrics are off, allocator metrics "
            "go on; retrying with back-off up to 60 s",
        )
    ]
    del nv.fail[("nvmlInit", None)]
    assert s.ensure() is True and s.last_error == "" and s.generation == 1
    # success resets the back-off: the next failure waits one second again
    s.mark_down(err(E.NVML_ERROR_UNINITIALIZED))
    assert s.next_try_in() == 1.0


@pytest.mark.parametrize(
    ("code", "reason"),
    [(E.NVML_ERROR_LIBRARY_NOT_FOUND, "library_not_found"), (E.NVML_ERROR_DRIVER_NOT_LOADED, "driver_not_loaded")],
)
def test_a_node_without_the_library_or_driver_is_absent_and_says_so_at_info(tmp_path, caplog, code, reason):
    caplog.set_level(logging.INFO, logger="vramwatch")
    nv = FakeNv()
    nv.fail[("nvmlInit", None)] = err(code)
    s = session(tmp_path, nv)
    assert not s.ensure()
    assert s.absent_reason() == reason
    name = nb.NAMES[code]
    ((level, line),) = messages(caplog, "NVML unavailable")
    assert level == logging.INFO
    assert line.startswith(f"vramwatch: NVML unavailable ({name}: ")
    assert f": no NVML on this node ({reason}), not a failure; device metrics are off" in line


def test_different_init_failures_each_log_once(tmp_path, caplog):
    nv = FakeNv()
    clock = Clock()
    s = session(tmp_path, nv, clock)
    for code in (E.NVML_ERROR_UNKNOWN, E.NVML_ERROR_TIMEOUT, E.NVML_ERROR_UNKNOWN):
        nv.fail[("nvmlInit", None)] = err(code)
        assert not s.ensure()
        clock.t += 100
    assert [line[:40] for _, line in messages(caplog, "NVML unavailable")] == [
        "vramwatch: NVML unavailable (UNKNOWN: Un",
        "vramwatch: NVML unavailable (TIMEOUT: Ti",
    ]


def test_nvidia_ml_py_not_importable_is_a_fault_and_the_loader_is_retried(tmp_path, caplog):
    tries = []

    def loader(settings: Settings) -> Any:
        tries.append(settings)
        if len(tries) < 2:
            raise ImportError("No module named 'pynvml'")
        return FakeNv(1)

    clock = Clock()
    st = Settings(spool_dir=str(tmp_path))
    s = nb.NvmlSession(st, loader=loader, clock=clock)
    assert not s.ensure()
    assert s.last_error == "nvidia-ml-py is not importable (No module named 'pynvml')"
    assert s.absent_reason() == "" and s.nv is None
    assert messages(caplog, "NVML unavailable") == [
        (
            logging.WARNING,
            "vramwatch: NVML unavailable (nvidia-ml-py is not importable (No module named 'pynvml')); device "
            "metrics are off, allocator metrics go on; retrying with back-off up to 60 s",
        )
    ]
    clock.t += 1.0
    assert s.ensure() and tries == [st, st] and len(s.devices) == 1
    clock.t += 1000.0
    s.ready = False
    assert s.ensure() and len(tries) == 2  # loaded once, kept


def test_a_broken_enumeration_fails_init(tmp_path):
    nv = FakeNv()
    nv.fail[("nvmlDeviceGetCount", None)] = err(E.NVML_ERROR_UNKNOWN)
    s = session(tmp_path, nv)
    assert not s.ensure() and not s.ready and s.generation == 0
    assert s.last_error == "UNKNOWN: Unknown Error"


def test_nvml_with_no_gpu_is_absent_until_gpus_were_seen(tmp_path):
    nv = FakeNv(0)
    s = session(tmp_path, nv)
    assert s.ensure() and s.absent_reason() == "no_devices" and not s.seen_gpus
    nv2 = FakeNv(1)
    s2 = session(tmp_path, nv2)
    assert s2.ensure() and s2.seen_gpus
    nv2.gpus.clear()
    s2.reenumerate()
    assert s2.devices == () and s2.seen_gpus and s2.absent_reason() == ""  # GPUs were seen: not absent now
    s2.ready = False
    s2._init_failure = "LIBRARY_NOT_FOUND"
    assert s2.absent_reason() == ""


def test_the_driver_version_is_soft(tmp_path):
    nv = FakeNv(1)
    nv.fail[("nvmlSystemGetDriverVersion", None)] = err(E.NVML_ERROR_NOT_SUPPORTED)
    s = session(tmp_path, nv)
    assert s.ensure() and s.driver_version == "" and not s.incomplete
    assert nv.calls["nvmlSystemGetDriverVersion"] == 2  # asked again at enumeration when init's answer was empty
    del nv.fail[("nvmlSystemGetDriverVersion", None)]
    s.reenumerate()
    assert s.driver_version == "580.65.06"
    s.reenumerate()
    assert nv.calls["nvmlSystemGetDriverVersion"] == 3  # known now: not asked again


def test_the_ready_line_shows_an_unknown_driver_as_a_question_mark(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="vramwatch")
    nv = FakeNv(0)
    nv.fail[("nvmlSystemGetDriverVersion", None)] = err(E.NVML_ERROR_UNKNOWN)
    s = session(tmp_path, nv)
    assert s.ensure()
    assert messages(caplog, "NVML ready") == [(logging.INFO, "vramwatch: NVML ready (driver ?): 0 GPU(s) ")]


# --- identity at enumeration ---
@pytest.mark.parametrize("fn", ["nvmlDeviceGetName", "nvmlDeviceGetPciInfo"])
@pytest.mark.parametrize(
    ("code", "incomplete"),
    [
        (E.NVML_ERROR_NOT_SUPPORTED, False),
        (E.NVML_ERROR_NO_DATA, False),
        (E.NVML_ERROR_UNKNOWN, True),
        (E.NVML_ERROR_GPU_IS_LOST, True),
    ],
)
def test_a_failed_identity_string_leaves_it_empty_and_only_real_failures_make_it_incomplete(
    tmp_path, fn, code, incomplete
):
    nv = FakeNv(2)
    nv.fail[(fn, 1)] = err(code)
    s = session(tmp_path, nv)
    assert s.ensure()
    d0, d1 = s.devices
    field = "name" if fn == "nvmlDeviceGetName" else "pci_bus_id"
    assert getattr(d1, field) == "" and getattr(d0, field) != ""
    assert d1.uuid == "GPU-00000001-aaaa" and not d1.lost
    assert s.incomplete is incomplete
    # a re-enumeration that reads it clears the trouble
    del nv.fail[(fn, 1)]
    s.reenumerate()
    assert not s.incomplete and getattr(s.devices[1], field) != ""


@pytest.mark.parametrize(
    ("code", "incomplete"),
    [
        (E.NVML_ERROR_NOT_SUPPORTED, False),
        (E.NVML_ERROR_NOT_READY, False),
        (E.NVML_ERROR_UNKNOWN, True),
    ],
)
def test_mig_mode_unreadable_is_unsupported(tmp_path, code, incomplete):
    nv = FakeNv(1)
    nv.fail[("nvmlDeviceGetMigMode", 0)] = err(code)
    s = session(tmp_path, nv)
    assert s.ensure()
    assert s.devices[0].mig_mode == "unsupported" and s.incomplete is incomplete


def test_the_current_mig_mode_counts_not_the_pending_one(tmp_path):
    nv = FakeNv(2)
    nv.gpus[0]["mig"] = [0, 1]  # enabled after the next reset
    nv.gpus[1]["mig"] = [1, 0]  # disabled after the next reset
    s = session(tmp_path, nv)
    assert s.ensure()
    assert [d.mig_mode for d in s.devices] == ["disabled", "enabled"]


@pytest.mark.parametrize("fn", ["nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID"])
def test_a_gpu_that_cannot_be_identified_is_skipped_and_logged_once(tmp_path, caplog, fn):
    nv = FakeNv(3)
    nv.fail[(fn, 1)] = err(E.NVML_ERROR_UNKNOWN)
    s = session(tmp_path, nv)
    assert s.ensure()
    assert [d.index for d in s.devices] == [0, 2]  # the GPU after it is still enumerated
    assert s.incomplete and s.lost == frozenset()
    s.reenumerate()
    nv.fail[(fn, 2)] = err(E.NVML_ERROR_TIMEOUT)
    s.reenumerate()
    assert messages(caplog, "cannot be identified") == [
        (logging.WARNING, "vramwatch: NVML GPU 1 cannot be identified (UNKNOWN); skipping it for now"),
        (logging.WARNING, "vramwatch: NVML GPU 2 cannot be identified (TIMEOUT); skipping it for now"),
    ]
    nv.fail.clear()
    s.reenumerate()
    assert [d.index for d in s.devices] == [0, 1, 2] and not s.incomplete


def test_a_second_error_kind_on_the_same_gpu_logs_again(tmp_path, caplog):
    nv = FakeNv(1)
    nv.fail[("nvmlDeviceGetUUID", 0)] = err(E.NVML_ERROR_UNKNOWN)
    s = session(tmp_path, nv)
    s.ensure()
    nv.fail[("nvmlDeviceGetUUID", 0)] = err(E.NVML_ERROR_TIMEOUT)
    s.reenumerate()
    assert len(messages(caplog, "cannot be identified")) == 2


def test_nvml_gone_during_enumeration_fails_init(tmp_path):
    nv = FakeNv(2)
    nv.fail[("nvmlDeviceGetUUID", 1)] = err(E.NVML_ERROR_UNINITIALIZED)
    s = session(tmp_path, nv)
    assert not s.ensure() and s.devices == () and s.last_error.startswith("UNINITIALIZED: ")


# --- a GPU lost before it could be identified ---
def _remember(tmp_path: Any, *identities: spool.GpuIdentity) -> None:
    spool.write_node_readings(str(tmp_path), [], identities=identities)


@pytest.mark.parametrize("code", [E.NVML_ERROR_GPU_IS_LOST, E.NVML_ERROR_RESET_REQUIRED])
def test_a_gpu_lost_at_init_keeps_its_last_known_identity(tmp_path, caplog, code):
    _remember(
        tmp_path,
        spool.GpuIdentity(0, "GPU-old-0", "00000000:01:00.0", "NVIDIA H200"),
        spool.GpuIdentity(1, "GPU-old-1", "00000000:02:00.0", "NVIDIA H200 (was)"),
    )
    nv = FakeNv(3)
    nv.fail[("nvmlDeviceGetUUID", 1)] = err(code)
    s = session(tmp_path, nv)
    assert s.ensure()
    d = s.devices[1]
    assert d == nb.Device(1, "GPU-old-1", "NVIDIA H200 (was)", "00000000:02:00.0", "unsupported", ("handle", 1), True)
    assert [x.index for x in s.devices] == [0, 1, 2] and s.incomplete
    assert s.lost == frozenset({"GPU-old-1"})
    assert s.watch_key() == (1, ("GPU-00000000-aaaa", "GPU-00000002-aaaa"))
    assert messages(caplog, "already at init") == [
        (
            logging.ERROR,
            f"vramwatch: NVML GPU 1 is lost ({nb.NAMES[code]}) already at init; exported as gpu_up 0 with its "
            "last known uuid GPU-old-1",
        )
    ]


def test_a_gpu_lost_at_init_with_another_card_at_its_index_is_not_named_by_the_old_one(tmp_path, caplog):
    _remember(tmp_path, spool.GpuIdentity(0, "GPU-old-0", "00000000:99:00.0", "NVIDIA A100"))
    nv = FakeNv(1)
    nv.fail[("nvmlDeviceGetUUID", 0)] = err(E.NVML_ERROR_GPU_IS_LOST)
    s = session(tmp_path, nv)
    assert s.ensure()
    assert s.devices == (nb.Device(0, "", "", "00000000:01:00.0", "unsupported", ("handle", 0), True),)
    assert s.lost == frozenset({""})
    assert messages(caplog, "already at init") == [
        (
            logging.ERROR,
            "vramwatch: NVML GPU 0 is lost (GPU_IS_LOST) already at init; exported as gpu_up 0 with no uuid (none "
            "was ever read here)",
        )
    ]


def test_a_gpu_lost_at_init_whose_bus_id_cannot_be_read_takes_the_remembered_one(tmp_path, caplog):
    _remember(
        tmp_path,
        spool.GpuIdentity(0, "GPU-old-0", "00000000:01:00.0", "NVIDIA H200"),
        spool.GpuIdentity(1, "GPU-old-1", "00000000:02:00.0", "NVIDIA H200"),
    )
    nv = FakeNv(2)
    nv.fail[("nvmlDeviceGetUUID", 0)] = err(E.NVML_ERROR_GPU_IS_LOST)
    nv.fail[("nvmlDeviceGetPciInfo", 0)] = err(E.NVML_ERROR_GPU_IS_LOST)
    nv.fail[("nvmlDeviceGetHandleByIndex", 1)] = err(E.NVML_ERROR_GPU_IS_LOST)  # no handle at all
    s = session(tmp_path, nv)
    assert s.ensure()
    assert s.devices == (
        nb.Device(0, "GPU-old-0", "NVIDIA H200", "00000000:01:00.0", "unsupported", ("handle", 0), True),
        nb.Device(1, "GPU-old-1", "NVIDIA H200", "00000000:02:00.0", "unsupported", None, True),
    )
    assert nv.calls["nvmlDeviceGetPciInfo"] == 1  # not asked without a handle
    assert s.lost == frozenset({"GPU-old-0", "GPU-old-1"})
    assert [line[:40] for _, line in messages(caplog, "already at init")] == [
        "vramwatch: NVML GPU 0 is lost (GPU_IS_LO",
        "vramwatch: NVML GPU 1 is lost (GPU_IS_LO",
    ]  # each GPU's loss logged


def test_a_gpu_lost_at_init_has_its_bus_id_capped(tmp_path):
    nv = FakeNv(1)
    nv.gpus[0]["pci"] = "P" * 200
    nv.fail[("nvmlDeviceGetUUID", 0)] = err(E.NVML_ERROR_GPU_IS_LOST)
    s = session(tmp_path, nv)
    assert s.ensure() and s.devices[0].pci_bus_id == "P" * 32 and s.devices[0].lost


def test_a_gpu_lost_at_init_without_any_reading_has_no_identity(tmp_path):
    nv = FakeNv(1)
    nv.fail[("nvmlDeviceGetHandleByIndex", 0)] = err(E.NVML_ERROR_GPU_IS_LOST)
    s = session(tmp_path, nv)
    assert s.ensure()
    assert s.devices == (nb.Device(0, "", "", "", "unsupported", None, True),)
    assert s.seen_gpus  # it was enumerated


def test_the_readings_file_is_read_once_per_enumeration(tmp_path, monkeypatch):
    reads = []
    real = spool.read_gpu_identities

    def counted(d: str) -> Any:
        reads.append(d)
        return real(d)

    monkeypatch.setattr(spool, "read_gpu_identities", counted)
    nv = FakeNv(3)
    nv.fail[("nvmlDeviceGetUUID", None)] = err(E.NVML_ERROR_GPU_IS_LOST)
    s = session(tmp_path, nv)
    assert s.ensure() and len(s.devices) == 3
    assert reads == [str(tmp_path)]


def test_lost_gpus_stay_lost_across_a_reenumeration(tmp_path):
    _remember(tmp_path, spool.GpuIdentity(1, "GPU-old-1", "00000000:02:00.0", ""))
    nv = FakeNv(2)
    s = session(tmp_path, nv)
    assert s.ensure()
    s.set_lost("GPU-00000000-aaaa", True)
    nv.fail[("nvmlDeviceGetUUID", 1)] = err(E.NVML_ERROR_GPU_IS_LOST)
    s.reenumerate()
    assert s.lost == frozenset({"GPU-00000000-aaaa", "GPU-old-1"})


# --- reenumerate and mark_down ---
def test_reenumerate_marks_nvml_down_only_for_a_session_error(tmp_path, caplog):
    nv = FakeNv(1)
    clock = Clock()
    s = session(tmp_path, nv, clock)
    assert s.ensure()
    nv.fail[("nvmlDeviceGetCount", None)] = err(E.NVML_ERROR_UNKNOWN)
    s.reenumerate()  # swallowed: the devices stay
    assert s.ready and len(s.devices) == 1
    nv.fail[("nvmlDeviceGetCount", None)] = err(E.NVML_ERROR_DRIVER_NOT_LOADED)
    s.reenumerate()
    assert not s.ready and s.last_error == "DRIVER_NOT_LOADED" and s.next_try_in() == 1.0
    assert messages(caplog, "stopped answering") == [
        (logging.WARNING, "vramwatch: NVML stopped answering (DRIVER_NOT_LOADED); re-initialising with back-off")
    ]


def test_mark_down_backs_off_and_reinit_bumps_the_generation(tmp_path, caplog):
    nv = FakeNv(1)
    clock = Clock()
    s = session(tmp_path, nv, clock)
    assert s.ensure() and s.generation == 1
    s.mark_down(err(E.NVML_ERROR_UNINITIALIZED))
    assert not s.ready and s.last_error == "UNINITIALIZED" and s.next_try_in() == 1.0
    s.mark_down(err(E.NVML_ERROR_DRIVER_NOT_LOADED))  # already down: nothing changes, nothing logged
    assert s.last_error == "UNINITIALIZED" and s.next_try_in() == 1.0
    assert not s.ensure()  # within the back-off
    clock.t += 1.0
    assert s.ensure() and s.generation == 2
    s.mark_down(err(E.NVML_ERROR_UNINITIALIZED))
    assert s.next_try_in() == 1.0  # the init's success reset the back-off
    clock.t += 1.0
    nv.fail[("nvmlInit", None)] = err(E.NVML_ERROR_DRIVER_NOT_LOADED)
    assert not s.ensure() and s.next_try_in() == 2.0
    # NVML went away after it showed GPUs: a fault, logged as one
    assert s.absent_reason() == ""
    assert messages(caplog, "stopped answering") == [
        (logging.WARNING, "vramwatch: NVML stopped answering (UNINITIALIZED); re-initialising with back-off")
    ]
    ((level, _),) = messages(caplog, "NVML unavailable")
    assert level == logging.WARNING
    # another way of stopping logs once too
    nv.fail.clear()
    clock.t += 10.0
    assert s.ensure()
    s.mark_down(err(E.NVML_ERROR_DRIVER_NOT_LOADED))
    assert [line for _, line in messages(caplog, "stopped answering")][1:] == [
        "vramwatch: NVML stopped answering (DRIVER_NOT_LOADED); re-initialising with back-off"
    ]


def test_mark_down_doubles_the_back_off_up_to_a_minute(tmp_path):
    s = session(tmp_path, FakeNv(1))
    waits = []
    for _ in range(8):
        s.ready = True
        s.mark_down(err(E.NVML_ERROR_UNINITIALIZED))
        waits.append(s.next_try_in())
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]


def test_read_failed_logs_once_per_gpu_collector_and_error(tmp_path, caplog):
    s = session(tmp_path, FakeNv(2))
    assert s.ensure()
    d0, d1 = s.devices
    s.read_failed(d0, "nvml", "power", err(E.NVML_ERROR_UNKNOWN))
    s.read_failed(d0, "nvml", "clocks", err(E.NVML_ERROR_UNKNOWN))  # same GPU, collector, error: once
    s.read_failed(d0, "nvml", "power", err(E.NVML_ERROR_TIMEOUT))
    s.read_failed(d0, "xid", "events", err(E.NVML_ERROR_UNKNOWN))
    s.read_failed(d1, "nvml", "power", err(E.NVML_ERROR_UNKNOWN), "a detail")
    assert messages(caplog, "failed") == [
        (logging.WARNING, "vramwatch: GPU 0 GPU-00000000-aaaa: power failed (UNKNOWN)"),
        (logging.WARNING, "vramwatch: GPU 0 GPU-00000000-aaaa: power failed (TIMEOUT)"),
        (logging.WARNING, "vramwatch: GPU 0 GPU-00000000-aaaa: events failed (UNKNOWN)"),
        (logging.WARNING, "vramwatch: GPU 1 GPU-00000001-aaaa: power failed (a detail)"),
    ]


# --- lost GPUs and their callbacks ---
def test_set_lost_tells_the_callbacks_once_per_loss(tmp_path):
    s = session(tmp_path, FakeNv(2))
    assert s.ensure()
    d0, d1 = s.devices
    told: list[tuple[str, str]] = []

    def a(d: nb.Device) -> None:
        told.append(("a", d.uuid))

    def b(d: nb.Device) -> None:
        told.append(("b", d.uuid))

    s.on_lost(a)
    s.on_lost(b)
    s.set_lost(d1.uuid, True)
    s.set_lost(d1.uuid, True)  # still lost: not told again
    assert told == [("a", d1.uuid), ("b", d1.uuid)] and s.lost == frozenset({d1.uuid})
    assert s.watch_key() == (1, (d0.uuid,))
    s.set_lost(d1.uuid, False)
    assert s.lost == frozenset() and s.watch_key() == (1, (d0.uuid, d1.uuid))
    s.off_lost(a)
    s.off_lost(a)  # not registered any more: nothing happens
    s.set_lost(d1.uuid, True)
    assert told[2:] == [("b", d1.uuid)]
    s.set_lost("GPU-unknown", True)  # not a device of this session: nobody told
    assert told[3:] == [] and "GPU-unknown" in s.lost
    s.set_lost(d0.uuid, False)  # never lost: stays so
    assert d0.uuid not in s.lost and d1.uuid in s.lost


# --- one session per NVML ---
def test_one_session_per_real_nvml_and_per_simulated_spool(tmp_path, monkeypatch):
    monkeypatch.setattr(nb, "_SESSIONS", {})
    real_a = nb.session_for(Settings(spool_dir=str(tmp_path / "a")))
    real_b = nb.session_for(Settings(spool_dir=str(tmp_path / "b")))
    assert real_a is real_b  # the real NVML is one per process, whatever the spool
    sim_a = nb.session_for(Settings(simulate=True, spool_dir=str(tmp_path / "a")))
    sim_a2 = nb.session_for(Settings(simulate=True, spool_dir=str(tmp_path / "a")))
    sim_b = nb.session_for(Settings(simulate=True, spool_dir=str(tmp_path / "b")))
    assert sim_a is sim_a2 and sim_a is not sim_b and sim_a is not real_a
    assert sim_a.settings.spool_dir == str(tmp_path / "a") and isinstance(sim_a, nb.NvmlSession)
    assert set(nb._SESSIONS) == {(False, ""), (True, str(tmp_path / "a")), (True, str(tmp_path / "b"))}
