"""Tiny Flower app used to measure deployment round latency."""
