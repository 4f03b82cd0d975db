"""Benchmarks that measure what the paper measures (Section 4, App. E.1, E.3, E.5, F.3).

Only measurements live here; every script runs as `python -m benchmarks.NAME` from the
repository root (`--help` lists its options, each has a small mode for a check), and
tests/test_scripts.py runs each one at tiny sizes.
"""
