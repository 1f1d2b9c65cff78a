"""Batch jobs: a JSONL of requests in, one result per line out, paced to idle capacity."""
