"""Who is producing: one credential, checked the same way on every entry.

# "Bearer <token>" --> API key | tenant JWT | service token --> Principal
# Principal: the tenant's config narrowed by claims, its balance, its reply topics

The bridge reads the credential from the HTTP ``Authorization`` header; the Faust job
reads it from the ``authorization`` header of every request record. Three kinds:

- an API key, looked up by its SHA-256 in the tenant directory and compared in
  constant time; keys themselves are never stored;
- a tenant JWT, HS256 or RS256, from the operator's issuer. ``exp`` and ``aud`` are
  required, ``nbf`` is checked when present. Claims: ``tenant`` (required),
  ``priority_class``, ``model_access``, ``quota_balance`` and ``reply_prefix``; they
  only narrow the tenant's config. ``quota_balance`` is what the token may spend over
  its life, in the price table's cost units (a number or a decimal string): the job
  charges it as a hard budget of its own, keyed by the token's SHA-256;
- a service token (header ``kid: tokenbus-service``), HS256 under
  ``Settings.bus_service_secret``, which only tokenbus's own services hold: the bridge
  authenticates its HTTP caller once and carries the result to the job this way,
  never as a bare tenant id. It may also carry the bridge's screening flags.

The algorithm is chosen by the key configured for it, never by the token alone; every
other algorithm (``none`` included) is refused, and so is a token with ``=`` padding
(one token is one credential: its SHA-256 keys one balance). A tenant the tenants file
does not list is refused unless ``allow_unlisted_tenants`` (then a token's issuer
vouches for it, and it gets the defaults). Replies: a credential may name only its own reply
topics, ``<prefix>.replies.<tenant>.`` and below, or the ``reply_prefix`` its token
carries (the bridge's one reply topic, a multi-tenant client's).
"""

from __future__ import annotations

import hashlib
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

import jwt

from schemas import TENANT_ID_PATTERN
from tokenbus.errors import CodedError
from tokenbus.tenants import TenantConfig, TenantDirectory
from tokenbus.topics import Topics

SERVICE_KID = "tokenbus-service"
SERVICE_AUDIENCE = "tokenbus-bus"
TENANT_ID = re.compile(TENANT_ID_PATTERN)
_CACHE_SIZE = 10_000
_NANO = Decimal("0.000000001")


class AuthError(CodedError):
    """A credential that proves nothing; ``code`` is machine-readable."""

    def __init__(self, message: str, code: str = "invalid_credential") -> None:
        super().__init__(code, message)


@dataclass(frozen=True)
class Principal:
    tenant: TenantConfig
    """The tenant's config, already narrowed by the token's claims."""
    credential_id: str
    """SHA-256 of the token: a throttle's key; never the token itself."""
    reply_prefix: str
    """Reply topics this credential may name: those that start with this."""
    quota_balance: Decimal | None = None
    """Cost units the credential may spend over its life (its own hard budget, keyed by
    ``key_sha256``); None: no such limit."""
    service: bool = False
    """A tokenbus service's token: its ``flags`` claim is believed."""
    flags: tuple[str, ...] = field(default_factory=tuple)
    key_sha256: str | None = None
    """The SHA-256 of the credential behind this one, which key budgets (and a token's
    balance) are charged to: an API key's, as the tenants file lists it; a tenant
    JWT's own; or the one a service token says its caller used."""

    @property
    def tenant_id(self) -> str:
        return self.tenant.tenant_id

    def owns_reply_topic(self, topic: str) -> bool:
        """A prefix that ends in ``.`` owns the topics below it (a tenant's); any other
        names one topic (a bridge's, a tool's)."""
        if self.reply_prefix.endswith("."):
            return topic.startswith(self.reply_prefix) and len(topic) > len(self.reply_prefix)
        return topic == self.reply_prefix


def narrow(tenant: TenantConfig, claims: dict[str, Any]) -> TenantConfig:
    """The tenant's config with the claims applied; a claim never widens anything."""
    updates: dict[str, Any] = {}
    klass = claims.get("priority_class")
    if klass is not None:
        if not isinstance(klass, int) or isinstance(klass, bool) or not 0 <= klass <= 2:
            raise AuthError("Token claim priority_class must be 0, 1 or 2.")
        updates["priority_class"] = max(tenant.priority_class, klass)  # 0 is the best
    access = claims.get("model_access")
    if access is not None:
        if not isinstance(access, list) or not all(isinstance(m, str) for m in access):
            raise AuthError("Token claim model_access must be a list of model names.")
        if "*" in access:
            allowed = list(tenant.models)
        else:
            allowed = [m for m in access if tenant.may_use(m)]
        updates["models"] = allowed
    return tenant.model_copy(update=updates) if updates else tenant


