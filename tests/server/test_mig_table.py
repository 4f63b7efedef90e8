"""MigTable (vramwatch/server/mig.py) driven directly, on a small fake ``pynvml`` of MIG cards.

test_mig.py runs it inside the NVML collector on the simulated NVML; these set what the simulator does
not: a current MIG mode that differs from the pending one, a card without a handle or without MIG before one
with it, each NVML error class at each step (mode, count, instance handle, memory), NVML re-initialising.
"""

from __future__ import annotations

import logging
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from vramwatch.config import Settings
from vramwatch.server import nvml_backend as nb
from vramwatch.server.mig import MigInstance, MigReading, MigTable, profile_of

E = pynvml
GIB = 1 << 30


def err(code: int) -> Exception:
    return E.NVMLError(code)


class FakeMigNv:
    """Cards by index; ``cards[i]["slots"]`` maps a slot to its instance (uuid, gi, ci, name, memory).
    ``fail[(function, key)]`` raises, key None for every call, else the card index or (card, slot)."""

    def __init__(self) -> None:
        self.cards: dict[int, dict[str, Any]] = {}
        self.fail: dict[tuple[str, Any], BaseException] = {}
        self.calls: Counter[str] = Counter()

    def card(self, i: int, slots: dict[int, str] | None = None, mode: Any = (1, 1), count: Any = 7) -> nb.Device:
        self.cards[i] = {
            "mode": list(mode),
            "count": count,
            "slots": {
                s: {"uuid": f"MIG-{i}-{s}-{tag}", "gi": s + 1, "ci": 0, "name": f"NVIDIA H200 MIG {tag}", "mem": s}
                for s, tag in (slots or {}).items()
            },
        }
        return nb.Device(i, f"GPU-{i}", "NVIDIA H200", f"0000:{i}", "enabled" if mode[0] else "disabled", ("gpu", i))

    def _check(self, fn: str, key: Any) -> None:
        self.calls[fn] += 1
        keys = [(fn, None), (fn, key)]
        if isinstance(key, tuple):
            keys.append((fn, key[0]))
        for k in keys:
            if k in self.fail:
                raise self.fail[k]

    def _slot(self, h: Any) -> dict[str, Any]:
        _, i, s = h
        try:
            return self.cards[i]["slots"][s]
        except KeyError:
            raise err(E.NVML_ERROR_INVALID_ARGUMENT) from None

    def nvmlDeviceGetMigMode(self, h: Any) -> Any:
        self._check("nvmlDeviceGetMigMode", h[1])
        return self.cards[h[1]]["mode"]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Any) -> Any:
        self._check("nvmlDeviceGetMaxMigDeviceCount", h[1])
        return self.cards[h[1]]["count"]

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Any, s: int) -> Any:
        self._check("nvmlDeviceGetMigDeviceHandleByIndex", (h[1], s))
        if s not in self.cards[h[1]]["slots"]:
            raise err(E.NVML_ERROR_NOT_FOUND)
        return ("mig", h[1], s)

    def nvmlDeviceGetUUID(self, h: Any) -> Any:
        self._check("nvmlDeviceGetUUID", h[1:])
        return self._slot(h)["uuid"].encode()

    def nvmlDeviceGetGpuInstanceId(self, h: Any) -> Any:
        self._check("nvmlDeviceGetGpuInstanceId", h[1:])
        return self._slot(h)["gi"]

    def nvmlDeviceGetComputeInstanceId(self, h: Any) -> Any:
        self._check("nvmlDeviceGetComputeInstanceId", h[1:])
        return self._slot(h)["ci"]

    def nvmlDeviceGetName(self, h: Any) -> Any:
        self._check("nvmlDeviceGetName", h[1:])
        return self._slot(h)["name"].encode()

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any:
        self._check("nvmlDeviceGetMemoryInfo", h[1:])
        g = self._slot(h)["mem"]
        return SimpleNamespace(total=10 * GIB + g, used=GIB + g, free=9 * GIB)


class Rig:
    def __init__(self, tmp_path: Any) -> None:
        self.nv = FakeMigNv()
        self.session = nb.NvmlSession(Settings(spool_dir=str(tmp_path)), module=self.nv)
        self.session.generation = 1
        self.table = MigTable(self.session)
        self.devices: list[nb.Device] = []

    def card(self, *a: Any, **k: Any) -> nb.Device:
        d = self.nv.card(len(self.devices), *a, **k)
        self.devices.append(d)
        return d

    def read(self, slow: bool = True, lost: set[str] | None = None) -> tuple[tuple[MigReading, ...], bool]:
        return self.table.read(self.devices, lost or set(), slow)

    def uuids(self, slow: bool = True, lost: set[str] | None = None) -> list[str]:
        return [r.instance.uuid for r in self.read(slow, lost)[0]]


