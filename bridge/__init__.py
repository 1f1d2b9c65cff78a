"""The SSE bridge: an OpenAI-compatible HTTP API in front of the bus.

# HTTP request --> auth (API key or JWT) --> throttle --> body --> admission plan
# plan --> InferenceRequest on requests.p{class} (one reply topic per bridge instance)
# TokenChunks on that reply topic --> OpenAI JSON, or SSE events with heartbeats
# client disconnect --> CancelRequest on the cancels topic

``python -m bridge`` serves it with uvicorn on ``bridge_host:bridge_port``.
"""

from bridge.app import create_app

__all__ = ["create_app"]
