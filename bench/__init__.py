"""Benchmarks of gelastic against torchrun: cold start, recovery and failure reporting.

`python -m bench` runs them; see bench/README.md for what each number measures.
"""
