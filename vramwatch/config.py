"""One typed, frozen configuration with one precedence.

Highest first: keyword arguments to ``start()`` (or CLI flags), ``VRAMWATCH_*``
environment variables, the YAML file named by ``config_file`` /
``VRAMWATCH_CONFIG_FILE``, then the defaults below. Every error names the key,
the value and the source it came from.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vramwatch.errors import ConfigError
from vramwatch.errors import shown as _shown
from vramwatch.spool.schema import JOB_ID, JOB_ID_MAX

__all__ = ["DEFAULT_PORT", "ENV_PREFIX", "FIELDS", "ConfigError", "Settings", "load"]

ENV_PREFIX = "VRAMWATCH_"
DEFAULT_PORT = 9488


class Within:
    """A numeric setting's allowed range, ``lo``-``hi``, plus one ``off`` value outside it (0: turned off).

    Every number has one: a value the code cannot live with (an interval of 1e10 s overflows the sampler's
    wait and kills it silently, 1e-9 s spins a core) is refused at start, naming the range.
    """

    def __init__(self, lo: float, hi: float, off: float | None = None, unit: str = "") -> None:
        self.lo, self.hi, self.off, self.unit = lo, hi, off, unit

    def describe(self) -> str:
        span = f"{_num(self.lo)}-{_num(self.hi)}{self.unit}"
        return span if self.off is None else f"{_num(self.off)} or {span}"

    def __call__(self, v: float) -> None:
        if v != self.off and not self.lo <= v <= self.hi:
            raise ValueError(f"must be {self.describe()}")


def _num(v: float) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


MAX_INT32 = 2**31 - 1
_port = Within(1, 65535)
_seconds = Within(0.01, 3600.0, unit=" s")  # sampling and reading cadences


# RFC 1123 host name label: letters, digits and inner hyphens, 1-63 characters
_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _host(v: str) -> None:
    if not v:
        raise ValueError("must not be empty")
    try:
        ipaddress.ip_address(v)
    except ValueError:
        labels = v[:-1].split(".") if v.endswith(".") else v.split(".")
        if len(v) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
            raise ValueError("must be an IP address or host name") from None


def _choice(*options: str) -> Callable[[str], None]:
    def check(v: str) -> None:
        if v not in options:
            raise ValueError("must be one of " + ", ".join(options))

    return check


def _label_value(v: str) -> None:
    if len(v) > 128:
        raise ValueError("must be at most 128 characters")


def _job_id(v: str) -> None:
    if v and not JOB_ID.fullmatch(v):  # taken as given: a label value and part of a spool file name
        raise ValueError(f"must be at most {JOB_ID_MAX} letters, digits and _ . - (or empty)")


def _web_config(v: str) -> None:
    if v:  # the whole file, certificates included, so a bad one fails before the job runs
        from vramwatch.webconfig_schema import check_web_config

        check_web_config(v)  # its ConfigError (a ValueError) names the field inside the file


def _opt(default: Any, doc: str, check: Callable[[Any], None] | None = None, server: bool = False) -> Any:
    """A setting; ``server``: one the node's server serves by (see SERVER_SETTINGS)."""
    if isinstance(check, Within):  # the range is stated once, here, for the docs, --help and the error
        doc = f"{doc} Allowed: {check.describe()}."
    return field(default=default, metadata={"doc": doc, "check": check, "server": server})


