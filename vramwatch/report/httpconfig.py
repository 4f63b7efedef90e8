"""How the report reaches a Prometheus that wants credentials or TLS: Prometheus' own HTTP client config.

The keys of ``--http-config-file`` are those of Prometheus' ``http_config`` (and promtool's
``--http.config.file``): ``basic_auth`` (``username``, ``username_file``, ``password``,
``password_file``), ``authorization`` (``type``, ``credentials``, ``credentials_file``),
``tls_config`` (``ca_file``, ``cert_file``, ``key_file``, ``insecure_skip_verify``)
and ``http_headers`` (``Name: {values, secrets, files}``); relative paths are relative to the file.
The command-line flags set the same fields. Every credential and header value is a secret: it goes
into requests only, never into the page, a log line or an error message.
"""

from __future__ import annotations

import base64
import os
import ssl
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vramwatch.errors import ConfigError

# set by the client itself, or by the auth options (Prometheus refuses these in http_headers too)
RESERVED_HEADERS = frozenset(
    {"authorization", "host", "content-length", "content-type", "user-agent", "connection", "accept-encoding"}
)


@dataclass(frozen=True)
class HTTPConfig:
    """Headers sent with every request (auth included) and the TLS settings; ``repr`` hides the headers."""

    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    insecure_skip_verify: bool = False

    def ssl_context(self) -> ssl.SSLContext:
        """The client's TLS context; raises ConfigError naming a CA or certificate file that does not load."""
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file or None)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"CA file {self.ca_file}: does not load ({e})") from None
        if self.cert_file:
            try:
                ctx.load_cert_chain(self.cert_file, self.key_file or None)
            except (OSError, ssl.SSLError) as e:
                raise ConfigError(f"client certificate {self.cert_file} / key {self.key_file}: {e}") from None
        if self.insecure_skip_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx


def redact_url(url: str) -> str:
    """``url`` without user info, query or fragment: what the page and the log lines may show."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "<an unparsable URL>"
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{port}" if port else "")
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def split_userinfo(url: str) -> tuple[str, str | None, str | None]:
    """(url without user info, username, password) of ``http://user:password@host``."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ConfigError(f"--prometheus {redact_url(url)}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--prometheus {redact_url(url)}: wants http:// or https:// and a host")
    if parts.username is None:
        return url, None, None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    netloc = host + (f":{port}" if port else "")
    bare = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    user = urllib.parse.unquote(parts.username)
    password = urllib.parse.unquote(parts.password) if parts.password is not None else None
    return bare, user, password


