"""Who sent a request, and what that may reveal: tenants named by a keyed hash of their credential.

    Authorization: Bearer sk-alice-...  --HMAC-SHA256(server key)-->  tenant "t-3f9a2c1b0d4e5f60"

The id, never the key, is what the engine schedules by (vtc), what /metrics labels, and what salts
the prefix cache with --isolate-tenants. The server key is random per process unless the operator
sets MINIKV_TENANT_KEY (then ids stay the same across restarts, and dashboards keep their series).

With isolate_tenants, the tenant is the credential alone: a client cannot pick another tenant's
cache by naming it in a field (`user`). Without it, `user` (else the key) names the tenant, for
fairness only.

Cache salts join the tenant and the client's `cache_salt` without ambiguity (length-prefixed), so
key "a" with salt "b/c" and key "a/b" with salt "c" never share a block.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets

ANONYMOUS = "anonymous"  # no credential, no `user`


class Tenants:
    def __init__(self, key: bytes | str | None = None, isolate: bool = False):
        if key is None:
            key = os.environ.get("MINIKV_TENANT_KEY") or secrets.token_bytes(32)
        self._key = key.encode() if isinstance(key, str) else key
        self.isolate = isolate

    def id_of(self, name: str) -> str:
        """A credential (or a `user` string) -> its stable, non-reversible tenant id."""
        digest = hmac.new(self._key, name.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()
        return f"t-{digest[:16]}"

    def of(self, authorization: str, user: str | None) -> str:
        """The tenant of a request, from its `Authorization: Bearer KEY` header and `user` field."""
        key = authorization[7:].strip() if authorization[:7].lower() == "bearer " else ""
        name = key if self.isolate else (user or key)
        return self.id_of(name) if name else ANONYMOUS

    def cache_salt(self, tenant: str, cache_salt: str | None) -> str | None:
        """The prefix cache's salt: the tenant (when isolated) and the client's cache_salt, each
        length-prefixed, so that no two different pairs give the same salt."""
        if not self.isolate:
            return cache_salt
        parts = [tenant] + ([cache_salt] if cache_salt is not None else [])
        return "".join(f"{len(p)}:{p}" for p in parts)
