"""Who is calling the bridge: ``tokenbus.auth`` on the HTTP ``Authorization`` header.

The rules are the bus's (an API key, or a tenant JWT whose claims only narrow the
tenant); a refusal is OpenAI's 401. Service tokens are for the bus only and are not
accepted here. What the bridge then produces carries a service token for the tenant it
authenticated (``tokenbus.auth.ServiceTokens``), never a bare tenant id.
"""

from __future__ import annotations

from typing import Any

from bridge.errors import unauthorized
from tokenbus.auth import Authenticator as BusAuthenticator
from tokenbus.auth import AuthError, Principal
from tokenbus.auth import narrow as _narrow
from tokenbus.tenants import TenantConfig, TenantDirectory
from tokenbus.topics import Topics

Caller = Principal


def narrow(tenant: TenantConfig, claims: dict[str, Any]) -> TenantConfig:
    """The tenant's config with the claims applied; a claim never widens anything."""
    try:
        return _narrow(tenant, claims)
    except AuthError as exc:
        raise unauthorized(exc.message) from None


class Authenticator:
    def __init__(
        self,
        directory: TenantDirectory,
        *,
        audience: str,
        hs256_secret: str | None = None,
        rs256_public_key: str | None = None,
        allow_unlisted_tenants: bool = False,
        leeway_s: float = 5.0,
        topics: Topics | None = None,
    ) -> None:
        self._auth = BusAuthenticator(
            directory,
            topics or Topics(),
            audience=audience,
            hs256_secret=hs256_secret,
            rs256_public_key=rs256_public_key,
            allow_unlisted_tenants=allow_unlisted_tenants,
            leeway_s=leeway_s,
        )

    def authenticate(self, authorization: str | None) -> Caller:
        try:
            return self._auth.authenticate(authorization)
        except AuthError as exc:
            if exc.code == "invalid_api_key":
                raise unauthorized() from None
            raise unauthorized(exc.message) from None
