"""Serial tests of the training / inference orders and the resumable epoch sampler."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from physicsnemo_foldcp.data.sampling import EpochSampler, InferenceOrder, Step, TrainingOrder

lengths = st.integers(min_value=1, max_value=60)
ddp_sizes = st.integers(min_value=1, max_value=9)


def all_groups(order_cls, length, ddp, epoch=0, **kwargs):
    return [order_cls(length, ddp, d, **kwargs).group_indices(epoch) for d in range(ddp)]


@settings(max_examples=60, deadline=None)
@given(length=lengths, ddp=ddp_sizes, seed=st.integers(0, 2**31), epoch=st.integers(0, 50))
def test_training_wrap_covers_every_sample_and_rounds_are_distinct(length, ddp, seed, epoch):
    groups = all_groups(TrainingOrder, length, ddp, epoch, seed=seed)
    steps = math.ceil(length / ddp)
    assert all(len(g) == steps for g in groups), "every group runs the same number of steps"
    rounds = [[g[s] for g in groups] for s in range(steps)]
    assert set().union(*map(set, rounds)) == set(range(length)), "wrap misses a sample"
    for s, indices in enumerate(rounds):
        if ddp <= length:
            assert len(set(indices)) == ddp, f"round {s}: groups share an index {indices}"
    # Position s*D + d of the epoch permutation, wrapped.
    perm = TrainingOrder(length, ddp, seed=seed).permutation(epoch).tolist()
    assert sorted(perm) == list(range(length))
    flat = [idx for r in rounds for idx in r]
    assert flat == [perm[p % length] for p in range(steps * ddp)]


@settings(max_examples=60, deadline=None)
@given(length=lengths, ddp=ddp_sizes, seed=st.integers(0, 2**31), epoch=st.integers(0, 50))
def test_training_drop_uses_each_sample_at_most_once(length, ddp, seed, epoch):
    if length < ddp:
        with pytest.raises(ValueError, match="remainder='drop' with .* leaves no step"):
            TrainingOrder(length, ddp, seed=seed, remainder="drop")
        return
    groups = all_groups(TrainingOrder, length, ddp, epoch, seed=seed, remainder="drop")
    assert all(len(g) == length // ddp for g in groups)
    flat = [i for g in groups for i in g]
    assert len(flat) == len(set(flat)) == (length // ddp) * ddp


def test_training_order_is_a_function_of_seed_and_epoch():
    a = TrainingOrder(50, 2, 1, seed=3)
    b = TrainingOrder(50, 2, 1, seed=3)
    assert a.group_indices(4) == b.group_indices(4), "same arguments, same order"
    assert a.group_indices(4) != a.group_indices(5), "epochs are reshuffled"
    assert a.group_indices(4) != TrainingOrder(50, 2, 1, seed=4).group_indices(4)
    assert a.group_indices(4) != TrainingOrder(50, 2, 0, seed=3).group_indices(4)
    state = torch.random.get_rng_state()
    torch.manual_seed(12345)
    again = TrainingOrder(50, 2, 1, seed=3).group_indices(4)
    torch.random.set_rng_state(state)
    assert again == a.group_indices(4), "the global RNG does not leak into the order"


def test_unshuffled_training_order_follows_the_dataset():
    order = TrainingOrder(7, 3, 1, shuffle=False)
    assert order.group_indices(0) == [1, 4, 0]  # positions 1, 4, 7 -> 7 wraps to 0
    assert order.group_indices(9) == [1, 4, 0]


def test_replacement_is_deterministic_and_avoids_failed_indices():
    order = TrainingOrder(10, 2, 0, seed=1)
    first = order.replacement(0, 3, 1, {4})
    assert first == TrainingOrder(10, 2, 0, seed=1).replacement(0, 3, 1, {4})
    assert first != 4
    assert order.replacement(0, 3, 1, set(range(10)) - {7}) == 7
    picks = {order.replacement(0, s, 1, set()) for s in range(30)}
    assert len(picks) > 3, "substitutes vary from step to step"


@settings(max_examples=60, deadline=None)
@given(length=lengths, ddp=ddp_sizes)
def test_inference_takes_every_index_once_in_order(length, ddp):
    groups = all_groups(InferenceOrder, length, ddp)
    steps = math.ceil(length / ddp)
    assert all(len(g) == steps for g in groups)
    real = [i for g in groups for i in g if i is not None]
    assert sorted(real) == list(range(length))
    for d, g in enumerate(groups):
        assert [i for i in g if i is not None] == list(range(d, length, ddp))
        pads = [s for s, i in enumerate(g) if i is None]
        expected = [steps - 1] if length % ddp and d >= length % ddp else []
        assert pads == expected, f"group {d}: padding at {pads}"
        assert InferenceOrder(length, ddp, d).padding_steps == len(expected)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((0, 2, 0), ValueError, "dataset is empty"),
        ((5, 0, 0), ValueError, "ddp_size must be >= 1"),
        ((5, 2, 2), ValueError, r"ddp_rank must be in \[0, 2\)"),
        ((5.0, 2, 0), TypeError, "length must be an integer"),
    ],
)
def test_orders_reject_bad_sizes(args, error, match):
    with pytest.raises(error, match=match):
        TrainingOrder(*args)
    with pytest.raises(error, match=match):
        InferenceOrder(*args)
    with pytest.raises(ValueError, match="remainder must be one of"):
        TrainingOrder(5, 1, remainder="pad")


def test_epoch_sampler_walks_epochs_and_resumes():
    order = TrainingOrder(9, 2, 1, seed=8)
    sampler = EpochSampler(order)
    assert len(sampler) == 5
    epoch0 = list(sampler.steps())
    assert epoch0 == [Step(0, s, i) for s, i in enumerate(order.group_indices(0))]
    assert (sampler.epoch, sampler.position) == (1, 0)
    walk = sampler.steps()
    taken = [next(walk), next(walk)]
    state = sampler.state_dict()
    assert (state["epoch"], state["position"]) == (1, 2)
    resumed = EpochSampler(TrainingOrder(9, 2, 1, seed=8))
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # the current epoch: the position is kept
    rest = list(resumed.steps())
    assert taken + rest == [Step(1, s, i) for s, i in enumerate(order.group_indices(1))]
    resumed.set_epoch(0)
    assert resumed.position == 0 and resumed.pending()[0] == epoch0[0]


def test_epoch_sampler_refuses_a_state_of_another_order():
    state = EpochSampler(TrainingOrder(9, 2, 0, seed=8)).state_dict()
    for other, field in [
        (TrainingOrder(9, 2, 0, seed=9), "seed=8 in the state but 9 here"),
        (TrainingOrder(10, 2, 0, seed=8), "length=9 in the state but 10 here"),
        (TrainingOrder(9, 3, 0, seed=8), "ddp_size=2 in the state but 3 here"),
        (TrainingOrder(9, 2, 0, seed=8, remainder="drop"), "remainder='wrap'"),
        (InferenceOrder(9, 2, 0), "mode='train' in the state but 'inference' here"),
    ]:
        with pytest.raises(ValueError, match=field):
            EpochSampler(other).load_state_dict(state)
    with pytest.raises(ValueError, match="position 7"):
        EpochSampler(TrainingOrder(9, 2, 0, seed=8)).load_state_dict({**state, "position": 7})
    with pytest.raises(ValueError, match="lacks"):
        EpochSampler(TrainingOrder(9, 2, 0, seed=8)).load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="epoch must be an integer"):
        EpochSampler(TrainingOrder(9, 2, 0)).set_epoch(-1)
