"""Benchmarks: they print figures and the machine they ran on; they assert nothing about time."""
