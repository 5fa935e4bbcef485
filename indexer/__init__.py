"""DSA lightning indexer: index scores of queries against index keys and the exact top-k."""

from indexer.scores import index_scores
from indexer.select import merge_topk, select_topk

__all__ = ["index_scores", "merge_topk", "select_topk"]
