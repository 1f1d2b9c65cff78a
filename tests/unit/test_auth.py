"""``tokenbus.auth``: one credential check for the bridge and the bus."""

from __future__ import annotations

import hashlib
import time
from decimal import Decimal
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tokenbus.auth import (
    SERVICE_AUDIENCE,
    SERVICE_KID,
    Authenticator,
    AuthError,
    Principal,
    ServiceTokens,
    mint_service_token,
    tenant_reply_prefix,
)
from tokenbus.tenants import TenantConfig, TenantDirectory, hash_api_key
from tokenbus.topics import Topics

TOPICS = Topics()
TENANT_SECRET = "unit-test-tenant-hs256-secret-0123456789"
SERVICE_SECRET = "unit-test-bus-service-secret-0123456789"
RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
RSA_PUBLIC = (
    RSA_KEY.public_key()
    .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    .decode()
)
ACME = TenantConfig(
    tenant_id="acme",
    priority_class=1,
    models=["tiny-llama", "big-llama"],
    api_key_sha256=[hash_api_key("sk-acme-key")],
)
BETA = TenantConfig(tenant_id="beta", api_key_sha256=[hash_api_key("sk-beta-key")])


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def authenticator(
    *,
    service_secret: str | None = SERVICE_SECRET,
    allow_unlisted_tenants: bool = False,
    clock: Any = time.time,
) -> Authenticator:
    return Authenticator(
        TenantDirectory({"acme": ACME, "beta": BETA}, TenantConfig(tenant_id="*")),
        TOPICS,
        audience="tokenbus",
        hs256_secret=TENANT_SECRET,
        rs256_public_key=RSA_PUBLIC,
        service_secret=service_secret,
        allow_unlisted_tenants=allow_unlisted_tenants,
        leeway_s=0,
        clock=clock,
    )


def tenant_token(
    claims: dict[str, Any],
    key: Any = TENANT_SECRET,
    alg: str = "HS256",
    headers: dict[str, Any] | None = None,
) -> str:
    now = int(time.time())
    payload = {"aud": "tokenbus", "exp": now + 60, **claims}
    return jwt.encode(payload, key, algorithm=alg, headers=headers)


def service_token(tenant: str = "acme", secret: str = SERVICE_SECRET, **claims: Any) -> str:
    prefix = tenant_reply_prefix(TOPICS, tenant)
    return mint_service_token(secret, tenant, reply_prefix=prefix, claims=claims)


def refused(credential: str | None, auth: Authenticator | None = None) -> AuthError:
    header = None if credential is None else f"Bearer {credential}"
    with pytest.raises(AuthError) as caught:
        (auth or authenticator()).authenticate(header)
    return caught.value


def test_an_api_key_owns_its_tenant_s_reply_topics() -> None:
    caller = authenticator().authenticate("Bearer sk-acme-key")
    assert caller.tenant_id == "acme"
    assert caller.reply_prefix == "tokenbus.replies.acme."
    assert caller.credential_id != "sk-acme-key"  # only a hash is kept
    assert not caller.service and caller.flags == ()


def test_the_header_may_come_as_bytes() -> None:
    assert authenticator().authenticate(b"Bearer sk-beta-key").tenant_id == "beta"


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer   ", "Token sk-acme-key"])
def test_a_missing_credential(header: str | None) -> None:
    with pytest.raises(AuthError) as caught:
        authenticator().authenticate(header)
    assert caught.value.code == "missing_credential"


def test_an_unknown_api_key() -> None:
    assert refused("sk-nope").code == "invalid_api_key"


def test_tenant_jwts_without_a_reply_prefix_claim_own_the_tenant_s_topics() -> None:
    hs = authenticator().authenticate(f"Bearer {tenant_token({'tenant': 'acme'})}")
    rs = authenticator().authenticate(
        f"Bearer {tenant_token({'tenant': 'acme'}, RSA_KEY, 'RS256')}"
    )
    for caller in (hs, rs):
        assert caller.tenant_id == "acme" and caller.reply_prefix == "tokenbus.replies.acme."
        assert not caller.service


