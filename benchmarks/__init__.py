"""Research studies run from a checkout (`python -m benchmarks.<study>`); not part of the p2ptrain wheel.

Nothing in `p2ptrain` or `launcher` may import from here. See benchmarks/README.md.
"""
