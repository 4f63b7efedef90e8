"""The spool keys a rank by (job id, rank): two jobs' rank 0 on one node are two files and two samples."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from samples import rank_sample

from vramwatch import spool
from vramwatch.spool import files
from vramwatch.spool.codec import SampleRejected


def _sample(rank: int, job_id: str, steps: int = 0) -> spool.RankSample:
    hb = spool.HeartbeatSnapshot(steps=steps)
    return rank_sample(rank, world_size=2, heartbeat=hb, job_id=job_id)


def test_the_same_rank_of_two_jobs_never_overwrites_the_other(tmp_path):
    d = str(tmp_path)
    pubs = [spool.RankPublisher(d, 0, "jobA"), spool.RankPublisher(d, 0, "jobB")]
    try:
        pubs[0].publish(_sample(0, "jobA", steps=3))
        pubs[1].publish(_sample(0, "jobB", steps=7))
        names = sorted(os.listdir(d))
        assert [n for n in names if n.endswith(".json")] == sorted(
            f"rank-0-{os.getpid()}-{j}.json" for j in ("jobA", "jobB")
        )
        live = spool.read_samples(d, 64)
        assert {(s.job_id, s.rank, s.heartbeat.steps) for s in live} == {("jobA", 0, 3), ("jobB", 0, 7)}
    finally:
        for p in pubs:
            p.close()


def test_a_file_name_holds_the_job_and_parses_back():
    stem = files.rank_stem(3, 123, "4711.0")
    m = files.RANK_FILE.match(stem + ".json")
    assert m is not None and m.groups() == ("3", "123", "4711.0")
    m = files.RANK_FILE.match(files.rank_stem(0, 9, "pid-5-x") + ".json")  # digits end at the first "-"
    assert m is not None and m.groups() == ("0", "9", "pid-5-x")
    assert files.RANK_FILE.match("rank-3-123.json").groups() == ("3", "123", None)  # a rank before job ids
    for bad in ("rank-3-123-.json", "rank-3-123-a b.json", "rank-3-123-" + "x" * 65 + ".json"):
        assert files.RANK_FILE.match(bad) is None


def test_the_job_id_travels_in_the_sample_and_is_left_out_when_empty():
    s = _sample(1, "train-42")
    assert spool.decode_sample(spool.encode_sample(s)) == s
    doc = json.loads(spool.encode_sample(dataclasses.replace(s, job_id="")))
    assert "job_id" not in doc  # an older reader sees the sample it always saw (SCHEMA_VERSION unchanged)
    assert spool.decode_sample(spool.encode_sample(dataclasses.replace(s, job_id=""))).job_id == ""


@pytest.mark.parametrize("bad", ["", "a b", "x" * 65, 7, None, "../x/y", 'a"}'])
def test_a_job_id_the_rank_could_not_have_written_is_refused(bad):
    doc = json.loads(spool.encode_sample(_sample(0, "ok")))
    doc["job_id"] = bad
    if bad is None:  # null: absent
        assert spool.decode_sample(json.dumps(doc).encode()).job_id == ""
        return
    with pytest.raises(SampleRejected) as e:
        spool.decode_sample(json.dumps(doc).encode())
    assert e.value.reason == "malformed" and "job_id" in e.value.detail
