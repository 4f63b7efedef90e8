"""The exporter-toolkit web config file: its format, parsed and checked, certificates included.

The file format Prometheus exporters share (``--web.config.file``), in the
subset of exporter-toolkit v0.8.2, the version Prometheus 2.42's ``promtool
check web-config`` reads::

    tls_server_config:
      cert_file: server.crt          # relative paths are relative to this file
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert
      client_ca_file: clients-ca.crt
      min_version: TLS12             # TLS10 .. TLS13; default TLS12
      max_version: TLS13
      cipher_suites: [TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256]   # Go names, TLS <= 1.2 only
      prefer_server_cipher_suites: true
      curve_preferences: [X25519]    # one curve (Python's ssl cannot set a list)
    http_server_config:
      http2: true                    # accepted; vramwatch speaks HTTP/1.x
      headers: {X-Content-Type-Options: nosniff}
    basic_auth_users:
      prometheus: $2y$10$...         # bcrypt: htpasswd -nBC 10 "" | tr -d ':\\n'

Anything else is an error naming the field, e.g. ``invalid web config
tls_server_config.min_version='TLS9' (from file web.yml): must be one of TLS10,
TLS11, TLS12, TLS13``. Everything, certificate files included, is checked
when the server starts (and in ``vramwatch.start()``), so a bad file fails
before the job runs rather than at the first scrape.

Where Python's ``ssl`` cannot do what Go's ``crypto/tls`` does, the stricter
reading wins: ``RequireAnyClientCert`` verifies the certificate against
``client_ca_file`` (Python cannot ask for a certificate without verifying it),
and ``RequestClientCert`` does not ask for one (the toolkit never uses an
unverified certificate for anything, so access is the same).

Pure checking, apart from reading the files it names: ``vramwatch.config``
uses it to validate ``web_config_file``; :mod:`vramwatch.server.webconfig`
serves what it returns, and reads the file again when it changes.
"""

from __future__ import annotations

import os
import re
import ssl
from dataclasses import dataclass
from typing import Any

from vramwatch.errors import ConfigError, shown

__all__ = ["TLSSettings", "WebConfig", "build_ssl_context", "check_web_config", "parse_web_config", "resolve"]


CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": ssl.CERT_NONE,  # see the module docstring
    "RequireAnyClientCert": ssl.CERT_REQUIRED,  # verified: see the module docstring
    "RequireClientCert": ssl.CERT_REQUIRED,  # the toolkit's old name for RequireAnyClientCert
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
# Go's tls.CipherSuites() (the ones the toolkit accepts) -> OpenSSL names. None: a TLS 1.3 suite,
# which Go does not let a config choose either (all three are always on).
CIPHER_SUITES: dict[str, str | None] = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_AES_128_GCM_SHA256": None,
    "TLS_AES_256_GCM_SHA384": None,
    "TLS_CHACHA20_POLY1305_SHA256": None,
}
CURVES = {"CurveP256": "prime256v1", "CurveP384": "secp384r1", "CurveP521": "secp521r1", "X25519": "X25519"}
# The toolkit's allowed response headers; a tuple lists the only values it takes.
HEADERS: dict[str, tuple[str, ...]] = {
    "Strict-Transport-Security": (),
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": (),
    "Content-Security-Policy": (),
}
_TLS_KEYS = (
    "cert_file",
    "key_file",
    "client_auth_type",
    "client_ca_file",
    "min_version",
    "max_version",
    "cipher_suites",
    "prefer_server_cipher_suites",
    "curve_preferences",
)
_TOP_KEYS = ("tls_server_config", "http_server_config", "basic_auth_users")
_LATER = {
    "cert": "inline certificates",
    "key": "inline keys",
    "client_ca": "an inline client CA",
    "client_allowed_sans": "client SAN checks",
    "rate_limit": "rate limits",
}
_BCRYPT = re.compile(r"^\$2[abxy]?\$(\d\d)\$[./A-Za-z0-9]{53}$")


