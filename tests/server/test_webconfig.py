"""The web config (exporter-toolkit v0.8.2 subset): parsing, errors naming their field, promtool agreeing."""

from __future__ import annotations

import base64
import logging
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import bcrypt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tlsutil import make_pki

from harness import ROOT, tool
from vramwatch import config
from vramwatch.config import ConfigError
from vramwatch.server.auth import BasicAuth
from vramwatch.server.webconfig import Served, load_web_config
from vramwatch.webconfig_schema import parse_web_config

HASH4 = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()  # cost 4: fast tests


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def write(d: Path, text: str, name: str = "web.yml") -> str:
    p = d / name
    p.write_text(text)
    return str(p)


def tls_block(pki, extra: str = "") -> str:
    return f"tls_server_config:\n  cert_file: {pki.cert}\n  key_file: {pki.key}\n{extra}"


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


# --- what parses ---
def test_empty_file_is_plain_http(tmp_path):
    assert load_web_config(write(tmp_path, "")).current() == Served(None, None, {})
    assert load_web_config(write(tmp_path, "tls_server_config: {}\n")).current() == Served(None, None, {})


def test_full_config_parses(tmp_path, pki):
    text = tls_block(
        pki,
        f"""  client_auth_type: RequireAndVerifyClientCert
  client_ca_file: {pki.client_ca}
  min_version: TLS12
  max_version: TLS13
  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, TLS_AES_128_GCM_SHA256]
  prefer_server_cipher_suites: false
  curve_preferences: [CurveP256]
http_server_config:
  http2: false
  headers:
    X-Content-Type-Options: nosniff
    X-Frame-Options: deny
    Strict-Transport-Security: max-age=31536000
basic_auth_users:
  prometheus: {HASH4}
  "1234": {HASH4}
""",
    )
    served = load_web_config(write(tmp_path, text)).current()
    ctx, auth, headers = served.ssl_context, served.auth, served.headers
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2 and ctx.maximum_version == ssl.TLSVersion.TLSv1_3
    assert not ctx.options & ssl.OP_CIPHER_SERVER_PREFERENCE
    classic = {c["name"] for c in ctx.get_ciphers() if c["protocol"] != "TLSv1.3"}
    assert classic == {"ECDHE-ECDSA-AES128-GCM-SHA256"}
    assert headers == {
        "X-Content-Type-Options": "nosniff",
        "X-Frame-Options": "deny",
        "Strict-Transport-Security": "max-age=31536000",
    }
    assert auth(basic("prometheus", "s3cret")) and auth(basic("1234", "s3cret"))


def test_relative_paths_are_relative_to_the_file(tmp_path, pki):
    d = pki.dir
    path = write(d, "tls_server_config: {cert_file: server.crt, key_file: server.key}\n", "rel.yml")
    assert load_web_config(path).current().ssl_context is not None


def test_client_auth_types_map_to_verify_modes(tmp_path, pki):
    modes = {
        "NoClientCert": ssl.CERT_NONE,
        "RequestClientCert": ssl.CERT_NONE,
        "RequireAnyClientCert": ssl.CERT_REQUIRED,
        "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
        "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
    }
    for name, mode in modes.items():
        ca = f"  client_ca_file: {pki.client_ca}\n" if name != "NoClientCert" else ""
        served = load_web_config(write(tmp_path, tls_block(pki, f"  client_auth_type: {name}\n{ca}"))).current()
        assert served.ssl_context.verify_mode == mode, name


def test_only_tls13_suites_means_tls13_only(tmp_path, pki):
    served = load_web_config(write(tmp_path, tls_block(pki, "  cipher_suites: [TLS_AES_256_GCM_SHA384]\n"))).current()
    assert served.ssl_context.minimum_version == ssl.TLSVersion.TLSv1_3


