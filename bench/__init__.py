"""Benchmarks: what the gateway costs on top of its engine, beside baselines from the same run.

``python -m bench.run`` runs the standard set; see docs/performance.md.
"""
