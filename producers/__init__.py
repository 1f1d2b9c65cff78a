"""The client layer: produce requests, read their token streams back.

# schemas, tokenbus --> producers --> any program that produces requests (the bridge, the
#   batch runner, ``tokenbus ask``, tests, benchmarks)
"""

from producers.client import RequestFailed, SubmitOptions, TokenbusClient
from producers.reply_stream import ReplyStream, TokenbusTimeout

__all__ = ["ReplyStream", "RequestFailed", "SubmitOptions", "TokenbusClient", "TokenbusTimeout"]
