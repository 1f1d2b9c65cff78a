"""The ``tokenbus`` command and the local stack: the top floor.

# tokenbus_cli --> producers (the client), billing, bridge's planner, the batch step
#   --> tokenbus (the library) --> schemas

Nothing below imports this package: the services (``stream_jobs``, ``workers``,
``billing`` with its alerts service, ``bridge``, ``batches``) use only the client
(``producers``), ``tokenbus`` and ``schemas``; the CLI and the supervisor that runs them
all for development sit here, above them.
"""
