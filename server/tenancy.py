"""What a request's tenant changes on the wire: namespace ids, registrations and admin deletes.

Block keys and namespace ids travel in the client's terms and are stored in the tenant's:

    client key  k        ──tenant_key(tenant, k)──────────────> stored key
    client id   ns.client_id ──tenant_namespace_id(tenant, id)──> stored id (= Namespace.id, owner = tenant)

so a namespace registered by one tenant is invisible to another: bob registering the fields of
alice's namespace creates bob's own namespace (its own name, so its own retention), and neither
learns whether the other registered anything. Registering one's namespace again under another
name renames it (kvstore/namespaces.py); server.max_namespaces_per_tenant bounds how many a
tenant registers (each one rewrites namespaces.json, under the store's lock). The tenant ""
(a daemon without tokens) keeps the client's keys and ids as they are.
"""

from __future__ import annotations

import string
from typing import Any, Mapping

from aiohttp import web

from kvcache.kvstore.errors import BlockFormatError, UnknownNamespaceError
from kvcache.kvstore.hashing import Namespace, tenant_namespace_id


def stored_namespace_id(tenant: str, text: str, registered: Mapping[bytes, Namespace] | None = None) -> bytes:
    """The stored id of the namespace a client names by its 32-hex-digit id; with `registered`
    (the store's namespaces), one the tenant registered (see known_namespace_id)."""
    if len(text) != 32 or not all(c in string.hexdigits for c in text):   # fromhex would skip spaces
        raise BlockFormatError(f"a namespace id is 32 hex digits, got {text[:40]!r}")
    if registered is not None:
        return known_namespace_id(registered, tenant, bytes.fromhex(text))
    return tenant_namespace_id(tenant, bytes.fromhex(text))


def namespace_to_register(body: Any, tenant: str) -> Namespace:
    """The namespace a registration asks for, owned by the token's tenant (never one it names)."""
    if not isinstance(body, Mapping):
        raise BlockFormatError("expected a namespace object")
    if body.get("owner", tenant) != tenant:
        raise BlockFormatError("a namespace's owner is the tenant of the token that registers it; "
                               "leave \"owner\" out")
    return Namespace.from_dict({**body, "owner": tenant})


def registration_reply(ns: Namespace, before: Namespace | None) -> dict:
    """What a registration answers: the client's id, and the old name when it renamed the
    namespace (a name is its owner's to change; retention overrides follow it)."""
    reply: dict = {"id": ns.client_id.hex()}
    if before is not None and ns.name and ns.name != before.name:
        reply["renamed_from"] = before.name
    return reply


def known_namespace_id(namespaces: Mapping[bytes, Namespace], tenant: str, client_id: bytes) -> bytes:
    """The stored id of a namespace the tenant registered; 422 naming the id the client sent
    (the stored one is a hash it never saw), the same whoever else registered that id."""
    stored = tenant_namespace_id(tenant, client_id)
    if stored not in namespaces:
        raise UnknownNamespaceError(f"namespace {client_id.hex()} is not registered by this token's tenant; "
                                    "register it first (POST /v1/namespaces, register_namespace())")
    return stored


def delete_tenant(body: Mapping, tenant: str, admin: bool) -> str:
    """The tenant whose key space a delete's keys name: the token's own, or, for an admin that
    asks with "tenant", that tenant's (so purging another tenant's blocks is never an accident)."""
    if "tenant" not in body:
        return tenant
    named = body["tenant"]
    if not admin:
        raise web.HTTPForbidden(text='"tenant" in a delete needs an admin token')
    if not isinstance(named, str) or not named:
        raise BlockFormatError('"tenant" is the name of the tenant whose blocks to delete (a non-empty string)')
    return named
