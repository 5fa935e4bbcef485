"""corpusd: serve one pinned MLA/DSA corpus cache to many sub-agents."""

__version__ = "0.1.0"
