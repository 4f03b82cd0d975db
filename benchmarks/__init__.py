"""Benchmarks that measure what the paper measures (Section 4, App. E.1, E.3, E.5, F.3)."""
