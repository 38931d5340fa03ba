"""Benchmarks that print measured figures (ratios against a baseline measured in the same run)."""
