"""Property tests of the layout on one process: every rank's blocks tile the padded layout,
and the padded layout maps back to the serial sample exactly."""

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from physicsnemo_foldcp import ShardingOptions
from physicsnemo_foldcp.sharding.packing import unpack
from physicsnemo_foldcp.sharding.plan import local_block
from physicsnemo_foldcp.sharding.prepare import prepare_sample
from physicsnemo_foldcp.sharding.wire import expand_wire_blocks, pack_rank
from physicsnemo_foldcp.testing.random_sample import (
    RandomSampleSpec,
    random_registry,
    random_sample,
)
from physicsnemo_foldcp.testing.strategies import paddings, sample_specs

REGISTRY = random_registry()


@settings(max_examples=60, deadline=None)
@given(spec=sample_specs(), cp0=st.integers(1, 3), cp1=st.integers(1, 3), padding=paddings)
@example(  # six tokens on 3 row blocks, tokens without atoms, only pad atoms at the end
    spec=RandomSampleSpec(atoms_per_token=(0, 2, 0, 0, 1, 0), trailing_pad_atoms=3),
    cp0=3,
    cp1=2,
    padding={"token_multiple": 1, "atom_multiple": 4},
)
@example(  # one token on a 3x3 mesh: empty blocks
    spec=RandomSampleSpec(atoms_per_token=(5,)),
    cp0=3,
    cp1=3,
    padding={"token_multiple": 1, "atom_multiple": 1},
)
def test_blocks_tile_the_padded_layout_and_invert_exactly(spec, cp0, cp1, padding):
    x = random_sample(spec, seed=len(spec.atoms_per_token))
    prepared = prepare_sample(x, REGISTRY, (cp0, cp1), options=ShardingOptions(**padding))
    plan = prepared.plan
    counts = torch.tensor(spec.atoms_per_token)
    for name, padded in prepared.padded.items():
        reg = REGISTRY[name]
        # Inverse of the layout is exact.
        back = padded
        if reg.mode != "passthrough":
            back = plan.from_padded(padded, reg.axes)
        if reg.index_of == "atoms":
            back = plan.unmap_index_values(back, "atoms")
        assert torch.equal(back, x[name]) and back.dtype == x[name].dtype, name
        # Blocks of all ranks tile the padded layout: concatenating them gives it back.
        if reg.mode == "shard":
            rows = []
            for i in range(cp0):
                cols = [local_block(reg, padded, plan, (i, j)) for j in range(cp1)]
                dims = reg.sharded_axes
                rows.append(torch.cat(cols, dims[1]) if 1 in dims else cols[0])
            assert torch.equal(torch.cat(rows, reg.sharded_axes[0]), padded), name
    # Atoms follow their tokens: row block i holds exactly its tokens' atoms (+ pads last).
    for i in range(cp0):
        t0, t1 = plan.serial_range("tokens", i)
        a0, a1 = plan.serial_range("atoms", i)
        expected = int(counts[t0:t1].sum()) + (spec.trailing_pad_atoms if i == cp0 - 1 else 0)
        assert a1 - a0 == expected
        assert plan.row_sizes("atoms")[i] % padding["atom_multiple"] == 0
        assert plan.row_sizes("tokens")[i] % padding["token_multiple"] == 0


@settings(max_examples=40, deadline=None)
@given(
    spec=sample_specs(max_tokens=60),
    cp0=st.integers(1, 3),
    cp1=st.integers(1, 3),
    padding=paddings,
    map_layout=st.sampled_from(["dense", "index"]),
)
@example(  # pads inside a cp1 column block that spans two row blocks
    spec=RandomSampleSpec(atoms_per_token=(2, 0, 1, 3, 1), trailing_pad_atoms=2),
    cp0=3,
    cp1=2,
    padding={"token_multiple": 2, "atom_multiple": 4},
    map_layout="dense",
)
def test_packed_blocks_equal_blocks_of_the_padded_layout(spec, cp0, cp1, padding, map_layout):
    x = random_sample(spec, seed=len(spec.atoms_per_token) + 1)
    options = ShardingOptions(map_layout=map_layout, **padding)
    prepared = prepare_sample(x, REGISTRY, (cp0, cp1), options=options)
    for i in range(cp0):
        for j in range(cp1):
            blocks = [
                local_block(REGISTRY[f.name], prepared.padded[f.name], prepared.plan, (i, j))
                if REGISTRY[f.name].mode != "passthrough"
                else prepared.padded[f.name]
                for f in prepared.metas
            ]
            layout = prepared.local_layout((i, j))
            buffer = pack_rank(prepared, (i, j))
            got = expand_wire_blocks(
                unpack(buffer, layout), prepared.metas, prepared.specs, prepared.plan, (i, j)
            )
            for f, block, expected in zip(prepared.metas, got, blocks):
                same = block.dtype == expected.dtype and torch.equal(block, expected)
                assert same, ((i, j), f.name)
