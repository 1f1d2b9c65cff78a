"""The same real stack as the integration tests."""

from tests.integration.conftest import client, model_dir, settings, stack, webhook

__all__ = ["client", "model_dir", "settings", "stack", "webhook"]
