"""DSA lightning indexer: index scores of queries against index keys and the exact top-k."""

from indexer.scores import index_scores
from indexer.select import select_topk

__all__ = ["index_scores", "select_topk"]
