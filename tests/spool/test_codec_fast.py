"""The rank's fast encoder writes exactly the bytes of the reference encoder, for any sample.

``encode_sample`` runs on the sampler thread once a second and assembles the payload from parts encoded
once; ``encode_sample_reference`` is the payload's definition (a dict, encoded whole). Same bytes, or the
same ValueError, whatever the sample holds: samples a rank publishes, and ones it never would (bools,
ints where floats go, non-finite numbers, odd strings), which the fast path hands to the reference.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from samples import rank_sample

from vramwatch import spool
from vramwatch.rank.heartbeat import BUCKETS
from vramwatch.spool import codec

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

finite = st.floats(allow_nan=False, allow_infinity=False)
anyfloat = st.floats()  # nan and the infinities too: both encoders must refuse them alike
number = st.one_of(finite, anyfloat, st.integers(-(2**70), 2**70), st.booleans())
text = st.text(max_size=12)  # quotes, backslashes, control characters, non-ASCII
ids = st.one_of(st.integers(0, 2**31), st.booleans())
keys = st.one_of(st.sampled_from(("torch_cuda_memory_allocated_bytes", "parameters", "other")), text)


def _values(v: st.SearchStrategy) -> st.SearchStrategy:
    return st.dictionaries(keys, v, max_size=6)


devices = st.lists(
    st.builds(
        spool.DeviceSample,
        ids,
        text,
        st.one_of(_values(finite), _values(number)),
        st.one_of(st.just({}), _values(finite), _values(number)),
    ),
    max_size=3,
)
heartbeats = st.builds(
    spool.HeartbeatSnapshot,
    ids,
    st.one_of(finite, number),
    st.one_of(st.just(BUCKETS), st.lists(finite, max_size=3).map(tuple)),
    st.lists(st.one_of(st.integers(0, 10**12), number), max_size=22).map(tuple),
    st.one_of(finite, number),
    st.one_of(st.none(), finite, number),
    st.one_of(st.none(), finite, number),
    st.one_of(st.none(), finite, number),
    st.one_of(st.none(), finite, number),
)
trainings = st.one_of(
    st.none(),
    st.builds(
        spool.TrainingState,
        st.sampled_from(("", "finished", "exception", "oom", "signal")),
        st.from_regex(r"[A-Za-z0-9_.]{0,64}", fullmatch=True),
        st.one_of(st.none(), st.integers(0, 2**63 - 1)),
        st.dictionaries(st.sampled_from(("collective", "data")), finite.filter(lambda x: x >= 0), max_size=2),
        st.sampled_from(("", "eval", "save", "other")),
        finite.filter(lambda x: x >= 0),
        st.dictionaries(st.sampled_from(("loss", "grad_norm")), st.integers(0, 2**40), max_size=2),
        st.sampled_from(("", "nan", "inf", "-inf")),
        st.sampled_from(("", "nan")),
    ),
)
samples = st.builds(
    spool.RankSample,
    ids,
    ids,
    ids,
    text,
    ids,
    st.one_of(finite, number),
    devices.map(tuple),
    st.one_of(st.none(), st.builds(spool.AllocatorInfo, text, text, text, text)),
    heartbeats,
    st.dictionaries(keys, st.builds(spool.CollectorHealth, ids, ids, st.one_of(finite, number)), max_size=3),
    st.one_of(st.none(), st.builds(spool.OomSnapshot, text, st.one_of(finite, number))),
    st.one_of(st.none(), finite, number),
    st.one_of(st.just(""), text),  # job_id
    trainings,
)

# what a rank publishes: only the plain types, every value finite; these must take the fast path
uint = st.integers(0, 2**31)
plain_values = st.dictionaries(keys, finite, max_size=6)
plain_samples = st.builds(
    spool.RankSample,
    uint,
    uint,
    st.integers(1, 2**31),
    text,
    st.integers(1, 2**31),
    finite,
    st.lists(st.builds(spool.DeviceSample, uint, text, plain_values, plain_values), max_size=3).map(tuple),
    st.one_of(st.none(), st.builds(spool.AllocatorInfo, text, text, text, text)),
    st.builds(
        spool.HeartbeatSnapshot,
        uint,
        finite,
        st.just(BUCKETS),
        st.lists(st.integers(0, 10**12), min_size=21, max_size=21).map(tuple),
        finite,
        st.one_of(st.none(), finite),
        st.one_of(st.none(), finite),
        st.one_of(st.none(), finite),
        st.one_of(st.none(), finite),
    ),
    st.dictionaries(keys, st.builds(spool.CollectorHealth, st.integers(0, 1), uint, finite), max_size=3),
    st.one_of(st.none(), st.builds(spool.OomSnapshot, text, finite)),
    st.one_of(st.none(), finite),
    st.one_of(st.just(""), st.from_regex(r"[A-Za-z0-9_.-]{1,64}", fullmatch=True)),  # job_id
    trainings,
)


def _both(s: spool.RankSample) -> tuple[object, object]:
    def run(fn):  # type: ignore[no-untyped-def]
        try:
            return fn(s)
        except ValueError as e:
            return ("ValueError", type(e))

    return run(codec.encode_sample), run(codec.encode_sample_reference)


@FUZZ
@given(samples)
def test_fast_encoder_writes_the_reference_bytes(s):
    fast, ref = _both(s)
    assert fast == ref


@FUZZ
@given(st.lists(samples, min_size=2, max_size=4))
def test_memoised_parts_never_leak_into_the_next_sample(seq):
    # the fast path keeps the last identity, device prefixes and allocator settings: a sample after
    # another (a bool rank after an int one, equal values of other types) still gets its own bytes
    for s in seq:
        fast, ref = _both(s)
        assert fast == ref


@FUZZ
@given(st.lists(plain_samples, min_size=1, max_size=3))
def test_a_plain_sample_is_encoded_by_the_fast_path(seq):
    for s in seq:
        ref = codec.encode_sample_reference(s)
        try:
            fast = codec._fast(s).encode()  # not encode_sample: a fallback would hide a fast path gone wrong
        except codec._Slow:  # one mapping's finite values summing past the largest float
            assert any(not math.isfinite(sum(m.values())) for d in s.devices for m in (d.values, d.roles))
            continue
        assert fast == ref


def _rank_sample(**over: object) -> spool.RankSample:
    base = dict(
        rank=3,
        local_rank=1,
        world_size=8,
        hostname="node-7",
        pid=4242,
        time=1796300000.25,
        devices=(
            spool.DeviceSample(
                0,
                "GPU-5e1a0000-0000-4000-8000-000000000000",
                {"torch_cuda_memory_allocated_bytes": 2147483648.0, "torch_cuda_memory_fragmentation_ratio": 1 / 3},
                {"parameters": 1.0, "gradients": 2.0, "optimizer_state": 3.0, "other": 4.0},
            ),
        ),
        allocator_info=spool.AllocatorInfo("native", "false", "", ""),
        heartbeat=spool.HeartbeatSnapshot(7, 1796300000.0, BUCKETS, (0,) * 20 + (7,), 3.5, 0.5, None, 768.0, None),
        collectors={"allocator": spool.CollectorHealth(1, 0, 3.5e-05), "roles": spool.CollectorHealth(1, 0, 0.0012)},
        flops_per_token=57600.0,
        job_id="4242.0",
    )
    base.update(over)
    return rank_sample(**base)


def test_a_rank_sample_takes_the_fast_path(monkeypatch):
    # the samples a rank publishes must not fall back (that would be the old cost, silently)
    def refuse(s):  # type: ignore[no-untyped-def]
        raise AssertionError("fell back to the reference encoder")

    s = _rank_sample()
    expected = codec.encode_sample_reference(s)
    monkeypatch.setattr(codec, "encode_sample_reference", refuse)
    assert codec.encode_sample(s) == expected
    assert (
        codec.encode_sample(_rank_sample(oom_snapshot=spool.OomSnapshot("/tmp/o.pickle", 1.0)))
        == json.dumps(
            json.loads(expected) | {"oom_snapshot": {"path": "/tmp/o.pickle", "time": 1.0}}, separators=(",", ":")
        ).encode()
    )


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_number_is_refused_as_before(bad):
    for s in (
        _rank_sample(time=bad),
        _rank_sample(devices=(spool.DeviceSample(0, "GPU-1", {"x": bad}),)),
        _rank_sample(devices=(spool.DeviceSample(0, "GPU-1", {}, {"other": bad}),)),
        _rank_sample(flops_per_token=bad),
    ):
        with pytest.raises(ValueError):
            codec.encode_sample(s)


def test_decodes_to_the_same_sample():
    s = _rank_sample()
    assert spool.decode_sample(codec.encode_sample(s)) == s


def test_the_training_state_round_trips_and_is_left_out_when_empty():
    t = spool.TrainingState(
        "exception",
        "InjectedFault",
        41,
        {"collective": 1.5, "data": 0.25},
        "eval",
        5.0,
        {"loss": 2, "grad_norm": 0},
        "nan",
        "",
    )
    s = _rank_sample(training=t)
    assert spool.decode_sample(codec.encode_sample(s)) == s
    assert b'"training"' not in codec.encode_sample(_rank_sample(training=spool.TrainingState()))


@pytest.mark.parametrize(
    "field,bad",
    [
        ("exit", {"reason": "killed", "detail": ""}),  # the server's word, never a rank's
        ("exit", {"reason": "finished", "detail": "a b"}),
        ("exit", {"reason": "finished", "detail": "x" * 65}),
        ("collectives", -1),
        ("waits", {"gpu": 1.0}),
        ("waits", {"data": -1.0}),
        ("phase", {"name": "lunch", "start": 1.0}),
        ("nonfinite", {"lr": 1}),
        ("loss", "NaN!"),
    ],
)
def test_a_training_field_out_of_its_set_is_refused(field, bad):
    doc = json.loads(codec.encode_sample(_rank_sample()))
    doc["training"] = {field: bad}
    with pytest.raises(spool.SampleRejected, match="training"):
        spool.decode_sample(json.dumps(doc).encode())
