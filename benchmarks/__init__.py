"""Benchmarks, one subpackage per question; each module names its command in its docstring."""