def test_a_reply_prefix_claim_names_the_topics_the_token_owns() -> None:
    claims = {"tenant": "acme", "reply_prefix": "tokenbus.replies.bridge-1"}
    caller = authenticator().authenticate(f"Bearer {tenant_token(claims)}")
    assert caller.reply_prefix == "tokenbus.replies.bridge-1"
    # Without a trailing dot it names one topic: that one, and no other.
    assert caller.owns_reply_topic("tokenbus.replies.bridge-1")
    assert not caller.owns_reply_topic("tokenbus.replies.bridge-10")
    assert not caller.owns_reply_topic("tokenbus.replies.bridge-1.x")
    assert not caller.owns_reply_topic("tokenbus.replies.acme.c1")
    # With one, the topics below it.
    claims = {"tenant": "acme", "reply_prefix": "tokenbus.replies.team-x."}
    below = authenticator().authenticate(f"Bearer {tenant_token(claims)}")
    assert below.owns_reply_topic("tokenbus.replies.team-x.c1")
    assert not below.owns_reply_topic("tokenbus.replies.team-x.")


@pytest.mark.parametrize(
    "prefix", ["tokenbus.heartbeats", "tokenbus.replies.", "other.replies.acme.", "", 7]
)
def test_a_reply_prefix_outside_the_reply_topics_is_refused(prefix: object) -> None:
    error = refused(tenant_token({"tenant": "acme", "reply_prefix": prefix}))
    assert error.code == "invalid_credential" and "reply_prefix" in error.message


def test_claims_only_narrow_the_tenant() -> None:
    claims = {"tenant": "acme", "priority_class": 0, "model_access": ["big-llama", "gpt-9"]}
    caller = authenticator().authenticate(f"Bearer {tenant_token(claims)}")
    assert caller.tenant.priority_class == 1  # a token cannot buy a better class
    assert caller.tenant.models == ["big-llama"]  # nor a model the tenant lacks
    worse = authenticator().authenticate(
        f"Bearer {tenant_token({'tenant': 'acme', 'priority_class': 2})}"
    )
    assert worse.tenant.priority_class == 2


def test_a_service_token_is_verified_with_the_service_secret() -> None:
    caller = authenticator().authenticate(f"Bearer {service_token(flags=['injection_suspected'])}")
    assert caller.service and caller.tenant_id == "acme"
    assert caller.reply_prefix == "tokenbus.replies.acme."
    assert caller.flags == ("injection_suspected",)


def test_the_tenant_secret_cannot_forge_a_service_token() -> None:
    forged = service_token(secret=TENANT_SECRET, flags=["x"])
    assert refused(forged).code == "invalid_credential"
    # Nor can a tenant-signed token claim to be one by its header.
    kid_only = tenant_token({"tenant": "acme"}, headers={"kid": SERVICE_KID})
    assert refused(kid_only).code == "invalid_credential"


def test_a_service_token_is_refused_where_no_service_secret_is_configured() -> None:
    error = refused(service_token(), authenticator(service_secret=None))
    assert error.code == "invalid_credential"


def test_a_service_token_must_be_hs256() -> None:
    now = int(time.time())
    payload = {"tenant": "acme", "aud": SERVICE_AUDIENCE, "exp": now + 60}
    rs = jwt.encode(payload, RSA_KEY, algorithm="RS256", headers={"kid": SERVICE_KID})
    assert refused(rs).code == "invalid_credential"


def test_flags_are_believed_only_from_service_tokens() -> None:
    claims = {"tenant": "acme", "flags": ["trusted_caller"]}
    caller = authenticator().authenticate(f"Bearer {tenant_token(claims)}")
    assert caller.flags == () and not caller.service


def test_an_expired_token() -> None:
    expired = tenant_token({"tenant": "acme", "exp": int(time.time()) - 10})
    assert refused(expired).code == "token_expired"
    old_service = mint_service_token(
        SERVICE_SECRET, "acme", reply_prefix="tokenbus.replies.acme.", now=time.time() - 600
    )
    assert refused(old_service).code == "token_expired"


