"""ServerConfig: the `[server]` section of the TOML config, plus tokens from the environment."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping


@dataclass(frozen=True)
class TokenInfo:
    token: str
    tenant: str
    admin: bool = False
    quota_bytes: int | None = None   # payload bytes the tenant may keep; puts beyond it get 507
    shared_memory: bool = False      # may map the DRAM arena (/v1/shm): it sees every tenant's bytes

    def __post_init__(self) -> None:
        if not isinstance(self.token, str) or len(self.token) < 16:
            raise ValueError("auth tokens must be strings of at least 16 characters (use `openssl rand -hex 24`)")
        if not isinstance(self.tenant, str):
            raise ValueError(f"a token's tenant must be a string, got {self.tenant!r}")
        if self.quota_bytes is not None and not (_is_int(self.quota_bytes) and self.quota_bytes >= 0):
            raise ValueError(f"quota_bytes must be a whole number of bytes >= 0, got {self.quota_bytes!r}")


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

    def __post_init__(self) -> None:
        for name in ("port", "max_block_bytes", "max_batch_blocks", "max_keys", "max_shm_leases", "workers"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"server.{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("shm_lease_s", "shutdown_timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")):
                raise ValueError(f"server.{name} must be a positive number of seconds, got {v!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"server.port must be 1-65535, got {self.port}")
        if self.shm_lease_s <= 0 or self.max_shm_leases < 1:
            raise ValueError("server.shm_lease_s must be > 0 and server.max_shm_leases >= 1")
        if not self.tokens and not is_loopback(self.host):
            raise ValueError(f"refusing to serve on {self.host} without auth: set [server] tokens or "
                             "KVCACHE_TOKENS, or bind to 127.0.0.1")

    @property
    def auth_required(self) -> bool:
        return bool(self.tokens)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], env: Mapping[str, str] = os.environ, **overrides) -> "ServerConfig":
        d = dict(d)
        tokens = parse_tokens(d.pop("tokens", []), env)
        _check_known(cls, d)
        d.update({k: v for k, v in overrides.items() if v is not None})
        return cls(tokens=tokens, **d)

    def updated(self, d: Mapping[str, Any], env: Mapping[str, str] = os.environ) -> "ServerConfig":
        """These settings with those in `d` changed; what `d` leaves out stays as it is (`tokens`
        in `d` replace the whole list, KVCACHE_TOKENS from the environment added)."""
        d = dict(d)
        if "tokens" in d:
            d["tokens"] = parse_tokens(d["tokens"], env)
        _check_known(self, {k: v for k, v in d.items() if k != "tokens"})
        return replace(self, **d)


def _check_known(cls, d: Mapping[str, Any]) -> None:
    known = {f.name for f in fields(cls)} - {"tokens"}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown [server] settings {sorted(unknown)}; known: {sorted(known)}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_tokens(items, env: Mapping[str, str]) -> tuple[TokenInfo, ...]:
    """[server] tokens (a list of tables) plus KVCACHE_TOKENS from the environment."""
    if not isinstance(items, (list, tuple)) or not all(isinstance(t, Mapping) and "token" in t for t in items):
        raise ValueError("server.tokens must be a list of tables, each with a token (and tenant, admin, "
                         "quota_bytes, shared_memory)")
    tokens = [TokenInfo(t["token"], t.get("tenant", ""), bool(t.get("admin", False)), t.get("quota_bytes"),
                        bool(t.get("shared_memory", False))) for t in items]
    return tuple(tokens + parse_env_tokens(env.get("KVCACHE_TOKENS", "")))


def parse_env_tokens(text: str) -> list[TokenInfo]:
    """KVCACHE_TOKENS="token:tenant[:admin],token2:tenant2" """
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "admin"):
            raise ValueError(f"KVCACHE_TOKENS entry {item[:6]}... must be token:tenant or token:tenant:admin")
        out.append(TokenInfo(parts[0], parts[1], len(parts) == 3))
    return out


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
