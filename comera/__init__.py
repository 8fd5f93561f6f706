"""CoMERA-style tensor-compressed training in functional PyTorch.

Weights live as tensor-train (TT) / tensor-train-matrix (TTM) cores in plain dict
pytrees, with trainable rank gates and an explicit rank-mask state. See README.md.
"""

from comera.accounting import (
    LayerSummary,
    compression_ratio,
    dense_param_count,
    live_param_count,
    param_bytes,
    param_count,
    summarize,
    summary_table,
    tt_linear_flops,
    ttm_embedding_flops,
)
from comera.layers import EMBEDDING_IMPLS, tt_linear, tt_linear_shared_input, ttm_embedding
from comera.nn import TTLinear, TTMEmbedding
from comera.plans import (
    STRATEGIES,
    ContractionPlan,
    LayerPlans,
    default_plan,
    get_default_plan,
    set_default_plan,
    tt_linear_plan,
)
from comera.pruning import rank_contributions
from comera.spec import (
    TTLinearSpec,
    TTMEmbeddingSpec,
    cap_ranks,
    factorize,
    propose_modes,
    propose_tt_linear,
    propose_ttm_embedding,
)
from comera.table_batched import table_groups, ttm_embedding_batched
from comera.tensor_train import (
    PRUNE_RULES,
    bond_ranks,
    compact,
    from_dense,
    gated_cores,
    init,
    is_tt_params,
    kept_indices,
    live_ranks,
    prune,
    to_dense,
    ttm_table,
)

__all__ = [
    "EMBEDDING_IMPLS",
    "PRUNE_RULES",
    "STRATEGIES",
    "ContractionPlan",
    "LayerPlans",
    "LayerSummary",
    "TTLinear",
    "TTLinearSpec",
    "TTMEmbedding",
    "TTMEmbeddingSpec",
    "bond_ranks",
    "cap_ranks",
    "compact",
    "compression_ratio",
    "default_plan",
    "dense_param_count",
    "factorize",
    "from_dense",
    "gated_cores",
    "get_default_plan",
    "init",
    "is_tt_params",
    "kept_indices",
    "live_param_count",
    "live_ranks",
    "param_bytes",
    "param_count",
    "propose_modes",
    "propose_tt_linear",
    "propose_ttm_embedding",
    "prune",
    "rank_contributions",
    "set_default_plan",
    "summarize",
    "summary_table",
    "table_groups",
    "to_dense",
    "ttm_table",
    "tt_linear",
    "tt_linear_shared_input",
    "tt_linear_flops",
    "tt_linear_plan",
    "ttm_embedding",
    "ttm_embedding_batched",
    "ttm_embedding_flops",
]
