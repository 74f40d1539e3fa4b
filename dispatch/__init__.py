"""Topology -> logical DP -> balanced, padded, mini/micro-batched per-rank shares."""
