"""Benchmarks: tokenbus against direct vLLM, stage throughput, growth, the load table.

Scripts, not tests: each prints a table and writes JSON under ``bench/results/``.
BENCHMARKS.md at the repository root keeps the figures and the commands.
"""