def _read_secret(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None


def _check_file(path: str, what: str) -> str:
    if path and not os.path.isfile(path):
        raise ConfigError(f"{what} {path}: no such file")
    return path


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    name = name.strip()
    if not sep or not name or any(c.isspace() for c in name):
        # the text may be a secret (a token given without its header name): never echo it
        raise ConfigError("--header wants 'Name: value' (a header name without spaces, then ':'); not shown")
    return name, value.strip()


def _mapping(doc: Any, where: str, keys: set[str]) -> Mapping[str, Any]:
    if doc is None:
        return {}
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{where}: wants a mapping, got {type(doc).__name__}")
    unknown = sorted(set(map(str, doc)) - keys)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; known: {', '.join(sorted(keys))}")
    return doc


@dataclass
class _Fields:
    """What the flags and the file set, before it becomes one HTTPConfig."""

    username: str | None = None
    password: str | None = None
    authorization: tuple[str, str] | None = None  # (type, credentials)
    headers: list[tuple[str, str]] = field(default_factory=list)
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    insecure_skip_verify: bool = False


def _from_file(path: str, f: _Fields) -> None:
    import yaml

    base = os.path.dirname(os.path.abspath(path))

    def rel(p: Any, what: str) -> str:
        if not isinstance(p, str) or not p:
            raise ConfigError(f"{path}: {what} wants a file name")
        return os.path.join(base, p)

    try:
        with open(path, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
    except OSError as e:
        raise ConfigError(f"--http-config-file {path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--http-config-file {path}: not YAML ({getattr(e, 'problem', e)})") from None
    top = _mapping(doc, path, {"basic_auth", "authorization", "tls_config", "http_headers"})
    if "basic_auth" in top and "authorization" in top:
        raise ConfigError(f"{path}: basic_auth and authorization are mutually exclusive")
    ba_keys = {"username", "username_file", "password", "password_file"}
    ba = _mapping(top.get("basic_auth"), f"{path}: basic_auth", ba_keys)
    if ba:
        if "password" in ba and "password_file" in ba:
            raise ConfigError(f"{path}: basic_auth: give password or password_file, not both")
        f.username = (
            _read_secret(rel(ba["username_file"], "username_file"), "basic_auth.username_file")
            if "username_file" in ba
            else str(ba.get("username", ""))
        )
        if "password_file" in ba:
            f.password = _read_secret(rel(ba["password_file"], "password_file"), "basic_auth.password_file")
        else:
            f.password = str(ba.get("password", ""))
    az = _mapping(top.get("authorization"), f"{path}: authorization", {"type", "credentials", "credentials_file"})
    if az:
        if "credentials" in az and "credentials_file" in az:
            raise ConfigError(f"{path}: authorization: give credentials or credentials_file, not both")
        kind = str(az.get("type", "Bearer"))
        if kind.lower() == "basic":
            raise ConfigError(f"{path}: authorization: type Basic is not allowed, use basic_auth")
        cred = (
            _read_secret(rel(az["credentials_file"], "credentials_file"), "authorization.credentials_file")
            if "credentials_file" in az
            else str(az.get("credentials", ""))
        )
        f.authorization = (kind, cred)
    tls = _mapping(
        top.get("tls_config"),
        f"{path}: tls_config",
        {"ca_file", "cert_file", "key_file", "insecure_skip_verify"},
    )
    for key in ("ca_file", "cert_file", "key_file"):
        if key in tls:
            setattr(f, key, _check_file(rel(tls[key], key), f"tls_config.{key}"))
    f.insecure_skip_verify = bool(tls.get("insecure_skip_verify", False))
    headers = _mapping(top.get("http_headers"), f"{path}: http_headers", set(map(str, top.get("http_headers") or {})))
    for name, spec in headers.items():
        h = _mapping(spec, f"{path}: http_headers.{name}", {"values", "secrets", "files"})
        for v in list(h.get("values") or []) + list(h.get("secrets") or []):
            f.headers.append((str(name), str(v)))
        for p in h.get("files") or []:
            f.headers.append((str(name), _read_secret(rel(p, f"http_headers.{name}.files"), f"http_headers.{name}")))


def http_config(
    url: str,
    *,
    config_file: str = "",
    bearer_token: str = "",
    bearer_token_file: str = "",
    basic_auth_user: str = "",
    basic_auth_password_file: str = "",
    headers: list[str] | tuple[str, ...] = (),
    ca_file: str = "",
    cert_file: str = "",
    key_file: str = "",
    insecure_skip_verify: bool = False,
) -> tuple[str, HTTPConfig]:
    """(the URL without user info, its HTTPConfig) from the flags, the file and the URL's user info.

    Raises ConfigError naming the flag or key that is wrong (never a secret's value).
    """
    bare, url_user, url_password = split_userinfo(url)
    f = _Fields()
    if config_file:
        _from_file(config_file, f)
    sources = [
        name
        for name, given in (
            ("--http-config-file's basic_auth", f.username is not None),
            ("--http-config-file's authorization", f.authorization is not None),
            ("user info in the URL", url_user is not None),
            ("--bearer-token", bool(bearer_token)),
            ("--bearer-token-file", bool(bearer_token_file)),
            ("--basic-auth-user / --basic-auth-password-file", bool(basic_auth_user or basic_auth_password_file)),
        )
        if given
    ]
    # the URL's user name with a password file is one source: http://user@host + --basic-auth-password-file
    if url_user is not None and url_password is None and basic_auth_password_file and not basic_auth_user:
        sources.remove("user info in the URL")
    if len(sources) > 1:
        raise ConfigError(f"give one way to authenticate, not {' and '.join(sources)}")
    if url_user is not None:
        f.username, f.password = url_user, url_password or ""
    if bearer_token:
        f.authorization = ("Bearer", bearer_token)
    if bearer_token_file:
        f.authorization = ("Bearer", _read_secret(bearer_token_file, "--bearer-token-file"))
    if basic_auth_user or basic_auth_password_file:
        f.username = basic_auth_user or url_user or ""
        if not f.username:
            raise ConfigError("--basic-auth-password-file needs a user: --basic-auth-user or http://USER@host")
        f.password = (
            _read_secret(basic_auth_password_file, "--basic-auth-password-file") if basic_auth_password_file else ""
        )
    for text in headers:
        f.headers.append(_header(text))
    for name, _ in f.headers:
        if name.lower() in RESERVED_HEADERS:
            raise ConfigError(f"header {name!r} is set by the client or the auth options, not as an extra header")
    f.ca_file = _check_file(ca_file, "--ca-file") or f.ca_file
    f.cert_file = _check_file(cert_file, "--cert-file") or f.cert_file
    f.key_file = _check_file(key_file, "--key-file") or f.key_file
    f.insecure_skip_verify = insecure_skip_verify or f.insecure_skip_verify
    if f.key_file and not f.cert_file:
        raise ConfigError("a client key without a client certificate (--cert-file / tls_config.cert_file)")
    if (f.ca_file or f.cert_file or f.insecure_skip_verify) and not bare.startswith("https://"):
        raise ConfigError(f"TLS options given for {redact_url(bare)}: use an https:// URL")
    out = list(f.headers)
    if f.username is not None:
        out.insert(0, ("Authorization", _basic(f.username, f.password or "")))
    elif f.authorization is not None:
        kind, cred = f.authorization
        if not cred:
            raise ConfigError("the bearer token / authorization credentials are empty")
        out.insert(0, ("Authorization", f"{kind} {cred}"))
    return bare, HTTPConfig(tuple(out), f.ca_file, f.cert_file, f.key_file, f.insecure_skip_verify)
