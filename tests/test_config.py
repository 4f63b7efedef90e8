from __future__ import annotations

import pytest

from vramwatch import config
from vramwatch.config import FIELDS, ConfigError, Settings, Within


def test_defaults():
    s, src = config.load({}, {})
    assert s == Settings()
    assert s.port == 9488 and s.host == "127.0.0.1"
    assert set(src.values()) == {"default"}


def test_precedence_argument_over_env_over_file_over_default(tmp_path):
    f = tmp_path / "vw.yml"
    f.write_text("port: 9001\ninterval: 3\nlinger: 4\nnvml: false\n")
    env = {"VRAMWATCH_CONFIG_FILE": str(f), "VRAMWATCH_PORT": "9002", "VRAMWATCH_INTERVAL": "2.5"}
    s, src = config.load({"port": 9003}, env)
    assert (s.port, s.interval, s.linger, s.nvml) == (9003, 2.5, 4.0, False)
    assert src["port"] == "argument"
    assert src["interval"] == "VRAMWATCH_INTERVAL"
    assert src["linger"] == f"file {f}"
    assert src["max_ranks"] == "default"


@pytest.mark.parametrize(
    "kwargs,env,message",
    [
        ({}, {"VRAMWATCH_PORT": "70000"}, "invalid setting port='70000' (from VRAMWATCH_PORT): must be 1-65535"),
        ({"port": 0}, {}, "invalid setting port=0 (from argument): must be 1-65535"),
        ({"interval": -1}, {}, "interval=-1 (from argument): must be 0.01-3600 s"),
        ({"interval": "fast"}, {}, "interval='fast' (from argument): must be a number"),
        ({"nvml": "maybe"}, {}, "nvml='maybe' (from argument): must be true or false"),
        ({"serve": "sometimes"}, {}, "must be one of auto, external, off"),
        ({"port": True}, {}, "must be an integer"),
        ({"bogus": 1}, {}, "unknown setting 'bogus' (from argument)"),
        ({}, {"VRAMWATCH_BOGUS": "1"}, "unknown setting 'bogus' (from VRAMWATCH_BOGUS)"),
        ({"interval": float("nan")}, {}, "must be a finite number"),
        ({}, {"VRAMWATCH_port": "9001", "VRAMWATCH_PORT": "9002"}, "invalid variable 'VRAMWATCH_port'"),
        ({"host": "bad host-x"}, {}, "host='bad host-x' (from argument): must be an IP address or host name"),
        ({"host": "-x.example"}, {}, "must be an IP address or host name"),
    ],
)
def test_errors_name_key_value_and_source(kwargs, env, message):
    with pytest.raises(ConfigError) as e:
        config.load(kwargs, env)
    assert message in str(e.value)


def test_file_errors_name_the_file(tmp_path):
    f = tmp_path / "bad.yml"
    f.write_text("port: 80000\n")
    with pytest.raises(ConfigError, match=r"port=80000 \(from file .*bad.yml\): must be 1-65535"):
        config.load({"config_file": str(f)}, {})
    f.write_text("nope: 1\n")
    with pytest.raises(ConfigError, match=r"unknown setting 'nope' \(from file"):
        config.load({"config_file": str(f)}, {})
    f.write_text("[1, 2]\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        config.load({"config_file": str(f)}, {})
    f.write_text("a: [\n")
    with pytest.raises(ConfigError, match="not YAML"):
        config.load({"config_file": str(f)}, {})
    with pytest.raises(ConfigError, match=r"config_file='.*missing.yml' \(from VRAMWATCH_CONFIG_FILE\)"):
        config.load({}, {"VRAMWATCH_CONFIG_FILE": str(tmp_path / "missing.yml")})


def test_to_env_round_trips():
    s, _ = config.load({"port": 9100, "nvml": False, "interval": 0.5, "hostname": "n1"}, {})
    again, _ = config.load({}, s.to_env())
    assert again == s


def test_spool_dir_default_is_per_port(monkeypatch):
    s, _ = config.load({"port": 9123}, {})
    assert s.resolved_spool_dir().endswith("vramwatch-9123")


NUMERIC = sorted(name for name, f in FIELDS.items() if type(f.default) in (int, float))


def test_every_numeric_setting_has_a_range_stated_in_its_doc():
    for name in NUMERIC:
        check = FIELDS[name].metadata["check"]
        assert isinstance(check, Within), name
        assert f"Allowed: {check.describe()}." in FIELDS[name].metadata["doc"], name
        check(FIELDS[name].default)  # the default is inside its own range


def _outside(check: Within, kind: type) -> tuple[float, float]:
    """One value just below the range (skipping its "off" value) and one above it."""
    step = 1 if kind is int else max(check.lo * 0.5, 0.001)
    below = check.lo - step
    if below == check.off:
        below -= step
    return below, (check.hi + 1 if kind is int else check.hi * 2)


@pytest.mark.parametrize("name", NUMERIC)
def test_each_numeric_setting_refuses_below_and_above_its_range(name):
    check = FIELDS[name].metadata["check"]
    kind = type(FIELDS[name].default)
    for ok in (check.lo, check.hi) + (() if check.off is None else (check.off,)):
        s, _ = config.load({name: kind(ok)}, {})
        assert getattr(s, name) == ok
    for bad in _outside(check, kind):
        with pytest.raises(ConfigError) as e:
            config.load({}, {"VRAMWATCH_" + name.upper(): str(kind(bad))})
        msg = str(e.value)
        assert msg.startswith(f"invalid setting {name}=") and f"(from VRAMWATCH_{name.upper()})" in msg, msg
        assert f"must be {check.describe()}" in msg, msg
        assert repr(str(kind(bad))) in msg, msg


@pytest.mark.parametrize(("name", "value"), [("interval", 1e10), ("interval", 1e-9)])  # killed / spun the sampler
def test_the_intervals_that_killed_or_spun_the_sampler_are_refused(name, value):
    with pytest.raises(ConfigError, match=rf"invalid setting {name}={value!r} \(from argument\): must be 0.01-3600 s"):
        config.load({name: value}, {})
