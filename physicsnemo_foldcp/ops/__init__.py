"""Cross-axis ops of a folding model, with ShardTensor handlers registered at import.

A serial model calls the plain-torch functions below (or Boltz's own ``torch.bmm`` /
``torch.einsum`` / ``s[:, :, None] + s[:, None, :]`` / ``torch.cdist`` expressions); on
ShardTensors from :func:`physicsnemo_foldcp.scatter_features` the same calls compute on the
co-sharded local blocks and return the serial result, sharded. Communication, forward /
backward (a collective over a mesh dim of size 1 is skipped):

* :func:`tokens_to_atoms`, :func:`atoms_to_tokens_mean`, :func:`representative_atoms`:
  output ``(Shard(1), Replicate())``; none / none.
* :func:`outer_sum`, :func:`pair_distances`, :func:`pair_mask`: the pair tile
  ``(Shard(1), Shard(2))``; one all-gather over ``cp0`` / one reduce-scatter over ``cp0``
  and one all-reduce over ``cp1``.
* :func:`relative_position_encoding`: the pair tile; one all-gather over ``cp0`` / -.
* dtype casts (``x.float()``, ``x.to(dtype)``, ...) of any ShardTensor: same blocks; none.
* :func:`pair_bias_attention`: ``q, k, v`` rows ``(Shard(1), Replicate())`` and the bias
  tile, output rows; one all-gather over ``cp0`` and two all-reduces over ``cp1`` / one
  reduce-scatter over ``cp0`` and one all-reduce over ``cp1``.
* any other op through PhysicsNeMo's DTensor fallback: results that keep the sharded
  lengths of an operand keep its uneven blocks (:mod:`~physicsnemo_foldcp.ops.uneven_fallback`).
* :func:`masked_mean`: ``Replicate`` over the mesh dims that shard a reduced axis (never
  ``Partial``); one all-reduce per such mesh dim / none.

The Boltz expressions that run distributed are listed in :mod:`physicsnemo_foldcp.ops.maps`
(atom<->token maps, after :func:`tag_maps`) and :mod:`physicsnemo_foldcp.ops.single_pair`
(broadcast views of singles, ``torch.cdist``).
"""

from physicsnemo_foldcp.ops import (
    _dispatch,  # noqa: F401 - PhysicsNeMo's handlers first
    casts,  # noqa: F401 - registers the cast handlers
    uneven_fallback,
)
from physicsnemo_foldcp.ops._blocks import MapLayoutError, ShardingLayoutError
from physicsnemo_foldcp.ops.atom_token import (
    atoms_to_tokens_mean,
    representative_atoms,
    tokens_to_atoms,
)
from physicsnemo_foldcp.ops.attention import pair_bias_attention
from physicsnemo_foldcp.ops.maps import SUPPORTED_FORMS, tag_maps
from physicsnemo_foldcp.ops.masks import masked_mean, pair_mask
from physicsnemo_foldcp.ops.single_pair import (
    outer_sum,
    pair_distances,
    relative_position_encoding,
    relpos_width,
)
from physicsnemo_foldcp.ops.tags import MapTag, TaggedShardTensor, ViewTag, map_tag

__all__ = [
    "SUPPORTED_FORMS",
    "MapLayoutError",
    "MapTag",
    "ShardingLayoutError",
    "TaggedShardTensor",
    "ViewTag",
    "atoms_to_tokens_mean",
    "map_tag",
    "masked_mean",
    "outer_sum",
    "pair_bias_attention",
    "pair_distances",
    "pair_mask",
    "relative_position_encoding",
    "relpos_width",
    "representative_atoms",
    "tag_maps",
    "tokens_to_atoms",
]

uneven_fallback.install()
