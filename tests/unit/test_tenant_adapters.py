"""Adapters in the tenants file: who may use which, addressed as ``base:adapter``."""

from pathlib import Path

import pytest

from tokenbus.tenants import TenantConfig, TenantConfigError, TenantDirectory, split_model

DEFAULT = TenantConfig(tenant_id="*")
FILE = """
[tenants.acme]
sharing_group = "docs"
models = ["tiny-llama"]
[tenants.acme.adapters.acme-support]
path = "/srv/adapters/acme-support"
base_model = "tiny-llama"
[tenants.acme.adapters.acme-shared]
path = "/srv/adapters/acme-shared"
base_model = "tiny-llama"
share_with_group = true

[tenants.initech]
sharing_group = "docs"

[tenants.globex]
"""


@pytest.fixture
def directory(tmp_path: Path) -> TenantDirectory:
    path = tmp_path / "tenants.toml"
    path.write_text(FILE)
    return TenantDirectory.from_file(path, DEFAULT)


def test_a_model_name_with_a_colon_names_an_adapter() -> None:
    assert split_model("tiny-llama:acme-support") == ("tiny-llama", "acme-support")
    assert split_model("tiny-llama") == ("tiny-llama", None)


def test_a_tenant_uses_its_own_adapters_on_their_base_model(directory: TenantDirectory) -> None:
    acme = directory.get("acme")

    assert acme.may_use("tiny-llama:acme-support")
    adapter = acme.adapter("tiny-llama:acme-support")
    assert adapter is not None
    assert (adapter.path, adapter.owner) == ("/srv/adapters/acme-support", "acme")
    assert not acme.may_use("other-model:acme-support")  # not the adapter's base
    assert not acme.may_use("tiny-llama:nobody-has-this")


def test_another_tenant_may_not_use_them_even_with_every_model(directory: TenantDirectory) -> None:
    globex = directory.get("globex")  # models = ["*"]

    assert globex.may_use("tiny-llama")
    assert not globex.may_use("tiny-llama:acme-support")
    assert not globex.may_use("tiny-llama:acme-shared")
    assert globex.adapter("tiny-llama:acme-support") is None
    assert not directory.get("unlisted").may_use("tiny-llama:acme-support")


def test_the_sharing_group_gets_only_what_is_shared(directory: TenantDirectory) -> None:
    initech = directory.get("initech")

    assert initech.may_use("tiny-llama:acme-shared")
    shared = initech.adapter("tiny-llama:acme-shared")
    assert shared is not None and shared.owner == "acme"
    assert not initech.may_use("tiny-llama:acme-support")


def test_overrides_keep_the_adapters(directory: TenantDirectory) -> None:
    again = directory.with_overrides({"initech": {"tpm": 5}})

    assert again.get("initech").may_use("tiny-llama:acme-shared")
    assert again.get("acme").may_use("tiny-llama:acme-support")


def test_an_adapter_name_is_unique_across_the_file(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(
        FILE + '[tenants.globex.adapters.acme-support]\npath = "/x"\nbase_model = "tiny-llama"\n'
    )
    with pytest.raises(TenantConfigError, match="'acme-support' is listed by tenants"):
        TenantDirectory.from_file(path, DEFAULT)


def test_a_narrowed_model_list_still_needs_the_adapter(directory: TenantDirectory) -> None:
    acme = directory.get("acme").model_copy(update={"models": ["tiny-llama:acme-support"]})

    assert acme.may_use("tiny-llama:acme-support")
    assert not acme.may_use("tiny-llama:acme-shared")
    assert not acme.may_use("tiny-llama")