def logged(caplog: Any, part: str) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if part in r.getMessage()]


def test_an_instance_is_read_with_its_ids_profile_and_memory(tmp_path):
    rig = Rig(tmp_path)
    rig.card({0: "1g.18gb", 3: "3g.71gb"})
    readings, ok = rig.read()
    assert ok
    assert readings == (
        MigReading(
            MigInstance(0, "GPU-0", "MIG-0-0-1g.18gb", "1", "0", "1g.18gb", ("mig", 0, 0)),
            (float(10 * GIB), float(GIB), float(9 * GIB)),
        ),
        MigReading(
            MigInstance(0, "GPU-0", "MIG-0-3-3g.71gb", "4", "0", "3g.71gb", ("mig", 0, 3)),
            (float(10 * GIB + 3), float(GIB + 3), float(9 * GIB)),
        ),
    )
    assert all(isinstance(v, float) for r in readings for v in r.memory or ())
    assert rig.nv.calls["nvmlDeviceGetMigDeviceHandleByIndex"] == 7  # every slot of the card


def test_the_instance_uuid_is_capped(tmp_path):
    rig = Rig(tmp_path)
    rig.card({0: "1g.18gb"})
    rig.nv.cards[0]["slots"][0]["uuid"] = "MIG-" + "a" * 200
    assert rig.uuids() == ["MIG-" + "a" * 92]


def test_a_count_larger_than_nvmls_maximum_is_not_believed(tmp_path):
    rig = Rig(tmp_path)
    rig.card({0: "1g.18gb"}, count=1000)
    rig.read()
    assert rig.nv.calls["nvmlDeviceGetMigDeviceHandleByIndex"] == 8
    rig2 = Rig(tmp_path)
    rig2.card({0: "1g.18gb"}, count=2)
    rig2.read()
    assert rig2.nv.calls["nvmlDeviceGetMigDeviceHandleByIndex"] == 2


def test_the_current_mig_mode_counts_not_the_pending_one(tmp_path):
    rig = Rig(tmp_path)
    rig.card({0: "1g.18gb"}, mode=(1, 0))  # on now, off after the next reset
    rig.card({0: "2g.35gb"}, mode=(0, 1))  # off now, on after the next reset
    rig.card({0: "3g.71gb"}, mode=(1, 1))
    assert rig.uuids() == ["MIG-0-0-1g.18gb", "MIG-2-0-3g.71gb"]


@pytest.mark.parametrize("skipped", ["unsupported", "no handle", "mig off", "remembered", "quiet", "lost"])
def test_a_card_skipped_before_a_mig_card_does_not_hide_it(tmp_path, skipped):
    rig = Rig(tmp_path)
    first = rig.card({0: "1g.18gb"}, mode=(0, 0) if skipped == "mig off" else (1, 1))
    if skipped == "unsupported":
        rig.devices[0] = nb.Device(0, "GPU-0", "", "", "unsupported", ("gpu", 0))
    elif skipped == "no handle":
        rig.devices[0] = nb.Device(0, "GPU-0", "", "", "enabled", None)
    elif skipped == "remembered":
        rig.nv.fail[("nvmlDeviceGetMaxMigDeviceCount", 0)] = err(E.NVML_ERROR_NOT_SUPPORTED)
        rig.read()
        del rig.nv.fail[("nvmlDeviceGetMaxMigDeviceCount", 0)]
    elif skipped in ("quiet", "lost"):
        code = E.NVML_ERROR_NO_DATA if skipped == "quiet" else E.NVML_ERROR_GPU_IS_LOST
        rig.nv.fail[("nvmlDeviceGetMigMode", 0)] = err(code)
    rig.card({0: "3g.71gb"})
    rig.nv.calls.clear()
    readings, ok = rig.read()
    assert [r.instance.uuid for r in readings] == ["MIG-1-0-3g.71gb"] and ok
    if skipped in ("unsupported", "no handle", "remembered"):
        assert rig.nv.calls["nvmlDeviceGetMigMode"] == 1  # the first card is not asked
    assert first.index == 0


