"""Tenant configuration: limits, priority class, weight and model access, from one file.

The file is YAML-free JSON or TOML (by extension), validated at start with an error that
names the tenant and the field. JWT claims (in the bridge) can only narrow these values.

    [tenants.acme]
    rpm = 600
    tpm = 120000
    priority_class = 1
    weight = 2.0
    max_prompt_tokens = 8192
    max_output_tokens = 1024
    models = ["tiny-llama"]
"""

from __future__ import annotations

import hashlib
import hmac
import json
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas import TENANT_ID_PATTERN
from tokenbus.budget_config import BudgetConfig


class TenantConfigError(ValueError):
    """The tenants file is missing, unreadable or invalid; the message says where."""


class TenantConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant_id: Annotated[str, Field(pattern=TENANT_ID_PATTERN)] | Literal["*"]
    rpm: Annotated[int, Field(ge=1)] = 600
    tpm: Annotated[int, Field(ge=1)] = 1_000_000
    priority_class: Annotated[int, Field(ge=0, le=2)] = 1
    weight: Annotated[float, Field(gt=0)] = 1.0
    max_prompt_tokens: Annotated[int, Field(ge=1)] = 16_384
    max_output_tokens: Annotated[int, Field(ge=1)] = 4_096
    models: list[str] = Field(default_factory=lambda: ["*"])
    """Model names this tenant may use; ``"*"`` allows every model."""
    api_key_sha256: list[str] = Field(default_factory=list)
    """Hex SHA-256 of each API key; keys themselves are never stored."""
    sharing_group: str | None = None
    """Tenants in one group may share prefix-cache entries; others never do."""
    injection_policy: Literal["flag", "block"] = "flag"
    """What the bridge does when its screen flags a prompt: flag it, or refuse it."""
    rewrite_prompts: bool = False
    """The bridge NFKC-normalizes this tenant's prompts and strips control and format
    characters before the model sees them. Off: the model gets the text as sent."""
    budgets: list[BudgetConfig] = Field(default_factory=list)
    """Spend caps on the tenant, one of its keys (``key_sha256``) or the tenant x a
    ``model`` (see tokenbus.budget_config); their ``tenant`` is this tenant."""

    def may_use(self, model: str) -> bool:
        return "*" in self.models or model in self.models


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class TenantDirectory:
    """All tenants; a tenant not in the file gets ``default`` with its own id."""

    def __init__(
        self,
        tenants: dict[str, TenantConfig],
        default: TenantConfig,
        budgets: list[BudgetConfig] | None = None,
    ) -> None:
        self._tenants = tenants
        self._default = default
        self._budgets = budgets or []

    @classmethod
    def from_file(cls, path: Path, default: TenantConfig) -> TenantDirectory:
        try:
            text = path.read_text()
        except OSError as exc:
            raise TenantConfigError(f"cannot read tenants file {path}: {exc}") from None
        try:
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
            raise TenantConfigError(f"{path} is not valid {path.suffix[1:]}: {exc}") from None
        entries = data.get("tenants", {}) if isinstance(data, dict) else None
        if not isinstance(entries, dict):
            raise TenantConfigError(f"{path}: expected a 'tenants' table of tenant -> settings")
        tenants: dict[str, TenantConfig] = {}
        for tenant_id, fields in entries.items():
            try:
                tenants[tenant_id] = TenantConfig.model_validate({**fields, "tenant_id": tenant_id})
            except (ValidationError, TypeError) as exc:
                raise TenantConfigError(f"{path}: tenant {tenant_id!r}: {exc}") from None
        budgets: list[BudgetConfig] = []
        for n, fields in enumerate(data.get("budgets", []), start=1):
            try:
                budget = BudgetConfig.model_validate(fields)
                if budget.scope != "model":
                    raise ValueError("a top-level budget names a model; others sit in a tenant")
            except (ValidationError, TypeError, ValueError) as exc:
                raise TenantConfigError(f"{path}: [[budgets]] #{n}: {exc}") from None
            budgets.append(budget)
        return cls(tenants, default, budgets)

    def with_overrides(self, overrides: dict[str, dict[str, object]]) -> TenantDirectory:
        tenants = dict(self._tenants)
        for tenant_id, fields in overrides.items():
            tenants[tenant_id] = self.get(tenant_id).model_copy(update=fields)
        return TenantDirectory(tenants, self._default, self._budgets)

    def get(self, tenant_id: str) -> TenantConfig:
        config = self._tenants.get(tenant_id)
        if config is None:
            return self._default.model_copy(update={"tenant_id": tenant_id})
        return config

    def __contains__(self, tenant_id: object) -> bool:
        """Whether the tenants file lists this tenant."""
        return tenant_id in self._tenants

    def by_api_key(self, key: str) -> TenantConfig | None:
        """The tenant owning ``key``, compared by hash in constant time."""
        digest = hash_api_key(key)
        found: TenantConfig | None = None
        for config in self._tenants.values():
            for stored in config.api_key_sha256:
                if hmac.compare_digest(stored, digest):
                    found = config
        return found

    def budget_configs(self) -> list[BudgetConfig]:
        """Every budget of the file: the tenants' (with their tenant) and the models'."""
        found = list(self._budgets)
        for config in self._tenants.values():
            found += [b.model_copy(update={"tenant": config.tenant_id}) for b in config.budgets]
        return found

    def __iter__(self) -> Iterator[TenantConfig]:
        return iter(self._tenants.values())