def cost_units(claim: Any) -> Decimal | None:
    """The ``quota_balance`` claim: cost units, at most nine decimals, not negative."""
    if claim is None:
        return None
    if isinstance(claim, bool) or not isinstance(claim, int | float | str):
        raise AuthError("Token claim quota_balance must be a number of cost units.")
    try:
        value = Decimal(str(claim))
        exact = value.is_finite() and value >= 0 and value == value.quantize(_NANO)
    except InvalidOperation:
        exact = False
    if not exact:
        raise AuthError("Token claim quota_balance must be cost units >= 0, to nine decimals.")
    return value


def tenant_reply_prefix(topics: Topics, tenant_id: str) -> str:
    """The reply topics every credential of the tenant owns."""
    return topics.replies(f"{tenant_id}.")


def mint_service_token(
    secret: str,
    tenant_id: str,
    *,
    reply_prefix: str,
    ttl_s: float = 300.0,
    claims: dict[str, Any] | None = None,
    now: float | None = None,
) -> str:
    """A token the job believes for ``tenant_id``: minted by tokenbus's own services
    (the bridge, the local stack's tools) with the secret only they hold."""
    issued = int(now if now is not None else time.time())
    payload = {
        **(claims or {}),
        "tenant": tenant_id,
        "reply_prefix": reply_prefix,
        "aud": SERVICE_AUDIENCE,
        "iat": issued,
        "exp": issued + int(ttl_s),
    }
    return jwt.encode(payload, secret, algorithm="HS256", headers={"kid": SERVICE_KID})


class Authenticator:
    """Credential -> Principal. Verified tokens are remembered until they expire, so a
    producer's repeated credential costs a dictionary look-up."""

    def __init__(
        self,
        directory: TenantDirectory,
        topics: Topics,
        *,
        audience: str,
        hs256_secret: str | None = None,
        rs256_public_key: str | None = None,
        service_secret: str | None = None,
        allow_unlisted_tenants: bool = False,
        leeway_s: float = 5.0,
        clock: Any = time.time,
    ) -> None:
        self._directory = directory
        self._topics = topics
        self._audience = audience
        self._keys: dict[str, Any] = {}
        if hs256_secret:
            self._keys["HS256"] = hs256_secret
        if rs256_public_key:
            self._keys["RS256"] = rs256_public_key
        self._service_secret = service_secret
        self._allow_unlisted = allow_unlisted_tenants
        self._leeway_s = leeway_s
        self._clock = clock
        self._cache: OrderedDict[str, tuple[Principal, float]] = OrderedDict()

    def authenticate(self, authorization: str | bytes | None) -> Principal:
        if isinstance(authorization, bytes):
            try:
                authorization = authorization.decode()
            except UnicodeDecodeError:
                raise AuthError("The credential is not UTF-8.") from None
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthError(
                "Missing credential: send 'Authorization: Bearer <key or token>'.",
                "missing_credential",
            )
        cached = self._cache.get(token)
        now = self._clock()
        if cached is not None and cached[1] > now:
            self._cache.move_to_end(token)
            return cached[0]
        principal, expires_at = self._verify(token)
        self._cache[token] = (principal, expires_at)
        if len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return principal

    def _verify(self, token: str) -> tuple[Principal, float]:
        credential_id = hashlib.sha256(token.encode()).hexdigest()
        if token.count(".") != 2 or not token.startswith("eyJ"):
            tenant = self._directory.by_api_key(token)
            if tenant is None:
                raise AuthError("Incorrect API key provided.", "invalid_api_key")
            prefix = tenant_reply_prefix(self._topics, tenant.tenant_id)
            # Re-read now and then, so a revoked key stops working.
            principal = Principal(tenant, credential_id, prefix, key_sha256=credential_id)
            return principal, self._clock() + 60.0
        if "=" in token:
            # RFC 7515's compact form has no padding. PyJWT accepts it after the signature,
            # so ``tok`` and ``tok=`` would be two credentials, with two balances.
            raise AuthError("Invalid token: its segments must be base64url without '=' padding.")
        claims, service = self._decode(token)
        tenant_id = claims["tenant"]
        if not isinstance(tenant_id, str) or not TENANT_ID.fullmatch(tenant_id):
            raise AuthError("Token claim tenant is not a valid tenant ID.")
        if tenant_id not in self._directory and not self._allow_unlisted:
            raise AuthError(f"Tenant {tenant_id!r} is not configured here.", "unknown_tenant")
        balance = cost_units(claims.get("quota_balance"))
        claimed_prefix = claims.get("reply_prefix")
        replies = self._topics.replies("")
        if claimed_prefix is None:
            reply_prefix = tenant_reply_prefix(self._topics, tenant_id)
        elif isinstance(claimed_prefix, str) and self._topics.is_reply_topic(claimed_prefix):
            reply_prefix = claimed_prefix
        else:
            raise AuthError(f"Token claim reply_prefix must name topics under {replies!r}.")
        flags = claims.get("flags", []) if service else []
        if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
            raise AuthError("Token claim flags must be a list of strings.")
        # A tenant JWT is its own credential; a service token names its caller's.
        key_sha256 = claims.get("key_sha256") if service else credential_id
        if key_sha256 is not None and not isinstance(key_sha256, str):
            raise AuthError("Token claim key_sha256 must be a string.")
        principal = Principal(
            tenant=narrow(self._directory.get(tenant_id), claims),
            credential_id=credential_id,
            reply_prefix=reply_prefix,
            quota_balance=balance,
            service=service,
            flags=tuple(flags),
            key_sha256=key_sha256,
        )
        return principal, float(claims["exp"])

    def _decode(self, token: str) -> tuple[dict[str, Any], bool]:
        try:
            header = jwt.get_unverified_header(token)
            algorithm = header.get("alg")
            service = header.get("kid") == SERVICE_KID
            key: Any
            audience: Any
            if service:
                key, audience = self._service_secret, SERVICE_AUDIENCE
                if algorithm != "HS256":
                    key = None
            else:
                key = self._keys.get(algorithm) if isinstance(algorithm, str) else None
                audience = self._audience
            if key is None or not isinstance(algorithm, str):
                raise AuthError("Token algorithm is not accepted here.")
            claims: dict[str, Any] = jwt.decode(
                token,
                key,
                algorithms=[algorithm],
                audience=audience,
                leeway=self._leeway_s,
                options={"require": ["exp", "aud", "tenant"]},
            )
        except AuthError:
            raise
        except jwt.ExpiredSignatureError:
            raise AuthError("Token has expired.", "token_expired") from None
        except jwt.ImmatureSignatureError:
            raise AuthError("Token is not valid yet (nbf).") from None
        except jwt.InvalidAudienceError:
            raise AuthError("Token audience is not this service.") from None
        except jwt.PyJWTError:
            raise AuthError("Invalid token.") from None
        return claims, service


