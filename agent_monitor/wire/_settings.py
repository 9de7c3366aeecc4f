"""Connection settings read at the edge: the broker URL (`mqtt://` / `mqtts://`, credentials, TLS
files)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

DEFAULT_BROKER = "mqtt://127.0.0.1:1883"


class SettingsError(ValueError):
    """A setting that cannot be used; the message says which and what to write instead."""


@dataclass(frozen=True, slots=True)
class BrokerSettings:
    """Where and how to reach the MQTT broker."""

    host: str = "127.0.0.1"
    port: int = 1883
    tls: bool = False
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        username: str | None = None,
        password: str | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
    ) -> BrokerSettings:
        """Parse `mqtt://[user[:password]@]host[:port]` or `mqtts://...`; explicit credentials
        win over the URL's."""
        parts = urlsplit(url.strip())
        if parts.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
            raise SettingsError(
                f"broker URL {url!r} has scheme {parts.scheme or '(none)'!r}; use "
                "mqtt://host:port or mqtts://host:port"
            )
        tls = parts.scheme in ("mqtts", "ssl")
        if not parts.hostname:
            raise SettingsError(f"broker URL {url!r} has no host; use e.g. mqtt://127.0.0.1:1883")
        try:
            port = parts.port or (8883 if tls else 1883)
        except ValueError:
            raise SettingsError(
                f"broker URL {url!r} has an invalid port; use a number 1-65535"
            ) from None
        if parts.path not in ("", "/") or parts.query:
            raise SettingsError(
                f"broker URL {url!r} has a path or query; use only scheme://host:port"
            )
        if key_file is not None and cert_file is None:
            raise SettingsError(
                "a TLS client key was given without its certificate; pass --tls-cert as well"
            )
        return cls(
            host=parts.hostname,
            port=port,
            tls=tls or ca_file is not None or cert_file is not None,
            username=username
            if username is not None
            else (unquote(parts.username) if parts.username else None),
            password=password
            if password is not None
            else (unquote(parts.password) if parts.password else None),
            ca_file=ca_file,
            cert_file=cert_file,
            key_file=key_file,
        )

    @property
    def url(self) -> str:
        """The URL without credentials (safe to log)."""
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context for mqtts (system CAs unless a CA file is given), or None for plain
        TCP."""
        if not self.tls:
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
            if self.cert_file:
                ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as e:
            raise SettingsError(f"cannot load the TLS files for {self.url}: {e}") from None
        return ctx
