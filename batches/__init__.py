"""Batch jobs: a file of lines in, every line's result out, exactly once (issue 18).

The bridge's ``/v1/files`` and ``/v1/batches`` and ``tokenbus batch`` check a file and
record the batch in the store (``tokenbus.batch.store``); the runner (``python -m batches``)
produces its lines as class 2 requests and folds their replies into the output files.
"""
