"""The live torch.cuda.memory_stats() keys against the list recorded for the torch installed here
(tests/data/memory_stats_keys/), which the simulator's shape is checked against on CPU.

    python3 -m pytest -m gpu tests/gpu/test_gpu_memory_stats.py -q
"""

from __future__ import annotations

import pytest
from jobs import job_env, run_job
from memory_stats_keys import KEYS_DIR, fixed_keys, recorded, recorded_versions, short_version

pytestmark = pytest.mark.gpu

KEYS_JOB = r"""
import torch
x = torch.empty(1 << 20, device="cuda:0")  # the allocator is initialised and holds a block
done({"torch": torch.__version__, "backend": torch.cuda.get_allocator_backend(),
      "keys": sorted(torch.cuda.memory_stats(0))})
"""


def test_live_keys_are_the_recorded_keys_of_this_torch():
    pytest.importorskip("torch")
    res = run_job(KEYS_JOB, env=job_env(one_device=True))
    version = short_version(res["torch"])
    live = fixed_keys(dict.fromkeys(res["keys"]))
    print(f"torch {res['torch']} ({res['backend']}): {len(live)} keys")
    print("\n".join(sorted(live)))  # what to record in torch-X.Y.txt for a new torch
    assert res["backend"] == "native", "the lists are of the native allocator"
    assert version in recorded_versions(), f"no {KEYS_DIR}/torch-{version}.txt: record the keys printed above"
    want = recorded(version)
    assert live == want, f"new in torch {version}: {sorted(live - want)}; gone: {sorted(want - live)}"
