from __future__ import annotations

from bridge.openapi import build_spec


def test_every_completion_operation_documents_every_error_status_and_id_headers() -> None:
    spec = build_spec()
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "403", "404", "408", "413", "429", "503"}
        for response in responses.values():
            assert {"X-Session-ID", "X-Request-ID"} <= set(response["headers"])
        assert "Retry-After" in responses["429"]["headers"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}


def test_metrics_are_documented_as_the_admin_key_s() -> None:
    operation = build_spec()["paths"]["/metrics"]["get"]
    assert operation["security"] == [{"bearer": []}]
    assert set(operation["responses"]) == {"200", "401", "404"}


def test_request_schemas_are_closed_and_refs_resolve() -> None:
    spec = build_spec("served-model")
    schemas = spec["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        assert schemas[name]["additionalProperties"] is False
        assert schemas[name]["properties"]["model"]["examples"] == ["served-model"]

    def refs(node: object) -> list[str]:
        if isinstance(node, dict):
            found = [node["$ref"]] if "$ref" in node else []
            return found + [r for value in node.values() for r in refs(value)]
        if isinstance(node, list):
            return [r for value in node for r in refs(value)]
        return []

    for ref in refs(spec):
        assert ref.removeprefix("#/components/schemas/") in schemas, ref