# --- every error names its field, on one line ---
BAD = [
    ("not: [valid", "", "not YAML"),
    ("- a list\n", "", "must be a mapping"),
    ("rate_limit: {burst: 1}\n", "rate_limit", "after exporter-toolkit v0.8.2"),
    ("tls_sever_config: {}\n", "tls_sever_config", "unknown field"),
    ("tls_server_config: [1]\n", "tls_server_config", "must be a mapping"),
    ("tls_server_config: {key_file: k}\n", "tls_server_config.cert_file", "missing"),
    ("tls_server_config: {cert_file: c}\n", "tls_server_config.key_file", "missing"),
    ("tls_server_config: {min_version: TLS13}\n", "tls_server_config.cert_file", "missing"),
    ("{tls}  cert: inline\n", "tls_server_config.cert", "after exporter-toolkit v0.8.2"),
    ("{tls}  client_allowed_sans: [a]\n", "tls_server_config.client_allowed_sans", "after exporter-toolkit"),
    ("{tls}  min_version: TLS9\n", "tls_server_config.min_version='TLS9'", "must be one of TLS10"),
    ("{tls}  max_version: 1.3\n", "tls_server_config.max_version=1.3", "must be one of"),
    ("{tls}  min_version: TLS13\n  max_version: TLS12\n", "tls_server_config.max_version", "below min_version"),
    ("{tls}  client_auth_type: Sometimes\n", "tls_server_config.client_auth_type='Sometimes'", "must be one of"),
    (
        "{tls}  client_auth_type: RequireAndVerifyClientCert\n",
        "tls_server_config.client_auth_type",
        "needs client_ca_file",
    ),
    ("{tls}  client_auth_type: RequireAnyClientCert\n", "tls_server_config.client_auth_type", "needs client_ca"),
    ("{tls}  client_ca_file: {client_ca}\n", "tls_server_config.client_ca_file", "without a client_auth_type"),
    ("{tls}  cipher_suites: [TLS_RSA_WITH_RC4_128_SHA]\n", "tls_server_config.cipher_suites[0]", "insecure"),
    ("{tls}  cipher_suites: TLS_AES_128_GCM_SHA256\n", "tls_server_config.cipher_suites", "must be a list"),
    (
        "{tls}  cipher_suites: [TLS_AES_128_GCM_SHA256]\n  max_version: TLS12\n",
        "tls_server_config.cipher_suites",
        "only TLS 1.3",
    ),
    ("{tls}  curve_preferences: [CurveP999]\n", "tls_server_config.curve_preferences[0]", "must be one of"),
    ("{tls}  curve_preferences: [X25519, CurveP256]\n", "tls_server_config.curve_preferences", "list one"),
    ("{tls}  prefer_server_cipher_suites: maybe\n", "tls_server_config.prefer_server_cipher_suites", "true or false"),
    ("tls_server_config: {cert_file: /nonexistent.crt, key_file: k}\n", "tls_server_config.cert_file", "cannot read"),
    (
        "tls_server_config: {cert_file: {cert}, key_file: /nonexistent.key}\n",
        "tls_server_config.key_file",
        "cannot read",
    ),
    (
        "tls_server_config: {cert_file: {cert}, key_file: {cert}}\n",
        "tls_server_config.key_file",
        "not a PEM certificate",
    ),
    ("tls_server_config: {cert_file: {key}, key_file: {key}}\n", "tls_server_config.key_file", "not a PEM certificate"),
    (
        "{tls}  client_auth_type: VerifyClientCertIfGiven\n  client_ca_file: {key}\n",
        "tls_server_config.client_ca_file",
        "PEM",
    ),
    ("http_server_config: {http2: 2}\n", "http_server_config.http2", "true or false"),
    ("http_server_config: {headers: {X-Foo: a}}\n", "http_server_config.headers.X-Foo", "can not be configured"),
    (
        "http_server_config: {headers: {X-Frame-Options: allow}}\n",
        "http_server_config.headers.X-Frame-Options",
        "deny, sameorigin",
    ),
    (
        'http_server_config: {headers: {Content-Security-Policy: "a\\r\\nSet-Cookie: x"}}\n',
        "http_server_config.headers.Content-Security-Policy",
        "one line",
    ),
    ("http_server_config: {keepalive: true}\n", "http_server_config.keepalive", "unknown field"),
    ("basic_auth_users: {alice: hunter2}\n", "basic_auth_users.alice", "bcrypt hash"),
    ("basic_auth_users: {alice: 12}\n", "basic_auth_users.alice", "bcrypt hash"),
    ('basic_auth_users: {"a:b": {hash}}\n', "basic_auth_users.a:b", "cannot contain ':'"),
    ("basic_auth_users: {[1]: {hash}}\n", "", "not YAML"),  # a list key: PyYAML refuses it
    ("basic_auth_users: [alice]\n", "basic_auth_users", "must be a mapping"),
]


def _fill(text: str, pki) -> str:
    return (
        text.replace("{tls}", tls_block(pki))
        .replace("{cert}", str(pki.cert))
        .replace("{key}", str(pki.key))
        .replace("{client_ca}", str(pki.client_ca))
        .replace("{hash}", HASH4)
    )