def test_unsupported_enumeration_is_logged_once_at_info_and_not_asked_again(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="vramwatch")
    rig = Rig(tmp_path)
    rig.card({0: "1g.18gb"})
    rig.card({0: "1g.18gb"})
    rig.nv.fail[("nvmlDeviceGetMaxMigDeviceCount", None)] = err(E.NVML_ERROR_NOT_SUPPORTED)
    for _ in range(3):
        readings, ok = rig.read()
        assert readings == () and ok
    assert rig.nv.calls["nvmlDeviceGetMaxMigDeviceCount"] == 2
    msg = "MIG devices cannot be enumerated (NOT_SUPPORTED); not asked again until NVML re-inits"
    assert logged(caplog, "cannot be enumerated") == [
        (logging.INFO, f"vramwatch: GPU 0 GPU-0: {msg}"),
        (logging.INFO, f"vramwatch: GPU 1 GPU-1: {msg}"),
    ]


def test_nvml_reinitialising_forgets_what_was_unsupported(tmp_path):
    rig = Rig(tmp_path)
    rig.card({0: "1g.18gb"})
    rig.card({0: "2g.35gb"})
    rig.nv.fail[("nvmlDeviceGetMaxMigDeviceCount", 0)] = err(E.NVML_ERROR_NOT_SUPPORTED)
    rig.nv.fail[("nvmlDeviceGetMemoryInfo", 1)] = err(E.NVML_ERROR_NOT_SUPPORTED)
    assert rig.read()[0] == (MigReading(rig.table.instances[0], None),)
    rig.nv.fail.clear()
    assert [r.memory for r in rig.read()[0]] == [None]  # remembered: neither is asked again
    rig.session.generation += 1  # NVML re-initialised: new handles, new verdicts
    readings, ok = rig.read(slow=False)  # enumerated at once, not on the next slow read
    assert ok and [(r.instance.uuid, r.memory is not None) for r in readings] == [
        ("MIG-0-0-1g.18gb", True),
        ("MIG-1-0-2g.35gb", True),
    ]
    rig.nv.calls.clear()
    rig.read(slow=False)
    assert rig.nv.calls["nvmlDeviceGetMaxMigDeviceCount"] == 0  # once per generation


def test_the_first_read_enumerates_even_when_not_slow(tmp_path):
    rig = Rig(tmp_path)
    rig.session.generation = 0  # a session that never re-initialised
    rig.card({0: "1g.18gb"})
    assert rig.uuids(slow=False) == ["MIG-0-0-1g.18gb"]
    rig.card({0: "2g.35gb"})
    assert rig.uuids(slow=False) == ["MIG-0-0-1g.18gb"]  # a fast read enumerates nothing new
    assert rig.uuids(slow=True) == ["MIG-0-0-1g.18gb", "MIG-1-0-2g.35gb"]


@pytest.mark.parametrize("step", ["nvmlDeviceGetMigMode", "nvmlDeviceGetMaxMigDeviceCount"])
def test_a_transient_enumeration_failure_keeps_the_cards_instances_and_says_so(tmp_path, caplog, step):
    rig = Rig(tmp_path)
    rig.card({0: "1g.18gb"})
    rig.card({0: "2g.35gb"})
    assert len(rig.read()[0]) == 2
    rig.nv.cards[0]["slots"][1] = {"uuid": "MIG-new", "gi": 9, "ci": 0, "name": "X MIG 1g.18gb", "mem": 0}
    rig.nv.fail[(step, 0)] = err(E.NVML_ERROR_UNKNOWN)
    readings, ok = rig.read()
    assert not ok and [r.instance.uuid for r in readings] == ["MIG-0-0-1g.18gb", "MIG-1-0-2g.35gb"]
    assert logged(caplog, "MIG enumeration") == [
        (logging.WARNING, "vramwatch: GPU 0 GPU-0: MIG enumeration failed (UNKNOWN)")
    ]
    del rig.nv.fail[(step, 0)]
    readings, ok = rig.read()
    assert ok and [r.instance.uuid for r in readings] == ["MIG-0-0-1g.18gb", "MIG-new", "MIG-1-0-2g.35gb"]


