"""The Faust job: admission, priority and worker choice between clients and workers."""
