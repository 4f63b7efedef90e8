"""One typed sample of this rank: the allocator read, the plugins' additions, the heartbeat."""

from __future__ import annotations

import os
import time
import weakref

from vramwatch._once import OnceLog
from vramwatch.rank.allocator import AllocatorSampler
from vramwatch.rank.heartbeat import Heartbeat
from vramwatch.rank.identity import RankIdentity
from vramwatch.rank.plugins import Plugins
from vramwatch.rank.roles import RoleWalker
from vramwatch.rank.training import TrainingReader
from vramwatch.spool import CollectorHealth, DeviceSample, RankSample


class SampleAssembler:
    """Builds the :class:`RankSample` the sampler thread publishes; never raises."""

    def __init__(
        self,
        identity: RankIdentity,
        hostname: str,
        sampler: AllocatorSampler,
        heartbeat: Heartbeat,
        plugins: Plugins,
        log_once: OnceLog,
    ) -> None:
        self.identity = identity
        self.hostname = hostname
        self.sampler = sampler
        self.heartbeat = heartbeat
        self.plugins = plugins
        self.log_once = log_once
        # the allocator is the one collector inside the rank: its health travels in each sample
        self.errors = 0
        self.roles: RoleWalker | None = None  # set by vramwatch.watch()
        self.flops_per_token: float | None = None
        self.training = TrainingReader(heartbeat)
        # os.getpid() is a system call each time (glibc caches it no more): read once, and again in a forked
        # child (which publishes nothing: the handle checks; held weakly, so a stopped rank is not kept alive)
        self._pid = os.getpid()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _refresh_pid(ref))

    def assemble(self) -> RankSample:
        t0 = time.perf_counter()
        devices: list[DeviceSample] = []
        up = 1
        try:
            devices = self.sampler.read()
        except Exception as e:  # noqa: BLE001 - reported as vramwatch_collector_up 0
            up = 0
            self.errors += 1
            self.log_once("allocator:" + type(e).__name__, "vramwatch: reading the allocator failed: %r", e)
        health = CollectorHealth(up, self.errors, time.perf_counter() - t0)
        merged, oom_snapshot = self.plugins.on_sample(devices)
        collectors = {"allocator": health}
        roles = self.roles
        if roles is not None:  # memory by role: a bounded pass on its own cadence, off the training thread
            roles.poll(time.monotonic())  # never raises: a failed walk is its health's up 0
            try:
                merged = roles.apply(merged)
            except Exception as e:  # noqa: BLE001 - the sample goes out without the roles
                self.log_once("roles:" + type(e).__name__, "vramwatch: memory by role failed: %r", e)
            collectors["roles"] = roles.health
        ident = self.identity
        hb = self.heartbeat.snapshot()
        try:
            training = self.training.read()
        except Exception as e:  # noqa: BLE001 - the sample goes out without it
            training = None
            self.log_once("training:" + type(e).__name__, "vramwatch: reading the training state failed: %r", e)
        # positional, in the schema's field order: keyword arguments cost a microsecond per sample here
        return RankSample(
            ident.rank,
            ident.local_rank,
            ident.world_size,
            self.hostname,
            self._pid,
            time.time(),
            tuple(merged),
            self.sampler.info() if merged else None,
            hb,
            collectors,
            oom_snapshot,
            self.flops_per_token,
            ident.job_id,
            training,
        )


def _refresh_pid(ref: weakref.ref[SampleAssembler]) -> None:
    a = ref()
    if a is not None:
        a._pid = os.getpid()
