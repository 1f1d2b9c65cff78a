"""Tenant configuration: limits, priority class, weight and model access, from one file.

The file is YAML-free JSON or TOML (by extension), validated at start with an error that
names the tenant and the field. JWT claims (in the bridge) can only narrow these values.

    [tenants.acme]
    rpm = 600
    tpm = 120000
    batch_tpm = 600000                     # batch lines' own budget (unset: default_batch_tpm)
    burst_s = 10                           # at most tpm/6 tokens in any 10 s (0: off)
    priority_class = 1
    weight = 2.0
    max_prompt_tokens = 8192
    max_output_tokens = 1024
    models = ["tiny-llama"]

    [tenants.acme.adapters.acme-support]     # addressed as "tiny-llama:acme-support"
    path = "/srv/adapters/acme-support"      # a folder, or what vLLM's LoRA loader takes
    base_model = "tiny-llama"
    share_with_group = false                 # true: every tenant of acme's sharing_group

A model name with a ``:`` is ``base:adapter``. Adapter names are unique across the file,
so a name means one adapter; a tenant may use its own adapters and those its sharing
group's members share, and no other (``model_not_allowed``, whether or not it exists).
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


ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9_.\-]{1,128}$"


class AdapterConfig(BaseModel):
    """A LoRA adapter a tenant owns, on one base model. Only the tenants file names its
    path: requests address it by name, never by where it lives."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Annotated[str, Field(min_length=1)]
    """A local folder in PEFT format, or anything vLLM's LoRA loader resolves."""
    base_model: Annotated[str, Field(min_length=1)]
    share_with_group: bool = False
    """Every tenant of the owner's ``sharing_group`` may use it too."""
    owner: str = ""
    """The tenant whose file entry lists it; filled in when the file is read."""


def lora_int_id(name: str, path: str) -> int:
    """A stable id in 1..2**31-1 for one (name, path): every job instance gives the same,
    and a changed path is a new adapter to the engines (their caches key on the id)."""
    digest = hashlib.sha256(f"{name}\0{path}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % (2**31 - 1) + 1


def split_model(model: str) -> tuple[str, str | None]:
    """``"tiny-llama:acme-support"`` --> ``("tiny-llama", "acme-support")``; a name
    without ``:`` is a base model."""
    base, colon, adapter = model.partition(":")
    return (base, adapter) if colon else (model, None)


class TenantConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant_id: Annotated[str, Field(pattern=TENANT_ID_PATTERN)] | Literal["*"]
    rpm: Annotated[int, Field(ge=1)] = 600
    tpm: Annotated[int, Field(ge=1)] = 1_000_000
    batch_tpm: Annotated[int, Field(ge=1)] | None = None
    """Tokens per minute for the tenant's batch lines (requests with a ``batch_id``): a
    window of their own, apart from ``tpm`` (and not held by ``rpm``), so a batch never
    takes the tenant's interactive minute, nor another tenant's batch budget. Unset:
    ``Settings.default_batch_tpm``."""
    burst_s: Annotated[float, Field(ge=0, le=60)] = 0.0
    """Smooths spending: at most ``tpm * burst_s / 60`` tokens in any ``burst_s`` seconds
    (so 10 means a sixth of the minute's tokens in any 10 s). 0 is off: the whole
    minute's tokens may be spent in its first second."""
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

    adapters: dict[Annotated[str, Field(pattern=ADAPTER_NAME_PATTERN)], AdapterConfig] = Field(
        default_factory=dict
    )
    """LoRA adapters this tenant may use, by name: its own, and (once the file is read)
    those its sharing group's members share."""

    def may_use(self, model: str) -> bool:
        """A base model in ``models``, or ``base:adapter`` with an adapter of its own on
        that base (or one its group shares) and the base model, or that exact name, in
        ``models``."""
        base, adapter = split_model(model)
        if adapter is not None and self.adapter(model) is None:
            return False
        return "*" in self.models or model in self.models or base in self.models

    def adapter(self, model: str) -> AdapterConfig | None:
        """The adapter ``base:adapter`` names, if this tenant may use it on that base."""
        base, name = split_model(model)
        found = self.adapters.get(name) if name is not None else None
        return found if found is not None and found.base_model == base else None


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
        self._tenants = _with_shared_adapters(tenants)
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


def _with_shared_adapters(tenants: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
    """Each tenant with its owner-stamped adapters and those its group shares with it."""
    owners: dict[str, str] = {}
    own: dict[str, dict[str, AdapterConfig]] = {}
    for tenant_id, config in tenants.items():
        own[tenant_id] = {}
        for name, adapter in config.adapters.items():
            if adapter.owner and adapter.owner != tenant_id:
                continue  # shared with it by another member (a directory built again)
            if name in owners and owners[name] != tenant_id:
                raise TenantConfigError(
                    f"adapter {name!r} is listed by tenants {owners[name]!r} and "
                    f"{tenant_id!r}; adapter names are unique across the tenants file"
                )
            owners[name] = tenant_id
            own[tenant_id][name] = adapter.model_copy(update={"owner": tenant_id})
    result: dict[str, TenantConfig] = {}
    for tenant_id, config in tenants.items():
        usable = dict(own[tenant_id])
        group = config.sharing_group
        for other_id, adapters in own.items():
            if group is None or other_id == tenant_id:
                continue
            if tenants[other_id].sharing_group != group:
                continue
            usable.update({n: a for n, a in adapters.items() if a.share_with_group})
        result[tenant_id] = config.model_copy(update={"adapters": usable})
    return result