def test_a_forged_token() -> None:
    wrong_secret = tenant_token({"tenant": "acme"}, key="another-secret-0123456789abcdef-0123")
    assert refused(wrong_secret).code == "invalid_credential"
    other_rsa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    wrong_key = tenant_token({"tenant": "acme"}, other_rsa, "RS256")
    assert refused(wrong_key).code == "invalid_credential"


def test_an_unsigned_token() -> None:
    unsigned = tenant_token({"tenant": "acme"}, key="", alg="none")
    assert refused(unsigned).code == "invalid_credential"
    unsigned_service = jwt.encode(
        {"tenant": "acme", "aud": SERVICE_AUDIENCE, "exp": int(time.time()) + 60},
        "",
        algorithm="none",
        headers={"kid": SERVICE_KID},
    )
    assert refused(unsigned_service).code == "invalid_credential"


def test_a_token_for_another_audience() -> None:
    assert refused(tenant_token({"tenant": "acme", "aud": "elsewhere"})).code == (
        "invalid_credential"
    )


@pytest.mark.parametrize("tenant", ["a.b", "a/b", "", 5, "acme\n"])
def test_a_malformed_tenant_claim(tenant: object) -> None:
    assert refused(tenant_token({"tenant": tenant})).code == "invalid_credential"


def test_an_unlisted_tenant_is_refused_unless_allowed() -> None:
    assert refused(tenant_token({"tenant": "newco"})).code == "unknown_tenant"
    assert refused(service_token("newco")).code == "unknown_tenant"
    allowed = authenticator(allow_unlisted_tenants=True)
    caller = allowed.authenticate(f"Bearer {tenant_token({'tenant': 'newco'})}")
    assert caller.tenant_id == "newco" and caller.reply_prefix == "tokenbus.replies.newco."


def test_a_principal_owns_only_its_own_reply_topics() -> None:
    caller = authenticator().authenticate("Bearer sk-acme-key")
    assert caller.owns_reply_topic("tokenbus.replies.acme.c1")
    assert caller.owns_reply_topic("tokenbus.replies.acme.c1.more")
    assert not caller.owns_reply_topic("tokenbus.replies.beta.c1")
    assert not caller.owns_reply_topic("tokenbus.replies.acme.")  # the bare prefix
    assert not caller.owns_reply_topic("tokenbus.replies.acme")
    assert not caller.owns_reply_topic("tokenbus.replies.")
    assert not caller.owns_reply_topic(TOPICS.heartbeats)
    assert not caller.owns_reply_topic(TOPICS.usage)


def test_a_tenant_cannot_own_a_tenant_whose_id_extends_its_own() -> None:
    # No dots in tenant ids, and the prefix ends with one: "acme." never covers "acme-2".
    caller = Principal(ACME, "id", tenant_reply_prefix(TOPICS, "acme"))
    assert not caller.owns_reply_topic("tokenbus.replies.acme-2.c1")


def test_the_cache_returns_the_same_principal_until_the_token_expires() -> None:
    clock = Clock(time.time())
    auth = authenticator(clock=clock)
    token = tenant_token({"tenant": "acme", "exp": int(clock.now) + 30})
    first = auth.authenticate(f"Bearer {token}")
    clock.now += 29
    assert auth.authenticate(f"Bearer {token}") is first
    clock.now += 2  # past exp: verified again, not served from the cache
    assert auth.authenticate(f"Bearer {token}") is not first


def test_an_api_key_is_looked_up_again_after_a_minute() -> None:
    clock = Clock(1_000.0)
    auth = authenticator(clock=clock)
    first = auth.authenticate("Bearer sk-acme-key")
    clock.now += 59
    assert auth.authenticate("Bearer sk-acme-key") is first
    clock.now += 2
    assert auth.authenticate("Bearer sk-acme-key") is not first


def test_service_tokens_are_reused_for_half_their_life() -> None:
    clock = Clock(time.time() - 200)  # the last token minted is still not from the future
    tokens = ServiceTokens(SERVICE_SECRET, ttl_s=300, clock=clock)
    prefix = tenant_reply_prefix(TOPICS, "acme")
    first = tokens.token("acme", prefix)
    clock.now += 149
    assert tokens.token("acme", prefix) == first
    assert tokens.token("beta", tenant_reply_prefix(TOPICS, "beta")) != first
    assert tokens.token("acme", prefix, flags=("injection_suspected",)) != first
    clock.now += 2
    fresh = tokens.token("acme", prefix)
    assert fresh != first
    caller = authenticator().authenticate(f"Bearer {fresh}")
    assert caller.service and caller.tenant_id == "acme"


