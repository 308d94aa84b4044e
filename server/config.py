"""ServerConfig: the `[server]` section of the TOML config, plus tokens from the environment.

Every token names a tenant (its own key and namespace space), except a metrics token, which
may read /metrics and nothing else. A tenant-less token would live in the raw key space, where
it could compute and reach every tenant's stored keys, so one is refused at start and at
reconfigure. Without tokens (loopback only) the daemon is one trust domain: tenant "".
A model server's tenants each keep their cached prefixes to themselves unless `cache_sharing`
puts them in a group (cache_salt).
default_data_dir is where the daemon keeps its blocks when neither the command line nor the
config file names a directory.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping


def default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "kvcache")


@dataclass(frozen=True)
class TokenInfo:
    token: str
    tenant: str = ""
    admin: bool = False
    quota_bytes: int | None = None   # payload bytes the tenant may keep; puts beyond it get 507
    shared_memory: bool = False      # may map the DRAM arena (/v1/shm): it sees every tenant's bytes
    metrics: bool = False            # reads /metrics only (Prometheus): no tenant, no data

    def __post_init__(self) -> None:
        if not isinstance(self.token, str) or len(self.token) < 16:
            raise ValueError("auth tokens must be strings of at least 16 characters (use `openssl rand -hex 24`)")
        if not isinstance(self.tenant, str):
            raise ValueError(f"a token's tenant must be a string, got {self.tenant!r}")
        for flag in ("admin", "shared_memory", "metrics"):   # bool("false") is True: never coerce a grant
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"token {self.token[:4]}...: {flag} must be true or false, got "
                                 f"{getattr(self, flag)!r}")
        if self.quota_bytes is not None and not (_is_int(self.quota_bytes) and self.quota_bytes >= 0):
            raise ValueError(f"quota_bytes must be a whole number of bytes >= 0, got {self.quota_bytes!r}")
        if self.metrics:
            if self.tenant or self.admin or self.shared_memory or self.quota_bytes is not None:
                raise ValueError(f"token {self.token[:4]}... is a metrics token: it reads /metrics only, so it "
                                 "takes no tenant, admin, shared_memory or quota_bytes")
        elif not self.tenant.strip():
            raise ValueError(f"token {self.token[:4]}... names no tenant: give every token a tenant "
                             '(tenant = "acme", or KVCACHE_TOKENS="token:acme"); a token that only '
                             'reads /metrics sets metrics = true (KVCACHE_TOKENS="token::metrics")')


MAX_SECONDS = 1e9     # ~31 years: any longer timeout is a typo, and asyncio's timers overflow past floats


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8790
    tokens: tuple[TokenInfo, ...] = field(default_factory=tuple)
    max_block_bytes: int = 64 << 20
    max_batch_blocks: int = 4096
    max_keys: int = 100_000
    unix_socket: str = ""            # also listen on this unix socket (same-host clients)
    shm_socket: str = ""             # shared-memory control socket (default: <unix_socket>.shm or a temp path)
    shm_lease_s: float = 30.0        # a shared-memory read lease is void after this long
    max_shm_leases: int = 4096       # outstanding shared-memory leases (clients that never release)
    workers: int = 8                 # threads running blocking store calls
    shutdown_timeout_s: float = 30.0
    header_timeout_s: float = 10.0   # a request head must be whole this long after its first byte
    keepalive_s: float = 75.0        # an idle connection waits this long for its next request
    request_timeout_s: float = 60.0  # an upload's body, head to reply (also the limit per socket read)
    max_connections: int = 4096      # open client connections; more are closed at once
    max_pending_upload_bytes: int = 1 << 30   # payload bytes being received, daemon-wide; past it: 503
    max_uploads_per_tenant: int = 16  # upload threads one tenant holds; its further uploads go to aiohttp
    max_batch_get_bytes: int = 256 << 20   # batch_get group buffers held at once, daemon-wide; past it: 503
    max_namespaces_per_tenant: int = 256  # namespaces one tenant may register (each rewrites namespaces.json)
    cache_sharing: tuple[tuple[str, ...], ...] = ()   # model routes: groups of tenants sharing cached prefixes

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_sharing", sharing_groups(self.cache_sharing))
        for name in ("port", "max_block_bytes", "max_batch_blocks", "max_keys", "max_shm_leases", "workers",
                     "max_connections", "max_pending_upload_bytes", "max_uploads_per_tenant", "max_batch_get_bytes",
                     "max_namespaces_per_tenant"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"server.{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("shm_lease_s", "shutdown_timeout_s", "header_timeout_s", "request_timeout_s",
                     "keepalive_s"):
            v = getattr(self, name)
            # bounded, not only finite: 10**400 passes `< inf` as an int, then every timer overflows
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= MAX_SECONDS):
                raise ValueError(f"server.{name} must be a positive number of seconds up to {MAX_SECONDS:g}, "
                                 f"got {v!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"server.port must be 1-65535, got {self.port}")
        if self.shm_lease_s <= 0 or self.max_shm_leases < 1:
            raise ValueError("server.shm_lease_s must be > 0 and server.max_shm_leases >= 1")
        seen = [t.token for t in self.tokens]
        if len(set(seen)) != len(seen):
            raise ValueError("a token is listed twice ([server] tokens and KVCACHE_TOKENS together): "
                             "each token maps to one tenant, so list it once")
        if not self.tokens and not is_loopback(self.host):
            raise ValueError(f"refusing to serve on {self.host} without auth: set [server] tokens or "
                             "KVCACHE_TOKENS, or bind to 127.0.0.1")

    @property
    def auth_required(self) -> bool:
        return bool(self.tokens)

    def cache_salt(self, tenant: str) -> str:
        """What keys a tenant's cached prefixes on the model routes: its sharing group's name (the
        group's first tenant), else its own. A tenant outside every group never has a group's
        salt, since that is the name of a tenant in the group."""
        group = next((g for g in self.cache_sharing if tenant in g), None)
        return group[0] if group else tenant

    def match_token(self, presented: str) -> TokenInfo | None:
        """The token `presented` is, compared with every configured token in constant time (no
        early exit: how long the check takes says nothing about how close a guess was)."""
        match = None
        for t in self.tokens:
            if hmac.compare_digest(t.token.encode(), presented.encode("utf-8", "surrogatepass")):
                match = t
        return match

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], env: Mapping[str, str] = os.environ,
                  kept_tokens: tuple[TokenInfo, ...] = (), **overrides) -> "ServerConfig":
        """The [server] table `d`, tokens from KVCACHE_TOKENS in `env` added, then `kept_tokens`
        (a reload's tokens still in force) unless `d` lists the same token string."""
        d = dict(d)
        tokens = parse_tokens(d.pop("tokens", []), env)
        listed = {t.token for t in tokens}
        tokens += tuple(t for t in kept_tokens if t.token not in listed)
        _check_known(cls, d)
        d.update({k: v for k, v in overrides.items() if v is not None})
        return cls(tokens=tokens, **d)

    def updated(self, d: Mapping[str, Any]) -> "ServerConfig":
        """These settings with those in `d` changed; what `d` leaves out stays as it is. `tokens`
        in `d` replace the whole list, tokens from KVCACHE_TOKENS included: that is how one of
        those is revoked without a restart."""
        d = dict(d)
        if "tokens" in d:
            d["tokens"] = parse_tokens(d["tokens"], {})
        _check_known(self, {k: v for k, v in d.items() if k != "tokens"})
        return replace(self, **d)


def sharing_groups(value) -> tuple[tuple[str, ...], ...]:
    """[server] cache_sharing checked: groups of two or more tenant names, each tenant in one group."""
    example = 'e.g. cache_sharing = [["acme", "acme-batch"]]'
    if not isinstance(value, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in value):
        raise ValueError(f"server.cache_sharing must be a list of groups, each a list of tenant names ({example})")
    seen: set[str] = set()
    for group in value:
        if len(group) < 2:
            raise ValueError(f"server.cache_sharing: the group {list(group)} has fewer than two tenants; a tenant "
                             "shares its cached prefixes with itself already")
        for tenant in group:
            if not isinstance(tenant, str) or not tenant.strip():
                raise ValueError(f"server.cache_sharing: {tenant!r} is not a tenant name ({example})")
            if tenant in seen:
                raise ValueError(f"server.cache_sharing: tenant {tenant!r} is listed twice; a tenant is in one "
                                 "group at most")
            seen.add(tenant)
    return tuple(tuple(g) for g in value)


def _check_known(cls, d: Mapping[str, Any]) -> None:
    known = {f.name for f in fields(cls)} - {"tokens"}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown [server] settings {sorted(unknown)}; known: {sorted(known)}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


TOKEN_FIELDS = ("token", "tenant", "admin", "quota_bytes", "shared_memory", "metrics")


def parse_tokens(items, env: Mapping[str, str]) -> tuple[TokenInfo, ...]:
    """[server] tokens (a list of tables) plus KVCACHE_TOKENS from `env`."""
    if not isinstance(items, (list, tuple)) or not all(isinstance(t, Mapping) and "token" in t for t in items):
        raise ValueError(f"server.tokens must be a list of tables, each with a token (fields: {list(TOKEN_FIELDS)})")
    for t in items:
        if set(t) - set(TOKEN_FIELDS):
            raise ValueError(f"unknown token fields {sorted(set(t) - set(TOKEN_FIELDS))}; known: {list(TOKEN_FIELDS)}")
    tokens = [TokenInfo(t["token"], t.get("tenant", ""), t.get("admin", False), t.get("quota_bytes"),
                        t.get("shared_memory", False), t.get("metrics", False)) for t in items]
    return tuple(tokens + parse_env_tokens(env.get("KVCACHE_TOKENS", "")))


def parse_env_tokens(text: str) -> list[TokenInfo]:
    """KVCACHE_TOKENS="token:tenant[:admin],token2:tenant2,token3::metrics" """
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("admin", "metrics")):
            raise ValueError(f"KVCACHE_TOKENS entry {item[:6]}... must be token:tenant, token:tenant:admin "
                             "or token::metrics")
        role = parts[2] if len(parts) == 3 else ""
        out.append(TokenInfo(parts[0], parts[1], admin=role == "admin", metrics=role == "metrics"))
    return out


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
