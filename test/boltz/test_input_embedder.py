"""Boltz-2's InputEmbedder (atom encoder, windowed atom attention), unmodified, under CP.

The atoms are scattered with their tokens, so the 32-atom query windows of Boltz's atom
transformer straddle the row blocks; :mod:`physicsnemo_foldcp.boltz.atom_attention` cuts
them at window boundaries and exchanges the key halos. ``validate_model`` compares the
token single ``s``, the loss and every parameter gradient with the serial module (TF32
off), on complexes with ligands (one-atom tokens), and finds no fallback gather.
"""

import pytest
import torch
from torch import nn

from physicsnemo_foldcp import ShardingOptions, scatter_features
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.ops import ShardingLayoutError, masked_mean
from physicsnemo_foldcp.ops.atom_windows import AtomWindows
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.host_syncs import count_host_syncs
from physicsnemo_foldcp.testing.parity import randomize_parameters
from physicsnemo_foldcp.training import batched, validate_model

encodersv2 = pytest.importorskip("boltz.model.modules.encodersv2")

from physicsnemo_foldcp.models.boltz2_trunk import Boltz2Trunk, atom_feature_width  # noqa: E402

pytestmark = pytest.mark.multigpu_static
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731


class Embedder(nn.Module):
    """The input embedder of a small Boltz2Trunk, returning the token single."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.input_embedder = Boltz2Trunk().input_embedder

    def forward(self, **feats):
        return {"s": self.input_embedder(feats), "mask": feats["token_pad_mask"].float()}


def single_loss(outputs, feats):
    return masked_mean(outputs["s"].pow(2).mean(-1), outputs["mask"])


def sample(n_tokens: int, seed: int) -> dict:
    return batched(make_complex(n_tokens, seed=seed, msa_rows=3, atom_multiple=32))


# One mesh here: test_trunk.py compares the embedder's outputs (and every gradient) as
# part of the whole trunk on 1x2, 2x2, 2x3 and 3x3. At N = 37 each row block's windows are
# split over its cp1 ranks; at N = 7 a row block has fewer windows than cp1 ranks, and
# each rank computes all of its row block's.
@pytest.mark.parametrize(
    "fold_mesh,n_tokens,split",
    [((1, 2, 2), 37, True), ((1, 2, 2), 7, False)],
    indirect=["fold_mesh"],
    ids=lambda v: mesh_id(v) if isinstance(v, tuple) else f"{v}",
)
def test_input_embedder_matches_serial_without_fallbacks(fold_mesh, n_tokens, split):
    features = sample(n_tokens, seed=5)
    windows = AtomWindows.of(scatter_features(features, fold_mesh)["ref_pos"], 32, 128)
    bounds = windows.atom_bounds
    straddles = len(bounds) == 2 or any(b % 32 for b in bounds)  # one row block: no cut
    collective_assert(
        straddles and windows.split_over_columns == split,
        f"atom blocks {bounds}, windows per row block {windows.window_counts}: a window "
        f"straddles them: {straddles}; split over cp1: {windows.split_over_columns}",
    )
    model = randomize_parameters(Embedder(), 2)
    report = validate_model(model, features, fold_mesh, loss_fn=single_loss)
    collective_assert(report.ok, report.format())


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=mesh_id)
def test_moved_windows_and_the_diffusion_encoder_are_refused(fold_mesh):
    """Per-shard atom padding would move the windows; structure prediction is not here."""
    features = sample(23, seed=5)
    padded = scatter_features(features, fold_mesh, options=ShardingOptions(atom_multiple=32))
    with pytest.raises(ShardingLayoutError, match="atom_multiple=1") as moved:
        Embedder()(**padded)
    scattered = scatter_features(features, fold_mesh)
    diffusion = encodersv2.AtomEncoder(8, 4, 16, 8, 32, 128, atom_feature_width())
    with pytest.raises(ShardingLayoutError, match="structure_prediction=True"):
        diffusion(scattered, s_trunk=None, z=None)
    collective_assert("row block 0 ends with pad atoms" in str(moved.value), str(moved.value))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=mesh_id)
def test_the_padding_check_reads_the_plan_and_agrees_with_the_mask(fold_mesh):
    """The scatter's map tag decides without a host sync; the mask (no tag) decides alike."""
    features = sample(23, seed=5)
    for options, refused in ((ShardingOptions(atom_multiple=32), True), (None, False)):
        feats = scatter_features(features, fold_mesh, options=options)
        windows = AtomWindows.of(feats["ref_pos"], 32, 128)
        for maps in (feats["atom_to_token"], None):
            with count_host_syncs() as syncs:
                try:
                    windows.check_padding(feats["atom_pad_mask"], maps)
                    message = None
                except ShardingLayoutError as err:
                    message = str(err)
            how = "from the map's tag" if maps is not None else "from the mask"
            collective_assert(
                (message is not None) == refused
                and (message is None or "row block 0 ends with pad atoms" in message),
                f"{options}, {how}: {message}",
            )
            if maps is not None:
                collective_assert(syncs.total == 0, f"{how}: {syncs.format()}")