def test_service_tokens_carry_the_narrowed_config() -> None:
    narrowed = ACME.model_copy(update={"priority_class": 2, "models": ["tiny-llama"]})
    token = ServiceTokens(SERVICE_SECRET).token(
        "acme", "tokenbus.replies.bridge-1", narrowed=narrowed, quota_balance=Decimal(50)
    )
    caller = authenticator().authenticate(f"Bearer {token}")
    assert caller.tenant.priority_class == 2 and caller.tenant.models == ["tiny-llama"]
    assert caller.quota_balance == 50 and caller.reply_prefix == "tokenbus.replies.bridge-1"


def test_the_key_behind_a_credential_is_known_for_key_budgets() -> None:
    from tokenbus.auth import Authenticator, ServiceTokens
    from tokenbus.tenants import TenantConfig, TenantDirectory, hash_api_key
    from tokenbus.topics import Topics

    directory = TenantDirectory(
        {"a": TenantConfig(tenant_id="a", api_key_sha256=[hash_api_key("sk-a-123")])},
        TenantConfig(tenant_id="*"),
    )
    secret = "service-secret-0123456789abcdef0123"
    auth = Authenticator(directory, Topics(), audience="tokenbus", service_secret=secret)
    by_key = auth.authenticate("Bearer sk-a-123")
    assert by_key.key_sha256 == hash_api_key("sk-a-123") == by_key.credential_id
    token = ServiceTokens(secret).token(
        "a", "tokenbus.replies.bridge-1", key_sha256=by_key.key_sha256
    )
    assert auth.authenticate(f"Bearer {token}").key_sha256 == by_key.key_sha256


def test_a_quota_balance_is_cost_units_and_the_token_is_its_own_key() -> None:
    token = tenant_token({"tenant": "acme", "quota_balance": "2.5"})
    caller = authenticator().authenticate(f"Bearer {token}")
    assert caller.quota_balance == Decimal("2.5")
    # A tenant JWT is the credential its balance is charged to, by its SHA-256.
    assert caller.key_sha256 == hashlib.sha256(token.encode()).hexdigest()
    assert authenticator().authenticate(
        f"Bearer {tenant_token({'tenant': 'acme', 'quota_balance': 3})}"
    ).quota_balance == Decimal(3)
    # The bridge carries it exactly, with the caller's hash, to the job.
    relayed = ServiceTokens(SERVICE_SECRET).token(
        "acme",
        "tokenbus.replies.bridge-1",
        quota_balance=Decimal("0.000000001"),
        key_sha256=caller.key_sha256,
    )
    on_bus = authenticator().authenticate(f"Bearer {relayed}")
    assert (on_bus.quota_balance, on_bus.key_sha256) == (Decimal("1E-9"), caller.key_sha256)


@pytest.mark.parametrize(("key", "alg"), [(TENANT_SECRET, "HS256"), (RSA_KEY, "RS256")])
def test_a_padded_token_is_not_a_second_credential(key: Any, alg: str) -> None:
    # PyJWT decodes a signature with base64 padding after it: as another credential id,
    # the same token would have a second balance.
    token = tenant_token({"tenant": "acme", "quota_balance": "0.5"}, key, alg)
    authenticator().authenticate(f"Bearer {token}")
    signature = token.rsplit(".", 1)[1]
    padded = token + "=" * (-len(signature) % 4)
    assert padded != token
    assert "padding" in refused(padded).message
    assert refused(token + "=").code == "invalid_credential"


@pytest.mark.parametrize("balance", [-1, "0.0000000001", "lots", True, [1], "NaN", "1e40"])
def test_a_quota_balance_that_is_not_exact_cost_units_is_refused(balance: object) -> None:
    error = refused(tenant_token({"tenant": "acme", "quota_balance": balance}))
    assert "quota_balance" in error.message
