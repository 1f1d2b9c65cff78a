"""What a batch is on the shared store and the commands topic, shared by the bridge's
Files and Batches endpoints, ``tokenbus batch`` and the batch runner (``batches/``).

# input file --> lines (parse and check) --> submit --> store (files, status documents)
#   + commands (``<prefix>.batches``) --> the runner
"""