class ServiceTokens:
    """Mints the service tokens a tokenbus service puts on what it produces for a tenant
    it authenticated, and reuses each until half its life is gone, so the job verifies
    it once (``Authenticator`` remembers verified tokens)."""

    def __init__(self, secret: str, *, ttl_s: float = 300.0, clock: Any = time.time) -> None:
        self._secret = secret
        self._ttl_s = ttl_s
        self._clock = clock
        self._tokens: dict[tuple[Any, ...], tuple[str, float]] = {}

    def token(
        self,
        tenant_id: str,
        reply_prefix: str,
        *,
        narrowed: TenantConfig | None = None,
        quota_balance: Decimal | None = None,
        flags: tuple[str, ...] = (),
        key_sha256: str | None = None,
    ) -> str:
        """A token for ``tenant_id``; ``narrowed``: its config as authenticated (a
        token's narrower class and models), carried as claims; ``key_sha256``: the API
        key the caller used, so the job charges that key's budgets."""
        key = (
            tenant_id,
            narrowed.priority_class if narrowed else None,
            tuple(narrowed.models) if narrowed else None,
            quota_balance,
            reply_prefix,
            flags,
            key_sha256,
        )
        now = self._clock()
        cached = self._tokens.get(key)
        if cached is not None and cached[1] > now:
            return cached[0]
        claims: dict[str, Any] = {}
        if narrowed is not None:
            claims["priority_class"] = narrowed.priority_class
            claims["model_access"] = list(narrowed.models)
        if quota_balance is not None:
            claims["quota_balance"] = str(quota_balance)  # exact, as text
        if flags:
            claims["flags"] = list(flags)
        if key_sha256 is not None:
            claims["key_sha256"] = key_sha256
        minted = mint_service_token(
            self._secret,
            tenant_id,
            reply_prefix=reply_prefix,
            ttl_s=self._ttl_s,
            claims=claims,
            now=now,
        )
        if len(self._tokens) > _CACHE_SIZE:
            self._tokens.clear()
        self._tokens[key] = (minted, now + self._ttl_s / 2)
        return minted
