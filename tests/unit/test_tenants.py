"""The tenants file's batch budget: ``batch_tpm``, else ``Settings.default_batch_tpm``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenbus.config import Settings
from tokenbus.tenants import TenantConfig, TenantConfigError, TenantDirectory

DEFAULT = TenantConfig(tenant_id="*")


def test_batch_tpm_is_read_from_the_file_and_unset_by_default(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.acme]\ntpm = 1000\nbatch_tpm = 50000\n\n[tenants.beta]\n")

    tenants = TenantDirectory.from_file(path, DEFAULT)

    assert (tenants.get("acme").tpm, tenants.get("acme").batch_tpm) == (1000, 50_000)
    assert tenants.get("beta").batch_tpm is None  # the job applies default_batch_tpm


def test_a_bad_batch_tpm_names_the_tenant(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.acme]\nbatch_tpm = 0\n")

    with pytest.raises(TenantConfigError, match=r"(?s)tenant .acme.*batch_tpm"):
        TenantDirectory.from_file(path, DEFAULT)


def test_the_default_batch_budget_is_a_setting(tmp_path: Path) -> None:
    assert Settings(home=tmp_path).default_batch_tpm == 1_000_000
    settings = Settings(home=tmp_path, default_batch_tpm=5000)
    assert settings.default_batch_tpm == 5000
    assert settings.tenant_directory().get("unlisted").batch_tpm is None
