"""Benchmarks: pure functions that measure and return a dict; `flexmarl bench ...` writes them as JSON."""