@pytest.mark.parametrize(("text", "field", "why"), BAD, ids=[f"{i}:{b[1] or b[2]}" for i, b in enumerate(BAD)])
def test_errors_name_the_field(tmp_path, pki, text, field, why):
    path = write(tmp_path, _fill(text, pki))
    with pytest.raises(ConfigError) as e:
        load_web_config(path)
    msg = str(e.value)
    assert "\n" not in msg
    prefix = "invalid web config" + (f" {field}" if field else "")
    assert msg.startswith(prefix), msg
    assert f"(from file {path})" in msg, msg
    assert why in msg, msg
    assert HASH4 not in msg and "hunter2" not in msg  # secrets never echoed


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"invalid web config \(from file .*nope.yml\): cannot read the file"):
        parse_web_config(str(tmp_path / "nope.yml"))


def test_start_rejects_a_bad_web_config_naming_both_layers(tmp_path, pki):
    path = write(tmp_path, tls_block(pki, "  min_version: TLS9\n"))
    with pytest.raises(ConfigError) as e:
        config.load({"web_config_file": path}, env={})
    assert str(e.value).startswith(
        f"invalid setting web_config_file={path!r} (from argument): "
        "invalid web config tls_server_config.min_version='TLS9'"
    )
    with pytest.raises(ConfigError, match="from VRAMWATCH_WEB_CONFIG_FILE"):
        config.load({}, env={"VRAMWATCH_WEB_CONFIG_FILE": path})


