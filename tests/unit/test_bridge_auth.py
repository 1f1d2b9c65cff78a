from __future__ import annotations

import base64
import hashlib
import hmac
import time
from typing import Any

import jwt
import orjson
import pytest

from bridge.auth import Authenticator, narrow
from bridge.errors import ApiError
from tests.unit.test_auth import ACME, RSA_KEY, RSA_PUBLIC
from tokenbus.tenants import TenantConfig, TenantDirectory

SECRET = "unit-test-hs256-secret-0123456789abcdef"


def authenticator(*, allow_unlisted_tenants: bool = False) -> Authenticator:
    directory = TenantDirectory({"acme": ACME}, TenantConfig(tenant_id="*"))
    return Authenticator(
        directory,
        audience="tokenbus",
        hs256_secret=SECRET,
        rs256_public_key=RSA_PUBLIC,
        allow_unlisted_tenants=allow_unlisted_tenants,
    )


def token(claims: dict[str, Any], key: Any = SECRET, alg: str = "HS256") -> str:
    now = int(time.time())
    return jwt.encode({"aud": "tokenbus", "exp": now + 60, **claims}, key, algorithm=alg)


def test_api_key_resolves_its_tenant() -> None:
    caller = authenticator().authenticate("Bearer sk-acme-key")
    assert caller.tenant.tenant_id == "acme"
    assert caller.quota_balance is None
    assert caller.credential_id != "sk-acme-key"  # only a hash is kept


@pytest.mark.parametrize("header", [None, "", "Bearer", "Token sk-acme-key", "Bearer sk-nope"])
def test_missing_or_unknown_keys_are_401(header: str | None) -> None:
    with pytest.raises(ApiError) as caught:
        authenticator().authenticate(header)
    assert caught.value.status == 401


def test_hs256_and_rs256_tokens_with_claims() -> None:
    hs = authenticator().authenticate(f"Bearer {token({'tenant': 'acme', 'quota_balance': 99})}")
    assert hs.tenant.tenant_id == "acme" and hs.quota_balance == 99
    rs = authenticator().authenticate(f"Bearer {token({'tenant': 'acme'}, RSA_KEY, 'RS256')}")
    assert rs.tenant.tenant_id == "acme"


def test_a_tenant_not_in_the_file_is_refused_unless_unlisted_tenants_are_allowed() -> None:
    with pytest.raises(ApiError) as refused:
        authenticator().authenticate(f"Bearer {token({'tenant': 'newco'})}")
    assert refused.value.status == 401
    assert "not configured" in refused.value.message
    allowed = authenticator(allow_unlisted_tenants=True)
    caller = allowed.authenticate(f"Bearer {token({'tenant': 'newco'})}")
    assert caller.tenant.tenant_id == "newco"


@pytest.mark.parametrize(
    ("claims", "key", "alg"),
    [
        ({"tenant": "acme", "exp": int(time.time()) - 3600}, SECRET, "HS256"),
        ({"tenant": "acme", "nbf": int(time.time()) + 3600}, SECRET, "HS256"),
        ({"tenant": "acme", "aud": "elsewhere"}, SECRET, "HS256"),
        ({"tenant": "acme"}, "another-secret-of-enough-length-012345", "HS256"),
        ({"aud": "tokenbus"}, SECRET, "HS256"),  # no tenant claim
        ({"tenant": "a b/c"}, SECRET, "HS256"),
        ({"tenant": "acme", "priority_class": 7}, SECRET, "HS256"),
        ({"tenant": "acme", "model_access": "tiny-llama"}, SECRET, "HS256"),
        ({"tenant": "acme", "quota_balance": "lots"}, SECRET, "HS256"),
    ],
)
def test_bad_tokens_are_401(claims: dict[str, Any], key: Any, alg: str) -> None:
    with pytest.raises(ApiError) as caught:
        authenticator().authenticate(f"Bearer {token(claims, key, alg)}")
    assert caught.value.status == 401


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def test_alg_none_and_key_confusion_are_refused() -> None:
    unsigned = jwt.encode({"tenant": "acme", "aud": "tokenbus", "exp": 2**31}, "", "none")
    # The classic confusion: HS256 "signed" with the RSA public key as the HMAC secret.
    header = _b64(orjson.dumps({"alg": "HS256", "typ": "JWT"}))
    body = _b64(orjson.dumps({"tenant": "acme", "aud": "tokenbus", "exp": 2**31}))
    mac = hmac.new(RSA_PUBLIC.encode(), f"{header}.{body}".encode(), hashlib.sha256)
    forged = f"{header}.{body}.{_b64(mac.digest())}"
    for bad in (unsigned, forged):
        with pytest.raises(ApiError) as caught:
            authenticator().authenticate(f"Bearer {bad}")
        assert caught.value.status == 401


def test_token_without_configured_keys_is_refused() -> None:
    plain = Authenticator(TenantDirectory({}, TenantConfig(tenant_id="*")), audience="tokenbus")
    with pytest.raises(ApiError):
        plain.authenticate(f"Bearer {token({'tenant': 'acme'})}")


def test_claims_only_narrow() -> None:
    assert narrow(ACME, {"priority_class": 0}).priority_class == 1  # no better class
    assert narrow(ACME, {"priority_class": 2}).priority_class == 2
    assert narrow(ACME, {"model_access": ["tiny-llama", "secret-model"]}).models == ["tiny-llama"]
    assert narrow(ACME, {"model_access": ["*"]}).models == ACME.models
    everything = ACME.model_copy(update={"models": ["*"]})
    assert narrow(everything, {"model_access": ["a"]}).models == ["a"]
    assert narrow(ACME, {}) is ACME