@dataclass(frozen=True)
class Settings:
    port: int = _opt(DEFAULT_PORT, "TCP port of the node's one scrape target.", _port, server=True)
    host: str = _opt(
        "127.0.0.1",
        "Address the server binds. Loopback by default: set 0.0.0.0 (with a "
        "NetworkPolicy or firewall) for a cluster scrape.",
        _host,
        server=True,
    )
    serve: str = _opt(
        "auto",
        "auto: a rank starts the node's server when none runs; external: a sidecar "
        "or `vramwatch serve` runs it; off: publish nothing.",
        _choice("auto", "external", "off"),
    )
    spool_dir: str = _opt(
        "",
        "Where ranks publish samples for the server (default "
        "/dev/shm/vramwatch-<port>, a tmpfs shared by the node's ranks).",
    )
    node_dir: str = _opt(
        "/run/vramwatch",
        "The node daemon's spool root (`vramwatch serve --node`, deploy/systemd/). A rank with no spool_dir of "
        "its own publishes there, into a directory of its user's, and starts no server, when the daemon set it "
        "up; empty: never.",
    )
    interval: float = _opt(
        2.0,
        "Seconds between allocator samples in each rank: a scrape sees a sample at most this old (an OOM's is "
        "published at once). Each sample costs ~0.4 ms of CPU on an idle core; 1 s doubles that.",
        _seconds,
    )
    largest_block_interval: float = _opt(
        30.0,
        "Seconds between allocator snapshots for the largest free block (they walk every block; 0 turns them off).",
        Within(0.01, 86400.0, off=0, unit=" s"),
    )
    role_interval: float = _opt(
        30.0,
        "Seconds between walks of the model and optimizer given to vramwatch.watch() (memory by role; "
        "0 turns them off).",
        Within(0.01, 86400.0, off=0, unit=" s"),
    )
    role_max_tensors: int = _opt(
        4096,
        "Most tensors one sample's walk pass reads; a larger model is walked over several samples "
        "(its figures publish once the walk completes).",
        Within(1, 10**8),
    )
    nvml: bool = _opt(True, "Collect NVML device readings in the server.", server=True)
    nvml_interval: float = _opt(1.0, "Seconds between fast NVML reads.", _seconds, server=True)
    nvml_slow_interval: float = _opt(
        10.0,
        "Seconds between slow NVML reads (energy, PCIe replays, ECC, remapped rows, processes, GPM, NVLink errors, "
        "MIG instances).",
        _seconds,
        server=True,
    )
    gpus: str = _opt(
        "all", "all: every GPU of the node; job: only GPUs a rank uses.", _choice("all", "job"), server=True
    )
    xid: bool = _opt(True, "Watch Xid events on every GPU.", server=True)
    processes: bool = _opt(True, "Count foreign compute processes on the job's GPUs.", server=True)
    gpm: bool = _opt(
        True,
        "Read GPU activity from NVML GPM (SM, tensor, DRAM, PCIe, NVLink; Hopper and newer) on the slow cadence.",
        server=True,
    )
    nvlink: bool = _opt(True, "Read NVLink error counters of each active link on the slow cadence.", server=True)
    simulate: bool = _opt(False, "Use the simulated GPU instead of torch and NVML (tests, demo).", server=True)
    hostname: str = _opt("", "hostname label (default: this host's name).", _label_value)
    rank: int = _opt(-1, "Global rank (-1: from RANK, SLURM_PROCID, ...).", Within(0, MAX_INT32, off=-1))
    local_rank: int = _opt(-1, "Local rank (-1: from LOCAL_RANK, SLURM_LOCALID, ...).", Within(0, MAX_INT32, off=-1))
    world_size: int = _opt(-1, "World size (-1: from WORLD_SIZE, SLURM_NTASKS, ...).", Within(1, MAX_INT32, off=-1))
    job_id: str = _opt(
        "",
        "The job this rank belongs to, the job_id label of its series (empty: from SLURM_JOB_ID[.SLURM_STEP_ID], "
        "TORCHELASTIC_RUN_ID, PMIX_NAMESPACE, the master's address and port, else a hash naming the launcher "
        "or the process; see README, Job identity). On Kubernetes, the Job's name through the downward API. "
        "At most 64 letters, digits and _ . -.",
        _job_id,
    )
    max_ranks: int = _opt(
        64,
        "Most ranks one target serves, of all jobs on the node; more are dropped (bounded cardinality).",
        Within(1, 1024),
        server=True,
    )
    dead_rank_grace_seconds: float = _opt(
        90.0,
        "Seconds a rank's final sample (the OOM that killed it) stays served after its last publish, so every "
        "Prometheus scraping the target sees it: at least 2-3 scrape intervals (see docs/nothing-lost.md).",
        Within(1.0, 3600.0, unit=" s"),
        server=True,
    )
    linger: float = _opt(
        10.0, "Seconds a rank-started server stays up after the last rank left.", Within(0.0, 86400.0, unit=" s")
    )
    max_connections: int = _opt(8, "Concurrent HTTP requests served; more get 503.", Within(1, 256), server=True)
    web_config_file: str = _opt(
        "", "exporter-toolkit web config (TLS, basic auth): see docs/security.md.", _web_config, server=True
    )
    status_every: int = _opt(0, "Print a status line every N steps (0: off).", Within(0, 10**9))
    status_all_ranks: bool = _opt(False, "Status line on every rank, not only rank 0.")
    oom_snapshot_dir: str = _opt("", "Write a memory snapshot on OOM into this directory (empty: off).")
    oom_history_entries: int = _opt(
        0, "Allocator history entries to keep for OOM snapshots (0: no history, it costs).", Within(0, 10**7)
    )
    oom_snapshot_max_files: int = _opt(5, "Most OOM snapshots kept in the directory.", Within(1, 10000))
    oom_snapshot_max_bytes: int = _opt(
        1 << 30, "Most bytes of OOM snapshots kept in the directory.", Within(1, 1 << 40)
    )
    reclaim_threshold: float = _opt(
        0.0,
        "Empty the cache between steps when reserved passes this share of the memory limit (0: off).",
        Within(0.0, 1.0),
    )
    log_level: str = _opt(
        "WARNING", "Logging level of the vramwatch logger.", _choice("DEBUG", "INFO", "WARNING", "ERROR")
    )
    config_file: str = _opt("", "YAML file of settings (keys as here).")

    def resolved_spool_dir(self) -> str:
        if self.spool_dir:
            return self.spool_dir
        base = "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")
        return os.path.join(base, f"vramwatch-{self.port}")

    def resolved_hostname(self) -> str:
        return self.hostname or socket.gethostname()

    def to_env(self) -> dict[str, str]:
        """The settings that differ from the defaults, as VRAMWATCH_* variables."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v != f.default and f.name != "config_file":
                out[ENV_PREFIX + f.name.upper()] = _to_text(v)
        return out


FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(Settings)}

# What a node server does with the settings it was started with: a rank that meets a server started with
# others is not served as it asked (server.json carries them; rank/server_spawn.py compares)
SERVER_SETTINGS = tuple(name for name, f in FIELDS.items() if f.metadata["server"])


def server_settings(settings: Settings) -> dict[str, str]:
    """The settings a server serves by, as text (what ``server.json`` records)."""
    return {name: _to_text(getattr(settings, name)) for name in SERVER_SETTINGS}


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _to_text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _coerce(name: str, raw: Any, source: str) -> Any:
    f = FIELDS[name]
    kind: type = type(f.default)

    def fail(why: str) -> ConfigError:
        return ConfigError(f"invalid setting {name}={_shown(raw)} (from {source}): {why}")

    value: Any
    try:
        if kind is bool:
            if isinstance(raw, bool):
                value = raw
            elif isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
                value = raw.strip().lower() in _TRUE
            else:
                raise fail("must be true or false")
        elif kind is int:
            if isinstance(raw, bool) or isinstance(raw, float) and not raw.is_integer():
                raise fail("must be an integer")
            value = int(raw.strip() if isinstance(raw, str) else raw)
        elif kind is float:
            if isinstance(raw, bool):
                raise fail("must be a number")
            value = float(raw.strip() if isinstance(raw, str) else raw)
            if value != value or value in (float("inf"), float("-inf")):
                raise fail("must be a finite number")
        else:
            if not isinstance(raw, (str, int, float)) or isinstance(raw, bool):
                raise fail("must be a string")
            value = str(raw)
            if "\x00" in value:
                raise fail("must not contain NUL")
    except ConfigError:
        raise
    except (TypeError, ValueError, OverflowError):
        raise fail(f"must be {'an integer' if kind is int else 'a number'}") from None
    check = f.metadata.get("check")
    if check is not None:
        try:
            check(value)
        except ValueError as e:
            raise fail(str(e)) from None
    return value


def _from_file(path: str, source: str) -> dict[str, Any]:
    from vramwatch.yaml_bounded import UnsafeYaml, load_bounded_yaml  # lazily: only when a file is named

    def fail(why: str) -> ConfigError:
        return ConfigError(f"invalid setting config_file={_shown(path)} (from {source}): {why}")

    try:
        data = load_bounded_yaml(path)
    except OSError as e:
        raise fail(str(e.strerror or e)) from None
    except UnsafeYaml as e:  # too large, an alias, too deep, not UTF-8, not YAML: one line each
        raise fail(f"refused: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"invalid setting config_file={_shown(path)} (from {source}): must hold a mapping")
    return data


def load(
    kwargs: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> tuple[Settings, dict[str, str]]:
    """Resolve settings; returns them and, per key, the source it came from."""
    kwargs = dict(kwargs or {})
    env = os.environ if env is None else env
    layers: list[tuple[str, dict[str, Any]]] = []

    for key in kwargs:
        if key not in FIELDS:
            raise ConfigError(f"unknown setting {_shown(key)} (from argument)")
    env_values: dict[str, Any] = {}
    for var, raw in env.items():
        if var.startswith(ENV_PREFIX):
            key = var[len(ENV_PREFIX) :].lower()
            if var != var.upper():  # two spellings of one setting would race for precedence
                raise ConfigError(f"invalid variable {_shown(var)}: settings are upper case ({var.upper()})")
            if key not in FIELDS:
                raise ConfigError(f"unknown setting {_shown(key)} (from {var})")
            env_values[key] = raw

    path, path_source = "", ""
    if "config_file" in kwargs and kwargs["config_file"]:
        path, path_source = str(kwargs["config_file"]), "argument"
    elif env_values.get("config_file"):
        path, path_source = env_values["config_file"], ENV_PREFIX + "CONFIG_FILE"
    if path:
        file_source = f"file {path}"
        file_values = _from_file(path, path_source)
        for key in file_values:
            if not isinstance(key, str) or key not in FIELDS or key == "config_file":
                raise ConfigError(f"unknown setting {_shown(key)} (from {file_source})")
        layers.append((file_source, file_values))
    layers.append(("env", env_values))
    layers.append(("argument", kwargs))

    values: dict[str, Any] = {}
    sources: dict[str, str] = {name: "default" for name in FIELDS}
    for source, layer in layers:
        for key, raw in layer.items():
            label = ENV_PREFIX + key.upper() if source == "env" else source
            values[key] = _coerce(key, raw, label)
            sources[key] = label
    return Settings(**values), sources