def test_serve_exits_2_on_a_bad_web_config(tmp_path, pki):
    path = write(tmp_path, f"tls_server_config: {{cert_file: {pki.cert}, key_file: /missing.key}}\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "vramwatch",
            "serve",
            "--web.config.file",
            path,
            "--spool-dir",
            str(tmp_path / "spool"),
            "--port",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r
    assert "invalid web config tls_server_config.key_file='/missing.key'" in r.stderr
    assert "Traceback" not in r.stderr


# --- promtool agrees ---
# Configs promtool 2.42 accepts that vramwatch refuses, on purpose (docs/security.md says why).
STRICTER = {
    "tls_server_config: {min_version: TLS13}\n",  # TLS settings without a certificate: plain HTTP there
    "{tls}  client_auth_type: RequireAndVerifyClientCert\n",  # no client CA: Go would use the system roots
    "{tls}  client_auth_type: RequireAnyClientCert\n",  # Python cannot require a cert without verifying it
    "{tls}  cipher_suites: [TLS_AES_128_GCM_SHA256]\n  max_version: TLS12\n",  # no suite left at all
    "{tls}  curve_preferences: [X25519, CurveP256]\n",  # Python's ssl sets one curve
    "{tls}  min_version: TLS13\n  max_version: TLS12\n",  # Go accepts it and then fails every handshake
    "{tls}  client_auth_type: VerifyClientCertIfGiven\n  client_ca_file: {key}\n",  # toolkit 0.8.2 ignores it
    'http_server_config: {headers: {Content-Security-Policy: "a\\r\\nSet-Cookie: x"}}\n',
    'basic_auth_users: {"a:b": {hash}}\n',  # can never log in
}
GOOD = [
    "",
    "{tls}",
    "{tls}  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {client_ca}\n",
    "{tls}  cipher_suites: [TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256]\n  min_version: TLS13\n",
    "http_server_config: {http2: false, headers: {X-Frame-Options: sameorigin}}\n",
    "basic_auth_users: {alice: {hash}}\n",
]


def _promtool_ok(path: str) -> bool:
    r = subprocess.run([tool("promtool"), "check", "web-config", path], capture_output=True, text=True, timeout=60)
    return r.returncode == 0


@pytest.mark.parametrize("text", GOOD + [b[0] for b in BAD if not b[0].startswith(("not:", "basic_auth_users: {["))])
def test_promtool_agrees(tmp_path, pki, text):
    path = write(tmp_path, _fill(text, pki))
    try:
        load_web_config(path)
        ours = True
    except ConfigError:
        ours = False
    theirs = _promtool_ok(path)
    if text in STRICTER:
        assert theirs and not ours, f"listed as stricter-than-promtool: ours={ours} promtool={theirs}"
    else:
        assert ours == theirs, f"vramwatch accepts: {ours}, promtool accepts: {theirs}"


def _doc_examples() -> list[str]:
    text = (ROOT / "docs" / "security.md").read_text()
    return [
        b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "basic_auth_users" in b or "tls_server_config" in b
    ]


def test_security_doc_examples_pass_promtool_and_us(tmp_path, pki):
    examples = _doc_examples()
    assert examples, "docs/security.md has no web config example"
    for name in ("server.crt", "server.key", "client-ca.crt"):
        (tmp_path / name).write_bytes((pki.dir / name).read_bytes())
    for i, text in enumerate(examples):
        path = write(tmp_path, text, f"example{i}.yml")
        assert _promtool_ok(path), text
        load_web_config(path)


# --- basic auth ---
def test_basic_auth_decisions():
    auth = BasicAuth((("alice", HASH4),))
    assert auth(basic("alice", "s3cret"))
    for header in (
        None,
        "",
        basic("alice", "wrong"),
        basic("bob", "s3cret"),
        basic("alice", "s3cret "),
        "Bearer abc",
        "Basic",
        "Basic !!!",
        "Basic " + base64.b64encode(b"alice").decode(),
        "Basic " + "A" * 10000,
        basic("alice", "s3cret")[:-2],
    ):
        assert not auth(header), header
    assert auth("basic " + basic("alice", "s3cret").split()[1])  # the scheme is case-insensitive


def test_long_passwords_are_cut_at_72_bytes_like_htpasswd():
    h = bcrypt.hashpw(b"x" * 72, bcrypt.gensalt(4)).decode()
    auth = BasicAuth((("a", h),))
    assert auth(basic("a", "x" * 100)) and not auth(basic("a", "x" * 71))


def test_verified_pairs_are_cached_failures_are_not(monkeypatch):
    auth = BasicAuth((("alice", HASH4),))
    calls = []
    real = auth._bcrypt.checkpw

    class Counting:
        @staticmethod
        def checkpw(p, h):
            calls.append(p)
            return real(p, h)

    auth._bcrypt = Counting
    for _ in range(5):
        assert auth(basic("alice", "s3cret"))
        assert not auth(basic("alice", "nope"))
    assert calls.count(b"s3cret") == 1 and calls.count(b"nope") == 5
    assert all(len(k) == 32 for k in auth._ok) and b"s3cret" not in b"".join(auth._ok)  # HMACs, not passwords


def test_unknown_users_cost_a_bcrypt_too():
    auth = BasicAuth((("alice", bcrypt.hashpw(b"pw", bcrypt.gensalt(10)).decode()),))
    t0 = time.perf_counter()
    assert not auth(basic("mallory", "pw"))
    assert time.perf_counter() - t0 > 0.01  # the dummy hash (cost 10) ran


@settings(max_examples=150, deadline=None)
@given(
    st.one_of(
        st.none(), st.text(max_size=200), st.binary(max_size=100).map(lambda b: "Basic " + base64.b64encode(b).decode())
    )
)
def test_any_authorization_header_is_a_bool(header):
    auth = _FUZZ_AUTH
    assert auth(header) in (True, False)


_FUZZ_AUTH = BasicAuth((("alice", HASH4),))


# --- read again on use ---
def _rotating(tmp_path, pki):
    cert, key = tmp_path / "s.crt", tmp_path / "s.key"
    cert.write_bytes(pki.cert.read_bytes())
    key.write_bytes(pki.key.read_bytes())
    return cert, key, write(tmp_path, f"tls_server_config: {{cert_file: {cert}, key_file: {key}}}\n")


def test_changed_certificates_are_reloaded_and_broken_ones_are_not(tmp_path, pki, caplog):
    caplog.set_level(logging.INFO, logger="vramwatch")
    cert, key, path = _rotating(tmp_path, pki)
    web = load_web_config(path)
    first = web.current().ssl_context
    assert web.current().ssl_context is first and caplog.messages == []  # unchanged files: same context
    other = make_pki(tmp_path / "other")
    cert.write_bytes(other.cert.read_bytes())  # half-way through a rotation: cert and key do not match
    for _ in range(3):
        assert web.current().ssl_context is first
    [line] = caplog.messages  # once, until the files change again
    assert line.startswith(f"vramwatch: web config {path} changed but is not used; keeping the last good one: ")
    key.write_bytes(other.key.read_bytes())
    second = web.current().ssl_context
    assert second is not first and web.current().ssl_context is second
    assert caplog.messages[1:] == [
        f"vramwatch: web config {path} changed; reloaded it (TLS client_auth_type NoClientCert, 0 basic-auth users)"
    ]


def _handshake(ctx: ssl.SSLContext, ca: Path) -> bytes:
    """One connection with the server context; the certificate the client was shown (DER)."""
    a, b = socket.socketpair()
    client_ctx = ssl.create_default_context(cafile=str(ca))
    with a, b:

        def serve() -> None:
            try:
                with ctx.wrap_socket(a, server_side=True):
                    pass
            except (OSError, ssl.SSLError):  # the client hangs up first
                pass

        t = threading.Thread(target=serve)
        t.start()
        with client_ctx.wrap_socket(b, server_hostname="localhost") as c:
            der = c.getpeercert(binary_form=True)
        t.join(10)
    assert der
    return der


def test_new_connections_get_the_rotated_certificate(tmp_path, pki):
    cert, key, path = _rotating(tmp_path, pki)
    web = load_web_config(path)
    assert _handshake(web.current().ssl_context, pki.ca) == ssl.PEM_cert_to_DER_cert(pki.cert.read_text())
    other = make_pki(tmp_path / "other")
    cert.write_bytes(other.cert.read_bytes())
    key.write_bytes(other.key.read_bytes())
    assert _handshake(web.current().ssl_context, other.ca) == ssl.PEM_cert_to_DER_cert(other.cert.read_text())


def test_a_rotated_password_and_a_removed_user_apply_at_once_with_a_new_cache(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="vramwatch")
    new_hash = bcrypt.hashpw(b"n3w", bcrypt.gensalt(4)).decode()
    path = write(tmp_path, f"basic_auth_users: {{alice: {HASH4}, bob: {HASH4}}}\n")
    web = load_web_config(path)
    auth = web.current().auth
    assert auth(basic("alice", "s3cret")) and auth(basic("bob", "s3cret"))  # both verified: cached
    write(tmp_path, f"basic_auth_users: {{alice: {new_hash}, bob: {HASH4}}}\n")  # same size: a new mtime
    auth = web.current().auth
    assert not auth(basic("alice", "s3cret")) and auth(basic("alice", "n3w"))
    write(tmp_path, f"basic_auth_users: {{alice: {new_hash}}}\n")
    assert not web.current().auth(basic("bob", "s3cret"))
    assert [m for m in caplog.messages if "reloaded" in m] == [
        f"vramwatch: web config {path} changed; reloaded it (no TLS, 2 basic-auth users)",
        f"vramwatch: web config {path} changed; reloaded it (no TLS, 1 basic-auth users)",
    ]


def test_an_unchanged_user_list_keeps_its_verified_pairs(tmp_path):
    path = write(tmp_path, f"basic_auth_users: {{alice: {HASH4}}}\n")
    web = load_web_config(path)
    auth = web.current().auth
    write(
        tmp_path, f"basic_auth_users: {{alice: {HASH4}}}\nhttp_server_config: {{headers: {{X-Frame-Options: deny}}}}\n"
    )
    assert web.current().auth is auth and web.current().headers == {"X-Frame-Options": "deny"}


def test_tls_is_not_turned_off_by_an_edit(tmp_path, pki, caplog):
    _, _, path = _rotating(tmp_path, pki)
    web = load_web_config(path)
    first = web.current().ssl_context
    write(tmp_path, "")
    assert web.current().ssl_context is first
    assert "TLS is turned off only by a restart" in caplog.text


_NINE = ", ".join(["*{p}"] * 9)
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{_NINE.format(p=p)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)


def test_an_alias_bomb_is_refused_at_once_with_a_clear_error(tmp_path):
    path = write(tmp_path, "basic_auth_users:\n" + "".join("  " + line + "\n" for line in BOMB.splitlines()))
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"refused: YAML aliases \(\*name\) are not allowed \(line 3\)"):
        load_web_config(path)
    with pytest.raises(ConfigError, match="aliases"):
        config.load({"web_config_file": path}, env={})  # what vramwatch.start() raises: never MemoryError
    assert time.monotonic() - t0 < 2


def test_an_alias_bomb_edited_in_while_serving_keeps_the_last_good_config(tmp_path, caplog):
    path = write(tmp_path, f"basic_auth_users: {{alice: {HASH4}}}\n")
    web = load_web_config(path)
    auth = web.current().auth
    write(tmp_path, BOMB)
    assert web.current().auth is auth
    assert "aliases (*name) are not allowed" in caplog.text


def test_what_loading_the_web_config_logs(tmp_path, pki, caplog):
    caplog.set_level(logging.INFO, logger="vramwatch")
    clear = "vramwatch: basic auth without TLS sends passwords in clear text; add tls_server_config"
    http2 = "vramwatch: http_server_config.http2 is accepted and ignored: the exporter speaks HTTP/1.x"
    users = f"basic_auth_users: {{alice: {HASH4}}}\n"
    cases = [
        (users, [clear]),
        (tls_block(pki) + users, []),
        (tls_block(pki), []),
        ("http_server_config: {http2: true}\n", [http2]),
        ("http_server_config: {headers: {X-Frame-Options: deny}}\n", []),
    ]
    for text, logged in cases:
        caplog.clear()
        load_web_config(write(tmp_path, text))
        assert caplog.messages == logged, text
