from __future__ import annotations

from bridge.served_models import ServedModels
from schemas import WorkerStatus


def status(worker: str, model: str) -> WorkerStatus:
    return WorkerStatus(worker_id=worker, model=model, request_topic=f"t.{worker}")


def test_default_model_is_always_served_and_live_workers_add_theirs() -> None:
    served = ServedModels("tiny-llama", dead_after_s=3.0)
    assert served.names(now=0.0) == ["tiny-llama"]
    served.observe(status("w1", "big-llama"), now=10.0)
    assert served.names(now=12.0) == ["big-llama", "tiny-llama"]
    assert served.names(now=13.0) == ["tiny-llama"]  # w1 went quiet


def test_configured_served_and_default_models_exist_others_not() -> None:
    served = ServedModels("tiny-llama", dead_after_s=3.0, configured=["spare-model"])
    served.observe(status("w1", "big-llama"), now=0.0)
    names = ("tiny-llama", "spare-model", "big-llama", "gpt-4o")
    assert [served.knows(m, now=1.0) for m in names] == [True, True, True, False]
    assert not served.knows("big-llama", now=10.0)  # its worker went quiet
    assert served.knows("spare-model", now=10.0)  # configured: exists with no worker (503)
    assert served.names(now=1.0) == ["big-llama", "tiny-llama"]  # only what is served


def test_a_tenant_sees_the_adapters_it_may_use_on_served_models() -> None:
    from tokenbus.tenants import AdapterConfig, TenantConfig

    served = ServedModels("tiny-llama", dead_after_s=3.0)
    adapters = {
        "acme-support": AdapterConfig(path="/a", base_model="tiny-llama"),
        "acme-big": AdapterConfig(path="/b", base_model="big-llama"),
    }
    acme = TenantConfig(tenant_id="acme", adapters=adapters)
    other = TenantConfig(tenant_id="other")

    assert served.names_for(acme, now=0.0) == ["tiny-llama", "tiny-llama:acme-support"]
    assert served.names_for(other, now=0.0) == ["tiny-llama"]
    served.observe(status("w1", "big-llama"), now=0.0)
    assert "big-llama:acme-big" in served.names_for(acme, now=1.0)
    assert served.knows("tiny-llama:acme-support", now=1.0)
    assert not served.knows("gpt-4o:acme-support", now=1.0)