class _Fail(Exception):
    def __init__(self, field: str, value: Any, why: str, show: bool = True) -> None:
        super().__init__(why)
        self.field, self.value, self.why, self.show = field, value, why, show


def _error(origin: str, field: str, value: Any, why: str, show: bool = True) -> ConfigError:
    where = f" {field}" if field else ""
    quoted = "=" + shown(value) if field and show else ""
    why = " ".join(str(why).split())  # one line, whatever YAML or OpenSSL said
    if len(origin) > 120:
        origin = "..." + origin[-117:]
    return ConfigError(f"invalid web config{where}{quoted} (from file {origin}): {why}")


@dataclass(frozen=True)
class TLSSettings:
    cert_file: str
    key_file: str
    client_auth_type: str = "NoClientCert"
    client_ca_file: str = ""
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    cipher_suites: tuple[str, ...] = ()
    prefer_server_cipher_suites: bool = True
    curve_preferences: tuple[str, ...] = ()


@dataclass(frozen=True)
class WebConfig:
    path: str
    tls: TLSSettings | None
    http2: bool | None  # None: not set
    headers: tuple[tuple[str, str], ...]
    users: tuple[tuple[str, str], ...]


# --- parsing: shapes and values, no file IO beyond the YAML itself ---
def _mapping(value: Any, field: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _Fail(field, value, "must be a mapping")
    return value


def _keys(mapping: dict, allowed: tuple[str, ...], prefix: str) -> None:
    for key in mapping:
        field = f"{prefix}{key}"
        if not isinstance(key, str):
            raise _Fail(field, mapping[key], "unknown field")
        if key in _LATER:
            raise _Fail(
                field,
                mapping[key],
                f"unknown field: {_LATER[key]} came after exporter-toolkit v0.8.2, "
                "the format vramwatch and promtool 2.42 read",
            )
        if key not in allowed:
            raise _Fail(field, mapping[key], "unknown field; known here: " + ", ".join(allowed))


def _string(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise _Fail(field, value, "must be a string")
    if "\x00" in value:
        raise _Fail(field, value, "must not contain NUL")
    return value


def _bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise _Fail(field, value, "must be true or false")
    return value


def _choice(value: Any, field: str, options: dict) -> str:
    if not isinstance(value, str) or value not in options:
        raise _Fail(field, value, "must be one of " + ", ".join(options))
    return value


def _list(value: Any, field: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _Fail(field, value, "must be a list")
    return value


def _parse_tls(raw: Any) -> TLSSettings | None:
    p = "tls_server_config."
    m = _mapping(raw, "tls_server_config")
    _keys(m, _TLS_KEYS, p)
    if not m:
        return None  # as the toolkit: an empty section is plain HTTP
    for key in ("cert_file", "key_file"):
        if not m.get(key):
            raise _Fail(p + key, None, "missing: TLS needs cert_file and key_file", show=False)
    auth = _choice(m.get("client_auth_type") or "NoClientCert", p + "client_auth_type", CLIENT_AUTH)
    ca = _string(m["client_ca_file"], p + "client_ca_file") if m.get("client_ca_file") is not None else ""
    if ca and auth == "NoClientCert":
        raise _Fail(p + "client_ca_file", ca, "set without a client_auth_type that asks for certificates")
    if not ca and CLIENT_AUTH[auth] != ssl.CERT_NONE:
        raise _Fail(p + "client_auth_type", auth, "needs client_ca_file (the CA that signs client certificates)")
    lo = _choice(m.get("min_version", "TLS12"), p + "min_version", TLS_VERSIONS)
    hi = _choice(m.get("max_version", "TLS13"), p + "max_version", TLS_VERSIONS)
    if TLS_VERSIONS[lo] > TLS_VERSIONS[hi]:
        raise _Fail(p + "max_version", hi, f"is below min_version {lo}")
    suites = []
    for i, name in enumerate(_list(m.get("cipher_suites"), p + "cipher_suites")):
        if not isinstance(name, str) or name not in CIPHER_SUITES:
            raise _Fail(
                f"{p}cipher_suites[{i}]",
                name,
                "unknown or insecure cipher suite; use Go's names, e.g. TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
            )
        suites.append(name)
    if suites and not any(CIPHER_SUITES[s] for s in suites) and hi != "TLS13":
        raise _Fail(p + "cipher_suites", suites, "lists only TLS 1.3 suites, but max_version allows no TLS 1.3")
    curves = []
    for i, name in enumerate(_list(m.get("curve_preferences"), p + "curve_preferences")):
        if not isinstance(name, str) or name not in CURVES:
            raise _Fail(f"{p}curve_preferences[{i}]", name, "must be one of " + ", ".join(CURVES))
        curves.append(name)
    if len(curves) > 1:
        raise _Fail(
            p + "curve_preferences",
            curves,
            "list one curve: Python's ssl module cannot set a preference list (leave it out for OpenSSL's defaults)",
        )
    prefer = _bool(m.get("prefer_server_cipher_suites", True), p + "prefer_server_cipher_suites")
    return TLSSettings(
        _string(m["cert_file"], p + "cert_file"),
        _string(m["key_file"], p + "key_file"),
        auth,
        ca,
        lo,
        hi,
        tuple(suites),
        prefer,
        tuple(curves),
    )


def _parse_http(raw: Any) -> tuple[bool | None, tuple[tuple[str, str], ...]]:
    p = "http_server_config."
    m = _mapping(raw, "http_server_config")
    _keys(m, ("http2", "headers"), p)
    http2 = _bool(m["http2"], p + "http2") if m.get("http2") is not None else None
    headers = []
    for name, value in _mapping(m.get("headers"), p + "headers").items():
        field = f"{p}headers.{name}"
        if name not in HEADERS:
            raise _Fail(field, value, "this header can not be configured; allowed: " + ", ".join(HEADERS))
        value = _string(value, field)
        if "\r" in value or "\n" in value:
            raise _Fail(field, value, "must be one line")
        if HEADERS[name] and value not in HEADERS[name]:
            raise _Fail(field, value, "must be one of " + ", ".join(HEADERS[name]))
        headers.append((name, value))
    return http2, tuple(headers)


def _parse_users(raw: Any) -> tuple[tuple[str, str], ...]:
    users = []
    for name, hashed in _mapping(raw, "basic_auth_users").items():
        if isinstance(name, int) and not isinstance(name, bool):
            name = str(name)  # YAML reads `1234:` as a number; promtool takes it as the name "1234"
        if not isinstance(name, str):
            raise _Fail(f"basic_auth_users.{name}", None, "user names must be strings (quote it)", show=False)
        field = f"basic_auth_users.{name}"
        if ":" in name:
            raise _Fail(field, None, "user names cannot contain ':' (basic auth splits there)", show=False)
        if not isinstance(hashed, str) or not _BCRYPT.match(hashed) or not 4 <= int(hashed.split("$")[2]) <= 31:
            raise _Fail(
                field,
                None,
                "must be a bcrypt hash ($2y$10$ and 53 characters), e.g. from "
                "htpasswd -nBC 10 \"\" | tr -d ':\\n'; never a plain password",
                show=False,
            )
        users.append((name, hashed))
    return tuple(users)


def parse_web_config(path: str) -> WebConfig:
    """Read and check the file's shape and values (certificate files are checked by :func:`build`)."""
    from vramwatch.yaml_bounded import UnsafeYaml, load_bounded_yaml  # lazily: only with a web config

    try:
        data = load_bounded_yaml(path)  # as the settings file: no aliases (a few bytes can expand to GBs)
    except OSError as e:
        raise _error(path, "", None, f"cannot read the file: {e.strerror or e}") from None
    except UnsafeYaml as e:
        raise _error(path, "", None, f"refused: {e}") from None
    try:
        top = _mapping(data, "")
        _keys(top, _TOP_KEYS, "")
        tls = _parse_tls(top.get("tls_server_config"))
        http2, headers = _parse_http(top.get("http_server_config"))
        users = _parse_users(top.get("basic_auth_users"))
    except _Fail as f:
        raise _error(path, f.field, f.value, f.why, f.show) from None
    return WebConfig(path, tls, http2, headers, users)


# --- TLS: the files named, read into a context (at start, and by the server when they change) ---
def resolve(config_path: str, p: str) -> str:
    """A path in the file, relative to the file."""
    return p if os.path.isabs(p) else os.path.join(os.path.dirname(os.path.abspath(config_path)), p)


def _no_password() -> bytes:
    raise ValueError("encrypted")


def build_ssl_context(cfg: WebConfig) -> ssl.SSLContext:
    """An SSLContext from ``cfg.tls``; ConfigError naming the field if a file is missing or wrong."""
    tls = cfg.tls
    assert tls is not None
    p = "tls_server_config."
    cert, key = resolve(cfg.path, tls.cert_file), resolve(cfg.path, tls.key_file)
    for field, given, path in ((p + "cert_file", tls.cert_file, cert), (p + "key_file", tls.key_file, key)):
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            raise _error(cfg.path, field, given, f"cannot read: {e.strerror or e}") from None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = TLS_VERSIONS[tls.min_version]
    ctx.maximum_version = TLS_VERSIONS[tls.max_version]
    ctx.options |= ssl.OP_NO_RENEGOTIATION | ssl.OP_NO_COMPRESSION
    if tls.prefer_server_cipher_suites:
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    classic = [name for s in tls.cipher_suites if (name := CIPHER_SUITES[s])]
    if classic:
        try:
            ctx.set_ciphers(":".join(classic))
        except ssl.SSLError as e:
            raise _error(
                cfg.path, p + "cipher_suites", list(tls.cipher_suites), f"this OpenSSL offers none of them ({e})"
            ) from None
    elif tls.cipher_suites:  # only TLS 1.3 suites named: like Go, no TLS 1.2 suite is left
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    if tls.curve_preferences:
        ctx.set_ecdh_curve(CURVES[tls.curve_preferences[0]])
    try:
        ctx.load_cert_chain(cert, key, password=_no_password)
    except (ssl.SSLError, ValueError) as e:
        why = str(e)
        if "encrypted" in why:
            raise _error(
                cfg.path,
                p + "key_file",
                tls.key_file,
                "is encrypted; give an unencrypted key (protect it with file permissions)",
            ) from None
        raise _error(
            cfg.path,
            p + "key_file",
            tls.key_file,
            f"cert_file and key_file are not a PEM certificate and its private key ({why})",
        ) from None
    if tls.client_ca_file:
        ca = resolve(cfg.path, tls.client_ca_file)
        try:
            ctx.load_verify_locations(cafile=ca)
        except (OSError, ssl.SSLError) as e:
            why = getattr(e, "strerror", None) or str(e)
            raise _error(
                cfg.path, p + "client_ca_file", tls.client_ca_file, f"cannot load PEM certificates: {why}"
            ) from None
        if not ctx.cert_store_stats().get("x509"):
            raise _error(cfg.path, p + "client_ca_file", tls.client_ca_file, "holds no PEM certificate")
    ctx.verify_mode = CLIENT_AUTH[tls.client_auth_type]
    return ctx


def check_web_config(path: str) -> WebConfig:
    """Everything ``load_web_config`` checks, without serving: for ``start()`` and ``vramwatch config``."""
    cfg = parse_web_config(path)
    if cfg.tls is not None:
        build_ssl_context(cfg)
    if cfg.users:
        try:
            import bcrypt  # noqa: F401
        except ImportError:
            raise _error(
                path, "basic_auth_users", None, "needs the bcrypt package (pip install 'vramwatch[auth]')", show=False
            ) from None
    return cfg
