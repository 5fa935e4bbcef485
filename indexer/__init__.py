"""DSA lightning indexer: index scores of queries against index keys and the exact top-k."""

from indexer.scores import ARITHS, index_scores
from indexer.select import merge_topk, select_topk, select_topk_exact

__all__ = ["ARITHS", "index_scores", "merge_topk", "select_topk", "select_topk_exact"]