def test_a_transient_instance_failure_keeps_the_cards_previous_instances(tmp_path, caplog):
    rig = Rig(tmp_path)
    rig.card({0: "1g.18gb", 2: "1g.18gb"})
    rig.card({0: "2g.35gb"})
    rig.nv.fail[("nvmlDeviceGetMigDeviceHandleByIndex", (0, 2))] = err(E.NVML_ERROR_TIMEOUT)
    readings, ok = rig.read()  # no previous instances: what was found is shown
    assert not ok and [r.instance.uuid for r in readings] == ["MIG-0-0-1g.18gb", "MIG-1-0-2g.35gb"]
    del rig.nv.fail[("nvmlDeviceGetMigDeviceHandleByIndex", (0, 2))]
    assert rig.read()[1]
    del rig.nv.cards[0]["slots"][0]
    rig.nv.fail[("nvmlDeviceGetUUID", (0, 2))] = err(E.NVML_ERROR_UNKNOWN)
    readings, ok = rig.read()  # one instance unreadable: the card's last list stays, not a half one
    assert not ok
    assert [m.uuid for m in rig.table.instances] == ["MIG-0-0-1g.18gb", "MIG-0-2-1g.18gb", "MIG-1-0-2g.35gb"]
    # (the destroyed one's memory read then fails as gone: left out of the readings, looked for again)
    assert [r.instance.uuid for r in readings] == ["MIG-0-2-1g.18gb", "MIG-1-0-2g.35gb"]
    assert logged(caplog, "failed (") == [
        (logging.WARNING, "vramwatch: GPU 0 GPU-0: MIG device 2 failed (TIMEOUT)"),
        (logging.WARNING, "vramwatch: GPU 0 GPU-0: MIG device 2 failed (UNKNOWN)"),
    ]


@pytest.mark.parametrize(
    "code",
    [
        E.NVML_ERROR_NOT_FOUND,
        E.NVML_ERROR_INVALID_ARGUMENT,
        E.NVML_ERROR_NOT_SUPPORTED,
        E.NVML_ERROR_NO_DATA,
        E.NVML_ERROR_NOT_READY,
        E.NVML_ERROR_GPU_IS_LOST,
    ],
)
def test_the_answers_that_mean_no_instance_at_a_slot(tmp_path, caplog, code):
    rig = Rig(tmp_path)
    rig.card({0: "1g.18gb", 1: "1g.18gb"})
    rig.nv.fail[("nvmlDeviceGetMigDeviceHandleByIndex", (0, 0))] = err(code)
    readings, ok = rig.read()
    assert ok and [r.instance.uuid for r in readings] == ["MIG-0-1-1g.18gb"]
    assert not logged(caplog, "failed")


@pytest.mark.parametrize(
    "where", [("nvmlDeviceGetMigMode", 0), ("nvmlDeviceGetMigDeviceHandleByIndex", (0, 0)), ("nvmlDeviceGetName", None)]
)
def test_nvml_gone_anywhere_in_the_enumeration_goes_up(tmp_path, where):
    rig = Rig(tmp_path)
    rig.card({0: "1g.18gb"})
    rig.nv.fail[where] = err(E.NVML_ERROR_UNINITIALIZED)
    with pytest.raises(E.NVMLError_Uninitialized):
        rig.read()


def test_an_id_or_name_nvml_cannot_give_leaves_its_label_empty(tmp_path):
    rig = Rig(tmp_path)
    rig.card({0: "1g.18gb"})
    rig.nv.fail[("nvmlDeviceGetComputeInstanceId", None)] = err(E.NVML_ERROR_UNKNOWN)
    rig.nv.fail[("nvmlDeviceGetName", None)] = err(E.NVML_ERROR_NOT_SUPPORTED)
    ((r,), ok) = rig.read()
    assert ok and (r.instance.gpu_instance_id, r.instance.compute_instance_id, r.instance.profile) == ("1", "", "")


# --- memory, every read ---
def test_memory_is_read_every_read_and_enumeration_only_when_slow(tmp_path):
    rig = Rig(tmp_path)
    rig.card({0: "1g.18gb", 1: "1g.18gb"})
    rig.read()
    rig.nv.calls.clear()
    for _ in range(3):
        assert len(rig.read(slow=False)[0]) == 2
    assert rig.nv.calls == Counter({"nvmlDeviceGetMemoryInfo": 6})


def test_a_lost_card_has_no_readings_and_the_next_card_still_has(tmp_path):
    rig = Rig(tmp_path)
    rig.card({0: "1g.18gb"})
    rig.card({0: "2g.35gb"})
    rig.read()
    assert rig.uuids(slow=False, lost={"GPU-0"}) == ["MIG-1-0-2g.35gb"]
    rig.nv.calls.clear()
    assert rig.uuids(slow=True, lost={"GPU-0"}) == ["MIG-1-0-2g.35gb"]
    # nor enumerated: a lost card is not asked (its calls fail, slowly), and its instances are dropped
    assert rig.nv.calls["nvmlDeviceGetMigMode"] == 1 and rig.nv.calls["nvmlDeviceGetMaxMigDeviceCount"] == 1
    assert [m.parent_uuid for m in rig.table.instances] == ["GPU-1"]
    rig.devices[0] = nb.Device(0, "GPU-0", "", "", "unsupported", ("gpu", 0), lost=True)
    assert rig.uuids(slow=True) == ["MIG-1-0-2g.35gb"]  # lost already at init


