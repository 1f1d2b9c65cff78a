"""Clients that produce requests and read their token streams back."""

from producers.client import RequestFailed, TokenbusClient, TokenbusTimeout

__all__ = ["RequestFailed", "TokenbusClient", "TokenbusTimeout"]
