"""The ``tokenbus`` command and the local stack: the top floor.

# tokenbus_cli --> producers, billing, alerts, stream_jobs' topics --> tokenbus (the library)

Nothing below imports this package: the services (``stream_jobs``, ``workers``,
``billing``, ``bridge``, ``alerts``) and the client (``producers``) use only ``tokenbus``
and ``schemas``; the CLI and the supervisor that runs them all for development sit here,
above them.
"""
