"""Cross-axis ops of a folding model, and the dispatch of the plugin's own ShardTensors.

A serial model calls the plain-torch functions below (or Boltz's own ``torch.bmm`` /
``torch.einsum`` / ``s[:, :, None] + s[:, None, :]`` / ``torch.cdist`` expressions); on the
features of :func:`physicsnemo_foldcp.scatter_features` (:class:`FoldTensor` s) the same
calls compute on the co-sharded local blocks and return the serial result, sharded.
Communication, forward / backward (a collective over a mesh dim of size 1 is skipped):

* :func:`tokens_to_atoms`, :func:`atoms_to_tokens_mean`, :func:`representative_atoms`:
  output ``(Shard(1), Replicate())``; none / none.
* :func:`outer_sum`, :func:`pair_distances`, :func:`pair_mask`: the pair tile
  ``(Shard(1), Shard(2))``; one all-gather over ``cp0`` / one reduce-scatter over ``cp0``
  and one all-reduce over ``cp1``.
* :func:`relative_position_encoding`: the pair tile; one all-gather over ``cp0`` / -.
* :func:`pair_bias_attention`: ``q, k, v`` rows ``(Shard(1), Replicate())`` and the bias
  tile, output rows; one all-gather over ``cp0`` and two all-reduces over ``cp1`` / one
  reduce-scatter over ``cp0`` and one all-reduce over ``cp1``.
* :func:`masked_mean`: ``Replicate`` over the mesh dims that shard a reduced axis (never
  ``Partial``); one all-reduce per such mesh dim / none.
* every other torch function on a FoldTensor: the rule table
  (:mod:`~physicsnemo_foldcp.dispatch.rules`, printed by ``rules.table()``): local on the
  blocks where it can be, gathered (and reported) where it reads along a sharded axis.

Only FoldTensors (and calls that have one among their operands) take this path; a
ShardTensor made elsewhere keeps PhysicsNeMo's dispatch as it is. Every private upstream
name the package uses is in :mod:`~physicsnemo_foldcp.core.compat`.
"""

# The rule rows register at import: the generic ones (dispatch.rules), then each op module's
# own; map tags come first, so a map's own rules precede the views of a single.
from physicsnemo_foldcp.core.blocks import MapLayoutError, ShardingLayoutError
from physicsnemo_foldcp.core.events import GatherEvent, observe
from physicsnemo_foldcp.core.tags import MapTag, ViewTag
from physicsnemo_foldcp.core.tensor import FoldTensor, map_tag, tag_of, view_tag, wrap
from physicsnemo_foldcp.dispatch import rules
from physicsnemo_foldcp.ops import maps, msa_rows, single_pair  # noqa: F401
from physicsnemo_foldcp.ops.atom_token import (
    atoms_to_tokens_mean,
    representative_atoms,
    tokens_to_atoms,
)
from physicsnemo_foldcp.ops.attention import pair_bias_attention
from physicsnemo_foldcp.ops.maps import SUPPORTED_FORMS
from physicsnemo_foldcp.ops.masks import masked_mean, pair_mask
from physicsnemo_foldcp.ops.single_pair import (
    outer_sum,
    pair_distances,
    relative_position_encoding,
    relpos_width,
)
from physicsnemo_foldcp.sharding.map_tags import tag_maps

__all__ = [
    "SUPPORTED_FORMS",
    "FoldTensor",
    "GatherEvent",
    "MapLayoutError",
    "MapTag",
    "ShardingLayoutError",
    "ViewTag",
    "atoms_to_tokens_mean",
    "map_tag",
    "masked_mean",
    "observe",
    "outer_sum",
    "pair_bias_attention",
    "pair_distances",
    "pair_mask",
    "relative_position_encoding",
    "relpos_width",
    "representative_atoms",
    "rules",
    "tag_maps",
    "tag_of",
    "tokens_to_atoms",
    "view_tag",
    "wrap",
]
