"""CoMERA-style tensor-compressed training in functional PyTorch.

Weights live as tensor-train (TT) / tensor-train-matrix (TTM) cores in plain dict pytrees
``(params, state)``, with trainable rank gates and an explicit rank-mask state. This package
exports the core a user needs; helpers stay in their submodules:

- ``comera.spec``: layer specs (TTLinearSpec, TTMEmbeddingSpec) and mode/rank proposals.
- ``comera.tensor_train``: init, from_dense / to_dense, gated cores, core chains.
- ``comera.pruning``: prune, compact, live ranks and each rank's share of the weight.
- ``comera.plans``: contraction strategies, the default plan, per-layer LayerPlans.
- ``comera.autotune``: ``plan="auto"``: the fastest plan per shape, timed once and cached.
- ``comera.layers``: the functional layers tt_linear and ttm_embedding.
- ``comera.table_batched``: many TTM tables looked up in one pass.
- ``comera.nn``: nn.Module adapters TTLinear and TTMEmbedding.
- ``comera.tensorize``: ``tensorize_``: any PyTorch / Hugging Face model's layers as TT / TTM.
- ``comera.accounting``: parameter counts, compression, FLOPs, per-layer summaries.
- ``comera.tree``: walking a model's params pytree, pruning/compacting every layer.
- ``comera.errors``: what bad input raises (UserError and its kinds).
- ``comera.train``: the shared trainer (config, stages, loop, checkpoints, ...).
- ``comera.bench``: forwards the old ``python -m comera.bench`` to ``benchmarks.core``.
"""

from importlib.metadata import PackageNotFoundError, version

from comera.accounting import compression_ratio, param_count, summarize, summary_table
from comera.layers import tt_linear, ttm_embedding
from comera.nn import TTLinear, TTMEmbedding
from comera.plans import (
    EMBEDDING_IMPLS,
    STRATEGIES,
    LayerPlans,
    default_plan,
    get_default_plan,
    set_default_plan,
)
from comera.pruning import PRUNE_RULES, compact, live_ranks, prune, rank_contributions
from comera.spec import TTLinearSpec, TTMEmbeddingSpec, propose_tt_linear, propose_ttm_embedding
from comera.table_batched import ttm_embedding_batched
from comera.tensor_train import from_dense, init, to_dense
from comera.tensorize import TensorizeConfig, tensorize_

try:
    __version__ = version("comera-framework")
except PackageNotFoundError:  # a source checkout that is not installed
    __version__ = "0.1.0"

__all__ = [
    "EMBEDDING_IMPLS",
    "PRUNE_RULES",
    "STRATEGIES",
    "LayerPlans",
    "TTLinear",
    "TTLinearSpec",
    "TTMEmbedding",
    "TTMEmbeddingSpec",
    "TensorizeConfig",
    "__version__",
    "compact",
    "compression_ratio",
    "default_plan",
    "from_dense",
    "get_default_plan",
    "init",
    "live_ranks",
    "param_count",
    "propose_tt_linear",
    "propose_ttm_embedding",
    "prune",
    "rank_contributions",
    "set_default_plan",
    "summarize",
    "summary_table",
    "tensorize_",
    "to_dense",
    "tt_linear",
    "ttm_embedding",
    "ttm_embedding_batched",
]
