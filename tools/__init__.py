"""Maintenance scripts for the repository (not part of the installed package): fixture
and synthetic-checkpoint writers, the adapter copy, the checkpoint-reader fuzzer, the
GPU check, the golden decodes.

Every script runs as `python -m tools.NAME` from the repository root (`--help` lists its
options), and tests/test_scripts.py runs each one at tiny sizes.
"""
