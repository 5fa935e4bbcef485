"""Benchmarks and helper scripts; each has a ``main()`` and prints a table, writing JSON."""
