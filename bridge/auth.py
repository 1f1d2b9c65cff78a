"""Who is calling: an API key or a signed JWT, resolved to a (narrowed) tenant config.

``Authorization: Bearer <token>`` carries one of:

- an API key, looked up by its SHA-256 in the tenant directory, compared in
  constant time (``TenantDirectory.by_api_key``); keys themselves are never stored;
- a JWT signed HS256 or RS256. ``exp`` and ``aud`` are required and checked, ``nbf``
  is checked when present. Claims: ``tenant`` (required), ``priority_class`` (0-2),
  ``model_access`` (model names) and ``quota_balance`` (tokens left). Claims can only
  narrow the tenant's config: a better class or a model the tenant lacks is ignored.

The algorithm is chosen by the key configured for it, never by the token alone: an
HS256 token is verified only with the HS256 secret, an RS256 one only with the public
key, and every other algorithm (``none`` included) is refused.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import jwt

from bridge.errors import ApiError, unauthorized
from tokenbus.tenants import TenantConfig, TenantDirectory

TENANT_ID = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


@dataclass(frozen=True)
class Caller:
    tenant: TenantConfig
    """The tenant's config, already narrowed by the token's claims."""
    credential_id: str
    """SHA-256 of the bearer token: the per-key throttle's key; never the token itself."""
    quota_balance: int | None = None
    """Tokens the token may still spend; None when the credential sets no balance."""


def narrow(tenant: TenantConfig, claims: dict[str, Any]) -> TenantConfig:
    """The tenant's config with the claims applied; a claim never widens anything."""
    updates: dict[str, Any] = {}
    klass = claims.get("priority_class")
    if klass is not None:
        if not isinstance(klass, int) or isinstance(klass, bool) or not 0 <= klass <= 2:
            raise unauthorized("Token claim priority_class must be 0, 1 or 2.")
        updates["priority_class"] = max(tenant.priority_class, klass)  # 0 is the best
    access = claims.get("model_access")
    if access is not None:
        if not isinstance(access, list) or not all(isinstance(m, str) for m in access):
            raise unauthorized("Token claim model_access must be a list of model names.")
        if "*" in access:
            allowed = list(tenant.models)
        else:
            allowed = [m for m in access if tenant.may_use(m)]
        updates["models"] = allowed
    return tenant.model_copy(update=updates) if updates else tenant


class Authenticator:
    def __init__(
        self,
        directory: TenantDirectory,
        *,
        audience: str,
        hs256_secret: str | None = None,
        rs256_public_key: str | None = None,
        leeway_s: float = 5.0,
    ) -> None:
        self._directory = directory
        self._audience = audience
        self._keys: dict[str, Any] = {}
        if hs256_secret:
            self._keys["HS256"] = hs256_secret
        if rs256_public_key:
            self._keys["RS256"] = rs256_public_key
        self._leeway_s = leeway_s

    def authenticate(self, authorization: str | None) -> Caller:
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise unauthorized("Missing bearer token: send 'Authorization: Bearer <key>'.")
        credential_id = hashlib.sha256(token.encode()).hexdigest()
        if _looks_like_jwt(token):
            return self._from_jwt(token, credential_id)
        tenant = self._directory.by_api_key(token)
        if tenant is None:
            raise unauthorized()
        return Caller(tenant=tenant, credential_id=credential_id)

    def _from_jwt(self, token: str, credential_id: str) -> Caller:
        try:
            algorithm = jwt.get_unverified_header(token).get("alg")
            key = self._keys.get(algorithm) if isinstance(algorithm, str) else None
            if key is None or not isinstance(algorithm, str):
                raise unauthorized("Token algorithm is not accepted here.")
            claims: dict[str, Any] = jwt.decode(
                token,
                key,
                algorithms=[algorithm],
                audience=self._audience,
                leeway=self._leeway_s,
                options={"require": ["exp", "aud", "tenant"]},
            )
        except ApiError:
            raise
        except jwt.ExpiredSignatureError:
            raise unauthorized("Token has expired.") from None
        except jwt.ImmatureSignatureError:
            raise unauthorized("Token is not valid yet (nbf).") from None
        except jwt.InvalidAudienceError:
            raise unauthorized("Token audience is not this service.") from None
        except jwt.PyJWTError:
            raise unauthorized("Invalid token.") from None
        tenant_id = claims["tenant"]
        if not isinstance(tenant_id, str) or not TENANT_ID.match(tenant_id):
            raise unauthorized("Token claim tenant is not a valid tenant ID.")
        balance = claims.get("quota_balance")
        if balance is not None and (not isinstance(balance, int) or isinstance(balance, bool)):
            raise unauthorized("Token claim quota_balance must be an integer.")
        tenant = narrow(self._directory.get(tenant_id), claims)
        return Caller(tenant=tenant, credential_id=credential_id, quota_balance=balance)


def _looks_like_jwt(token: str) -> bool:
    return token.count(".") == 2 and token.startswith("eyJ")