@pytest.mark.parametrize("code", [E.NVML_ERROR_NOT_FOUND, E.NVML_ERROR_INVALID_ARGUMENT])
def test_an_instance_gone_under_its_memory_read_is_left_out_and_looked_for_on_the_next_read(tmp_path, code):
    rig = Rig(tmp_path)
    rig.card({0: "1g.18gb", 1: "1g.18gb"})
    rig.read()
    rig.nv.fail[("nvmlDeviceGetMemoryInfo", (0, 0))] = err(code)
    readings, ok = rig.read(slow=False)
    assert ok and [r.instance.uuid for r in readings] == ["MIG-0-1-1g.18gb"]
    del rig.nv.fail[("nvmlDeviceGetMemoryInfo", (0, 0))]
    rig.nv.calls.clear()
    assert len(rig.read(slow=False)[0]) == 2
    assert rig.nv.calls["nvmlDeviceGetMaxMigDeviceCount"] == 1  # enumerated again, once
    rig.read(slow=False)
    assert rig.nv.calls["nvmlDeviceGetMaxMigDeviceCount"] == 1


def test_unsupported_memory_is_remembered_per_instance_and_logged_once_at_info(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="vramwatch")
    rig = Rig(tmp_path)
    rig.card({0: "1g.18gb", 1: "1g.18gb"})
    rig.nv.fail[("nvmlDeviceGetMemoryInfo", (0, 0))] = err(E.NVML_ERROR_NOT_SUPPORTED)
    for _ in range(3):
        readings, ok = rig.read(slow=False)
        assert ok and [r.memory is None for r in readings] == [True, False]
    assert rig.nv.calls["nvmlDeviceGetMemoryInfo"] == 1 + 3
    assert logged(caplog, "not asked again") == [
        (
            logging.INFO,
            "vramwatch: GPU 0 MIG MIG-0-0-1g.18gb: memory is NOT_SUPPORTED; not asked again until NVML re-inits",
        )
    ]


def test_quiet_memory_is_an_empty_reading_asked_again(tmp_path, caplog):
    rig = Rig(tmp_path)
    rig.card({0: "1g.18gb"})
    rig.nv.fail[("nvmlDeviceGetMemoryInfo", None)] = err(E.NVML_ERROR_NO_DATA)
    for _ in range(2):
        readings, ok = rig.read(slow=False)
        assert ok and [r.memory for r in readings] == [None]
    assert rig.nv.calls["nvmlDeviceGetMemoryInfo"] == 2 and not caplog.records
    assert rig.nv.calls["nvmlDeviceGetMaxMigDeviceCount"] == 1  # not taken for a destroyed instance


def test_a_transient_memory_failure_fails_the_read_and_logs_once_per_error(tmp_path, caplog):
    rig = Rig(tmp_path)
    rig.card({0: "1g.18gb"})
    rig.nv.fail[("nvmlDeviceGetMemoryInfo", None)] = err(E.NVML_ERROR_UNKNOWN)
    for _ in range(2):
        readings, ok = rig.read(slow=False)
        assert not ok and [r.memory for r in readings] == [None]
    rig.nv.fail[("nvmlDeviceGetMemoryInfo", None)] = err(E.NVML_ERROR_TIMEOUT)
    assert not rig.read(slow=False)[1]
    assert logged(caplog, "reading memory") == [
        (logging.WARNING, "vramwatch: GPU 0 MIG MIG-0-0-1g.18gb: reading memory failed (UNKNOWN)"),
        (logging.WARNING, "vramwatch: GPU 0 MIG MIG-0-0-1g.18gb: reading memory failed (TIMEOUT)"),
    ]
    del rig.nv.fail[("nvmlDeviceGetMemoryInfo", None)]
    assert rig.read(slow=False)[1]


def test_nvml_gone_under_a_memory_read_goes_up(tmp_path):
    rig = Rig(tmp_path)
    rig.card({0: "1g.18gb"})
    rig.read()
    rig.nv.fail[("nvmlDeviceGetMemoryInfo", None)] = err(E.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(E.NVMLError_DriverNotLoaded):
        rig.read(slow=False)


def test_profile_of_needs_a_gpu_name_before_the_profile_and_caps_it():
    assert profile_of(" MIG 1g.10gb") == ""  # no GPU name before " MIG "
    assert profile_of("NVIDIA H100 MIG " + "7" * 40) == "7" * 32
    assert profile_of("NVIDIA H100 MIG  1g.10gb ") == "1g.10gb"
