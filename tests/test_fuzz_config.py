"""Every configuration path fuzzed: any value either works or gives exactly one ConfigError of one line.

kwargs (``start(**kw)``), ``VRAMWATCH_*`` variables and the YAML file all go
through ``config.load``; ``vramwatch serve`` turns a ConfigError into exit 2
and a message, never a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import ROOT, free_port
from vramwatch import config
from vramwatch.config import FIELDS, ConfigError, Settings

KEYS = sorted(k for k in FIELDS if k not in ("config_file", "web_config_file"))
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# text that parsers like to trip on
TRICKY = st.sampled_from(
    [
        "",
        " ",
        "0",
        "1",
        "-1",
        "+5",
        " 7 ",
        "1e3",
        "1.5",
        "0x10",
        "1_000",
        "٣",
        "nan",
        "inf",
        "-inf",
        "true",
        "True",
        "yes",
        "off",
        "None",
        "null",
        "[]",
        "{}",
        "9" * 5000,
        "0.0.0.0",
        "::",
        "localhost",
        "a" * 300,
        "\u202e",
        "\x00",
        "é",
        "DEBUG",
        "auto",
    ]
)
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    TRICKY,
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.binary(max_size=8),
    st.tuples(st.integers()),
    st.just(object()),
    st.just(b"\xff"),
)
ENV_TEXT = st.one_of(TRICKY, st.text(alphabet=st.characters(blacklist_characters="\x00"), max_size=30))


def _outcome(fn) -> Settings | ConfigError:
    try:
        return fn()[0]
    except ConfigError as e:
        return e
    # anything else propagates and fails the test: a traceback into the job


def _one_clear_line(e: ConfigError, key: str | None) -> None:
    msg = str(e)
    assert msg and "\n" not in msg and "\r" not in msg, repr(msg)
    assert len(msg) < 600, msg
    assert msg.startswith(("invalid setting ", "unknown setting ")), msg
    if key is not None:
        assert repr(key)[:60] in msg or f"{key}=" in msg, msg


@FUZZ
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, min_size=1, max_size=3))
def test_kwargs(kwargs):
    r = _outcome(lambda: config.load(kwargs, env={}))
    if isinstance(r, ConfigError):
        _one_clear_line(r, None)
        assert any(f"{k}=" in str(r) for k in kwargs), str(r)
    else:
        assert isinstance(r, Settings)


@FUZZ
@given(st.sampled_from(KEYS), VALUES)
def test_each_key_alone_names_itself(key, value):
    r = _outcome(lambda: config.load({key: value}, env={}))
    if isinstance(r, ConfigError):
        _one_clear_line(r, key)
        assert "(from argument)" in str(r)
    else:
        assert type(getattr(r, key)) is type(FIELDS[key].default)


@FUZZ
@given(st.text(min_size=1, max_size=20).filter(lambda k: k not in FIELDS))
def test_unknown_keys(key):
    with pytest.raises(ConfigError) as e:
        config.load({key: 1}, env={})
    _one_clear_line(e.value, key)


@FUZZ
@given(st.dictionaries(st.sampled_from(KEYS), ENV_TEXT, min_size=1, max_size=3))
def test_env(values):
    env = {"VRAMWATCH_" + k.upper(): v for k, v in values.items()}
    env["PATH"] = "/usr/bin"  # other variables are none of our business
    r = _outcome(lambda: config.load({}, env=env))
    if isinstance(r, ConfigError):
        _one_clear_line(r, None)
        assert "(from VRAMWATCH_" in str(r)


@FUZZ
@given(
    st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ_0123456789", min_size=1, max_size=12).filter(
        lambda k: k.lower() not in FIELDS
    )
)
def test_unknown_env_variables(name):
    with pytest.raises(ConfigError) as e:
        config.load({}, env={"VRAMWATCH_" + name: "1"})
    _one_clear_line(e.value, None)
    assert "VRAMWATCH_" + name in str(e.value)


YAML_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20), TRICKY),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


def _yaml_file(text: str | bytes) -> str:
    fd, path = tempfile.mkstemp(suffix=".yml")
    with os.fdopen(fd, "wb") as fh:
        fh.write(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    return path


def _load_file(path: str) -> Settings | ConfigError:
    try:
        return _outcome(lambda: config.load({"config_file": path}, env={}))
    finally:
        os.unlink(path)


@FUZZ
@given(st.dictionaries(st.sampled_from(KEYS), YAML_VALUES, max_size=4))
def test_yaml_mappings(data):
    r = _load_file(_yaml_file(yaml.safe_dump(data)))
    if isinstance(r, ConfigError):
        _one_clear_line(r, None)
        assert "(from file " in str(r)


@FUZZ
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200), YAML_VALUES.map(yaml.safe_dump)))
def test_yaml_text(text):
    r = _load_file(_yaml_file(text))
    if isinstance(r, ConfigError):
        _one_clear_line(r, None)


def test_deeply_nested_yaml_is_a_config_error_not_a_recursion_error():
    r = _load_file(_yaml_file("port: " + "[" * 1500 + "]" * 1500))
    assert isinstance(r, ConfigError)
    _one_clear_line(r, "config_file")


def test_config_file_paths():
    for path in ("/nonexistent/vramwatch.yml", "/", tempfile.gettempdir(), "x" * 5000):
        with pytest.raises(ConfigError) as e:
            config.load({"config_file": path}, env={})
        _one_clear_line(e.value, "config_file")


def test_web_config_file_paths():
    for path in ("/nonexistent/web.yml", "/", "x" * 5000, "a\x00b"):
        with pytest.raises(ConfigError) as e:
            config.load({"web_config_file": path}, env={})
        _one_clear_line(e.value, "web_config_file")


@pytest.mark.parametrize(
    ("args", "env", "expect"),
    [
        (["--port", "70000"], {}, "invalid setting port='70000' (from argument): must be 1-65535"),
        (
            [],
            {"VRAMWATCH_INTERVAL": "-1"},
            "interval='-1' (from VRAMWATCH_INTERVAL): must be 0.01-3600 s",
        ),
        (
            [],
            {"VRAMWATCH_INTERVAL": "1e10"},
            "interval='1e10' (from VRAMWATCH_INTERVAL): must be 0.01-3600 s",
        ),
        (["--max-ranks", "100000"], {}, "invalid setting max_ranks='100000' (from argument): must be 1-1024"),
        ([], {"VRAMWATCH_NOPE": "1"}, "unknown setting 'nope' (from VRAMWATCH_NOPE)"),
        (["--host", "not a host!"], {}, "invalid setting host='not a host!' (from argument)"),
        (["--config-file", "{yaml}"], {}, "not YAML"),
        (["--web.config.file", "/nonexistent/web.yml"], {}, "invalid setting web_config_file="),
    ],
)
def test_serve_exits_2_with_the_message_and_no_traceback(tmp_path, args, env, expect):
    bad = tmp_path / "bad.yml"
    bad.write_text("port: [unclosed\n")
    args = [a.replace("{yaml}", str(bad)) for a in args]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")}
    full_env.update(env, VRAMWATCH_SPOOL_DIR=str(tmp_path / "spool"), VRAMWATCH_PORT=str(free_port()))
    r = subprocess.run(
        [sys.executable, "-m", "vramwatch", "serve", *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("vramwatch: "), r.stderr
    assert expect in lines[0], lines[0]
    assert not (tmp_path / "spool").exists() or not os.listdir(tmp_path / "spool"), "nothing served or written"


def test_start_raises_config_error_before_the_job_and_nothing_after(tmp_path):
    import vramwatch

    with pytest.raises(ConfigError, match="invalid setting interval"):
        vramwatch.start(interval="soon")
    assert vramwatch.current() is None


# alias expansion under one known key: each anchor nine times the one before, 9**8 strings from 302 bytes
# (safe_load shares them, but the error message's repr of the value walks every one)
LAUGHS = (
    "hostname: [&a ["
    + ",".join(['"lol"'] * 9)
    + "], "
    + ", ".join(f"&{k} [" + ",".join([f"*{p}"] * 9) + "]" for p, k in zip("abcdefg", "bcdefgh", strict=True))
    + "]\n"
)


def test_an_alias_bomb_is_refused_at_once_with_exit_2(tmp_path):
    """A few hundred bytes that expand to gigabytes: a clean exit 2 naming the file and why, in bounded
    time and memory (an address-space cap turns any expansion into a failure of this test)."""
    import resource

    bomb = tmp_path / "bomb.yml"
    bomb.write_text(LAUGHS)
    assert len(LAUGHS) < 400

    def cap_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")}
    env.update(VRAMWATCH_SPOOL_DIR=str(tmp_path / "spool"), VRAMWATCH_PORT=str(free_port()))
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "vramwatch", "serve", "--config-file", str(bomb)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        preexec_fn=cap_memory,
    )
    took = time.monotonic() - t0
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr[-2000:]
    assert f"invalid setting config_file='{bomb}'" in lines[0] and "aliases" in lines[0], lines[0]
    assert took < 20, f"{took:.1f} s"


def test_an_oversized_config_file_is_refused_unread(tmp_path):
    from vramwatch.yaml_bounded import MAX_YAML_BYTES

    big = tmp_path / "big.yml"
    big.write_text("# padding\n" * (MAX_YAML_BYTES // 10 + 1) + "port: 9001\n")
    with pytest.raises(
        ConfigError, match=rf"config_file='.*big.yml' \(from argument\): refused: larger than {MAX_YAML_BYTES}"
    ):
        config.load({"config_file": str(big)}, env={})
    ok = tmp_path / "ok.yml"
    ok.write_text("# padding\n" * (MAX_YAML_BYTES // 20) + "port: 9001\n")
    assert config.load({"config_file": str(ok)}, env={})[0].port == 9001


def test_a_number_too_long_to_convert_is_a_config_error(tmp_path):
    r = _load_file(_yaml_file("port: " + "9" * 5000 + "\n"))
    assert isinstance(r, ConfigError)
    _one_clear_line(r, "config_file")
