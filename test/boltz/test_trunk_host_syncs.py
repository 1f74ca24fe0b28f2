"""A steady-state trunk training step under CP makes no host sync that serial Boltz does not.

On GPUs every tensor-to-host conversion (``.item()``, ``.tolist()``, ``bool(t)``, ...) and
every data-dependent shape (``nonzero``, boolean-mask indexing) stalls the stream. After
one warm step, the forward, distogram loss and backward of ``Boltz2Trunk`` on a scattered
sample are counted (:func:`~physicsnemo_foldcp.testing.host_syncs.count_host_syncs`) on
2x2 and 2x3, next to the same step of the serial trunk, with the same weights, on the
same sample, counted on every rank: the plugin may add none. Whatever its handlers need
to know about the layout (block sizes, window cuts, pad runs) comes from the plan at
scatter time.
"""

import pytest
import torch

from physicsnemo_foldcp import scatter_features
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.models.boltz2_config import DEFAULT_PAIRFORMER_ARGS
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.host_syncs import HostSyncs, count_host_syncs
from physicsnemo_foldcp.testing.parity import randomize_parameters
from physicsnemo_foldcp.training import batched

pytest.importorskip("boltz")

from physicsnemo_foldcp.models.boltz2_trunk import Boltz2Trunk  # noqa: E402

pytestmark = pytest.mark.multigpu_static
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731


def make_trunk() -> Boltz2Trunk:
    """A small trunk (one Pairformer block), the same weights on every rank."""
    torch.manual_seed(0)
    trunk = Boltz2Trunk(pairformer_args={**DEFAULT_PAIRFORMER_ARGS, "num_blocks": 1})
    return randomize_parameters(trunk, 3).train()


def counted_second_step(model: Boltz2Trunk, feats) -> HostSyncs:
    """Two training steps (forward, loss, backward); the host syncs of the second."""

    def step():
        model.zero_grad(set_to_none=True)
        model.loss(model(**feats), feats).backward()

    step()
    with count_host_syncs() as syncs:
        step()
    return syncs


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 2, 3)], indirect=True, ids=mesh_id)
def test_a_trunk_training_step_adds_no_host_sync_to_serial_boltz(fold_mesh):
    # 37 tokens: uneven row blocks, atom windows that straddle them.
    sample = batched(make_complex(37, seed=7, msa_rows=5, atom_multiple=32))
    serial = counted_second_step(make_trunk(), sample)
    feats = scatter_features(sample if fold_mesh.is_domain_source else None, fold_mesh)
    distributed = counted_second_step(make_trunk(), feats)
    collective_assert(
        distributed.total <= serial.total,
        f"a trunk training step on {mesh_id(fold_mesh.cp)} made {distributed.total} host "
        f"syncs, serial Boltz {serial.total}\nunder CP:\n{distributed.format()}\n"
        f"serial:\n{serial.format()}",
    )
