"""What ``vramwatch.start()`` sets up in a training process.

One daemon thread (:mod:`.sampler`) samples the allocator and the heartbeat every ``interval``
seconds (:mod:`.sample`) and publishes one file into the spool; the node's HTTP server lives in
another process (started here if none runs: :mod:`.server_spawn`), so a wedged training thread,
even one holding the GIL, never stops a scrape. OOM forensics, hygiene and the status line are
plugins (:mod:`.plugins`). After ``start()`` returns nothing raises into the job: failures are
logged once and published as ``vramwatch_collector_up`` 0.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from vramwatch import spool
from vramwatch._once import OnceLog
from vramwatch.config import Settings
from vramwatch.rank.allocator import AllocatorSampler
from vramwatch.rank.heartbeat import Heartbeat
from vramwatch.rank.identity import RankIdentity, identify
from vramwatch.rank.plugin_api import RankContext
from vramwatch.rank.plugins import Plugins, attach
from vramwatch.rank.roles import RoleWalker
from vramwatch.rank.sample import SampleAssembler
from vramwatch.rank.sampler import SamplerThread
from vramwatch.rank.server_spawn import ServerSpawner
from vramwatch.rank.sources import allocator_source
from vramwatch.spool import node

if TYPE_CHECKING:
    from vramwatch.rank.hygiene import Hygiene
    from vramwatch.rank.oom import OomWatcher
    from vramwatch.rank.status import StatusLine

log = logging.getLogger("vramwatch")

# the longest an OOM's publish waits for a tick in progress (a tick takes microseconds to milliseconds)
_PUBLISH_WAIT = 1.0


class Handle:
    """A running exporter in this process; returned by ``vramwatch.start()``."""

    def __init__(self, settings: Settings, sources: dict[str, str]) -> None:
        self.settings = settings
        self.sources = sources
        self.identity: RankIdentity = identify(
            settings.rank, settings.local_rank, settings.world_size, job_id=settings.job_id
        )
        self.heartbeat = Heartbeat(settings.interval)
        self.spool_dir = settings.resolved_spool_dir()
        # a node daemon (deploy/systemd/) serves every user's ranks: publish into its root, start no server
        self.node_root = None if settings.spool_dir or settings.serve == "off" else node.daemon_root(settings.node_dir)
        self._spool_error: OSError | None = None
        if self.node_root is not None:
            try:
                self.spool_dir = node.user_dir(self.node_root)
            except OSError as e:
                self._spool_error = e
                self.spool_dir = self.node_root  # what the one log line names
        self.hostname = settings.resolved_hostname()
        self.source = allocator_source(settings, self.spool_dir)
        self.sampler = AllocatorSampler(self.source, settings.largest_block_interval)
        self.plugins = Plugins()
        self.step_hooks: tuple[Any, ...] = ()  # run by step() on the training thread; empty when all are off
        self._log_once = OnceLog(log)
        self._assembler = SampleAssembler(
            self.identity, self.hostname, self.sampler, self.heartbeat, self.plugins, self._log_once
        )
        self._thread = SamplerThread(settings.interval, self.tick)
        self._spawner = ServerSpawner(
            settings, self.spool_dir, self._log_once, self.node_root is not None, self.identity.job_id
        )
        self._publisher: spool.RankPublisher | None = None
        self._pid = os.getpid()
        # one sample assembled and published at a time: the sampler thread's ticks and an OOM's
        # publish on the allocating thread never interleave (an older sample never lands last)
        self._publish_lock = threading.Lock()
        self._steps_at_exit = 0  # the step count when the exit reason was set (a handled signal trains on)

    # --- what tests, the demo and the status line's users reach for ---
    @property
    def sim(self) -> Any:
        """The simulated allocator under ``simulate`` (to drive it), else None."""
        return self.source if self.settings.simulate else None

    @property
    def oom(self) -> OomWatcher | None:
        return self.plugins.oom

    @property
    def hygiene(self) -> Hygiene | None:
        return self.plugins.hygiene

    @property
    def status(self) -> StatusLine | None:
        return self.plugins.status

    @property
    def url(self) -> str:
        host = self.settings.host if self.settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        scheme = "https" if self._tls() else "http"
        return f"{scheme}://{host}:{self.settings.port}/metrics"

    def _tls(self) -> bool:
        if not self.settings.web_config_file:
            return False
        try:
            from vramwatch.webconfig_schema import parse_web_config

            return parse_web_config(self.settings.web_config_file).tls is not None
        except Exception:  # noqa: BLE001 - only for the URL we print
            return False

    # --- lifecycle ---
    def start(self) -> None:
        if self.settings.serve == "off":
            return
        try:
            if self._spool_error is not None:
                raise self._spool_error
            self._publisher = spool.RankPublisher(
                self.spool_dir, self.identity.rank, self.identity.job_id, shared=self.node_root is not None
            )
        except OSError as e:
            self._log_once("spool", "vramwatch: cannot publish into %s (%s); exporting nothing", self.spool_dir, e)
            return
        try:
            # the server's spool, where its NVML readings are (the status line): the node root for the daemon
            server_spool = self.node_root or self.spool_dir
            ctx = RankContext(self.settings, self.identity, self.heartbeat, self.source, server_spool, self.publish_now)
            self.plugins = self._assembler.plugins = attach(ctx)
            self.step_hooks = self.plugins.step_hooks
        except Exception as e:  # noqa: BLE001 - the exporter still runs without them
            self._log_once("plugins", "vramwatch: OOM forensics / status / hygiene unavailable: %r", e)
        if self.node_root is not None and not spool.server_running(self.node_root):
            log.warning(
                "vramwatch: the node daemon's spool %s is set up but no daemon holds its lock; publishing there "
                "for when it is back (systemctl status vramwatch)",
                self.node_root,
            )
        self.tick()  # the server sees this rank at once
        self._thread.start()
        from vramwatch.rank import exits

        exits.install()  # how the rank ends, in its final sample

    def ended(self, reason: str, detail: str = "", at_exit: bool = False) -> None:
        """How this rank ends (:mod:`.exits`): the first reason stands. An exception or a signal is
        published at once (the process may be gone the next instant); ``finished`` by :meth:`stop`."""
        t = self._assembler.training
        hb = self.heartbeat
        if at_exit:
            if t.exit_reason == "signal" and hb.steps != self._steps_at_exit:
                t.exit_reason = t.exit_detail = ""  # the job handled the signal and trained on
            if not t.exit_reason and self._oom_was_last():
                t.exit_reason, t.exit_detail = "oom", ""  # a launcher caught the OOM's exception and exited
        if t.exit_reason:
            return
        t.exit_reason, t.exit_detail = reason, detail
        self._steps_at_exit = hb.steps
        if reason != "finished":
            self.publish_now()

    def _oom_was_last(self) -> bool:
        oom = self.plugins.oom
        if oom is None or not oom.count:
            return False
        from vramwatch.rank.oom import LAST_TIME

        last = max((v.get(LAST_TIME, 0.0) for v in oom.values.values()), default=0.0)
        return last >= self.heartbeat.last_step_time

    def stop(self) -> None:
        self.ended("finished")
        self._thread.stop()
        self.step_hooks = ()
        if self._publisher is not None and os.getpid() == self._pid:
            with self._publish_lock:  # the final sample, left in the spool for the server to serve after us
                self._publish(replace=False)
        self.plugins.close()
        roles = self._assembler.roles
        if roles is not None:
            roles.close()  # no optimizer-step hook left behind in the job
        self._assembler.training.close()
        self._spawner.release()
        if self._publisher is not None and os.getpid() == self._pid:
            self._publisher.close()
        self._publisher = None

    def step(self, loss: Any = None, grad_norm: Any = None, tokens: Any = None, samples: Any = None) -> None:
        self.heartbeat.step(loss, grad_norm, tokens, samples)
        for hook in self.step_hooks:
            hook()

    def watch(self, model: Any, optimizer: Any = None, flops_per_token: float | None = None) -> None:
        """Publish memory by role for ``model`` (and ``optimizer``); see :mod:`.roles`. A later call replaces it."""
        interval = self.settings.role_interval
        old = self._assembler.roles
        if old is not None:
            old.close()  # its optimizer-step hook goes with it
        if interval and (model is not None or optimizer is not None):
            self._assembler.roles = RoleWalker(model, optimizer, interval, self.settings.role_max_tensors)
        else:
            self._assembler.roles = None
        fpt = flops_per_token
        ok = isinstance(fpt, (int, float)) and not isinstance(fpt, bool) and 0 < fpt < float("inf")
        self._assembler.flops_per_token = float(fpt) if ok and fpt is not None else None

    @property
    def roles(self) -> RoleWalker | None:
        return self._assembler.roles

    def wake(self) -> None:
        """Publish a sample soon, on the sampler thread, rather than at the next interval (any thread)."""
        self._thread.wake()

    def publish_now(self) -> bool:
        """Publish a sample on this thread before returning: an OOM's, before the job sees the error.

        The sample is renamed into place, so it is whole in the spool whatever happens to the
        process next. Waits at most ``_PUBLISH_WAIT`` s for a tick in progress; if that runs out
        the sampler thread publishes it instead. Never raises; True when published here.
        """
        if os.getpid() != self._pid:  # a forked child publishes nothing (its copy of the lock may be held)
            return False
        if self._publisher is None or not self._publish_lock.acquire(timeout=_PUBLISH_WAIT):
            self.wake()
            return False
        try:
            self._publish(replace=True)
            return True
        finally:
            self._publish_lock.release()

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: Any) -> None:
        import vramwatch

        if vramwatch.current() is self:
            vramwatch.stop()
        else:
            self.stop()

    def _publish(self, replace: bool) -> None:
        try:
            sample = self._assembler.assemble()
            if self._publisher is not None:
                self._publisher.publish(sample, replace)
        except Exception as e:  # noqa: BLE001 - nothing escapes into the job
            self._log_once("publish:" + type(e).__name__, "vramwatch: publishing failed: %r", e)

    # --- on the sampler thread ---
    def tick(self) -> None:
        """One sample and publish. Never raises."""
        with self._publish_lock:
            self._publish(replace=False)
        try:
            self._spawner.ensure()
        except Exception as e:  # noqa: BLE001
            self._log_once("spawn:" + type(e).__name__, "vramwatch: cannot start the server: %r", e)
