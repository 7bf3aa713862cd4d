"""Benchmarks behind `preload bench`: each measures on the machine it runs on, prints a
table and writes JSON (DESIGN.md, "Benchmarks")."""
