"""Distributed tests of the sharded data pipeline: parity, orders, errors, skips, resume."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_foldcp import gather_features
from physicsnemo_foldcp.data import (
    FeatureFileDataset,
    FoldCPDataModule,
    LoaderConfigError,
    SerialLoaderError,
    ShardedLoader,
    SkipLimitError,
    save_sample,
)
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.distributed.errors import RemoteTraceback
from physicsnemo_foldcp.features import FeatureRegistry
from physicsnemo_foldcp.sharding.options import BalanceOptions, ShardingOptions
from physicsnemo_foldcp.testing import collective_assert

pytestmark = pytest.mark.multigpu_static

# (ddp, cp0, cp1): world 4 (ddp=2 x 1x2, ddp=1 x 2x2), world 6, world 9.
MESHES = [(2, 1, 2), (1, 2, 2), (3, 1, 2), (1, 2, 3), (3, 1, 3), (1, 3, 3)]
DDP_MESHES = [(2, 1, 2), (3, 1, 2), (3, 1, 3)]
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731

SIZES = (13, 40, 21, 17, 33, 26, 29)  # 7 samples: uneven over 2 and 3 domain groups
ERROR_BOUND_S = 30.0


def serial_sample(index: int, sizes=SIZES, preset: str = "boltz2") -> dict:
    """The ground truth: sample ``index`` of :class:`Complexes`."""
    x = make_complex(sizes[index], seed=100 + index, preset=preset, msa_rows=3)
    x["record_id"] = f"rec{index:03d}"
    return x


class Complexes:
    """A serial map-style dataset that records its calls.

    Full synthetic complexes, or with ``tiny=True`` two token features and the record id
    (cheap to scatter, for tests about orders and errors). ``fail`` maps an index to the
    message of a ``ValueError`` raised when it is fetched.
    """

    def __init__(
        self,
        sizes=SIZES,
        preset: str = "boltz2",
        fail: dict[int, str] | None = None,
        tiny: bool = False,
    ):
        self.sizes, self.preset, self.fail = tuple(sizes), preset, dict(fail or {})
        self.tiny = tiny
        self.calls: list[int] = []

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, index: int) -> dict:
        self.calls.append(index)
        if index in self.fail:
            raise ValueError(self.fail[index])
        if self.tiny:
            return tiny_sample(index, self.sizes)
        return serial_sample(index, self.sizes, self.preset)


def tiny_sample(index: int, sizes=SIZES) -> dict:
    n = sizes[index]
    return {
        "token_index": torch.arange(n),
        "token_pad_mask": torch.ones(n),
        "record_id": f"rec{index:03d}",
    }


def tiny(n: int, fail: dict[int, str] | None = None) -> Complexes:
    """``n`` tiny samples of 5 to 8 tokens."""
    return Complexes(sizes=tuple(5 + i % 4 for i in range(n)), fail=fail, tiny=True)


def differences(features, expected: dict, registry: FeatureRegistry) -> list[str]:
    """Every way a scattered sample differs from the serial one (collective: gathers)."""
    problems = []
    for name, value in features.items():
        if isinstance(value, torch.Tensor):
            spec = registry[name]
            if not isinstance(value, ShardTensor):
                problems.append(f"{name} is a {type(value).__name__}, not a ShardTensor")
            elif value.placements != spec.placements:
                problems.append(f"{name} placements {value.placements} != {spec.placements}")
    gathered = gather_features(features)
    if set(gathered) != set(expected):
        problems.append(f"keys differ: {sorted(set(gathered) ^ set(expected))}")
    for name, value in expected.items():
        got = gathered.get(name)
        if isinstance(value, torch.Tensor):
            same = (
                isinstance(got, torch.Tensor)
                and got.dtype == value.dtype
                and got.shape == value.shape
                and torch.equal(got, value)
            )
        else:
            same = got == value
        if not same:
            problems.append(f"{name} differs from the serial sample")
    return problems


def world_gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def by_group(gathered: list, mesh) -> dict[int, list]:
    """Group world-gathered entries ``(ddp_rank, ...)`` by domain group."""
    groups: dict[int, list] = {}
    for entry in gathered:
        groups.setdefault(entry[0], []).append(entry)
    return groups


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=mesh_id)
def test_training_batches_equal_serial_samples(fold_mesh):
    """Every training sample equals, after gather, the serial sample of the same index.

    The loader leaves the global torch generator alone (the ranks of a domain draw their
    dropout masks from it in step).
    """
    dataset = Complexes()
    registry = FeatureRegistry.preset("boltz2")
    loader = ShardedLoader(dataset, fold_mesh, mode="train", seed=5, registry=registry)
    problems, seen = [], []
    generator = torch.get_rng_state()
    for item in loader:
        seen.append(item.index)
        if item.record_id != f"rec{item.index:03d}":
            problems.append(f"step {item.step}: record id {item.record_id} != {item.index}")
        problems += differences(item.features, serial_sample(item.index), registry)
    steps = -(-len(SIZES) // fold_mesh.ddp_size)
    if len(seen) != steps or (loader.epoch, loader.position) != (1, 0):
        problems.append(f"{len(seen)} steps (want {steps}), then at {loader.epoch}")
    # Only the source rank calls the serial dataset, once per step, in order.
    expected_calls = seen if fold_mesh.is_domain_source else []
    if dataset.calls != expected_calls:
        problems.append(f"dataset calls {dataset.calls}, expected {expected_calls}")
    if not torch.equal(torch.get_rng_state(), generator):
        problems.append("the loader drew from the global torch generator")
    collective_assert(not problems, "; ".join(problems[:6]))


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=mesh_id)
def test_training_order_same_in_a_group_different_across_groups(fold_mesh):
    loader = ShardedLoader(tiny(len(SIZES)), fold_mesh, mode="train", seed=5)
    seen, problems = [], []
    for _ in range(2):
        for item in loader:
            seen.append((item.epoch, item.step, item.index))
            if item.record_id != f"rec{item.index:03d}":
                problems.append(f"step {item.step}: record {item.record_id} for {item.index}")
    collective_assert(not problems, "; ".join(problems[:6]))
    steps = -(-len(SIZES) // fold_mesh.ddp_size)
    gathered = world_gather((fold_mesh.ddp_rank, fold_mesh.rank, seen))
    groups = by_group(gathered, fold_mesh)
    for d, entries in groups.items():
        orders = {tuple(s) for _, _, s in entries}
        collective_assert(len(orders) == 1, f"domain group {d}: ranks disagree on the order")
    firsts = {d: entries[0][2] for d, entries in groups.items()}
    collective_assert(len(firsts) == fold_mesh.ddp_size, f"groups {sorted(firsts)}")
    for epoch in range(2):
        covered = set()
        for step in range(steps):
            at_step = [s[epoch * steps + step] for s in firsts.values()]
            collective_assert(
                all(e == epoch and st == step for e, st, _ in at_step),
                f"epoch {epoch} step {step}: {at_step}",
            )
            indices = [i for _, _, i in at_step]
            collective_assert(
                len(set(indices)) == len(indices),
                f"epoch {epoch} step {step}: two groups share an index {indices}",
            )
            covered |= set(indices)
        collective_assert(covered == set(range(len(SIZES))), f"epoch {epoch} misses samples")
    epoch_orders = [tuple(i for e, _, i in firsts[0] if e == k) for k in range(2)]
    collective_assert(epoch_orders[0] != epoch_orders[1], "epochs 0 and 1 have the same order")


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=mesh_id)
def test_inference_covers_every_index_once_in_order(fold_mesh):
    dataset = Complexes(preset="boltz1")
    registry = FeatureRegistry.preset("boltz1")
    loader = ShardedLoader(dataset, fold_mesh, mode="inference", registry=registry)
    problems, seen = [], []
    for item in loader:
        seen.append((item.step, item.index, item.record_id, item.is_padding))
        if item.is_padding:
            if item.features is not None or item.record_id is not None:
                problems.append(f"padding step {item.step} carries a sample")
            continue
        if item.record_id != f"rec{item.index:03d}":
            problems.append(f"index {item.index} has record id {item.record_id}")
        problems += differences(item.features, serial_sample(item.index, preset="boltz1"), registry)
    collective_assert(not problems, "; ".join(problems[:6]))

    ddp = fold_mesh.ddp_size
    gathered = world_gather((fold_mesh.ddp_rank, fold_mesh.rank, seen))
    groups = by_group(gathered, fold_mesh)
    for d, entries in groups.items():
        collective_assert(len({tuple(s) for _, _, s in entries}) == 1, f"group {d} disagrees")
    real = [s[1] for entries in groups.values() for s in entries[0][2] if not s[3]]
    collective_assert(sorted(real) == list(range(len(SIZES))), f"indices covered: {real}")
    for d, entries in groups.items():
        steps = entries[0][2]
        indices = [s[1] for s in steps if not s[3]]
        collective_assert(indices == list(range(d, len(SIZES), ddp)), f"group {d}: {indices}")
        collective_assert([s[0] for s in steps] == list(range(-(-len(SIZES) // ddp))), "steps")
        pads = [s[0] for s in steps if s[3]]
        want = [len(SIZES) // ddp] if d >= len(SIZES) % ddp and len(SIZES) % ddp else []
        collective_assert(pads == want, f"group {d}: padding steps {pads}, expected {want}")


def _run_until_error(loader):
    """Iterate ``loader``; return (indices seen, exception or None, seconds to the exception)."""
    start = time.monotonic()
    seen = []
    try:
        for item in loader:
            seen.append(item.index)
    except Exception as err:  # noqa: BLE001 - examined by the test
        return seen, err, time.monotonic() - start
    return seen, None, time.monotonic() - start


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=mesh_id)
@pytest.mark.parametrize("num_workers", [0, 1], ids=["main", "worker"])
def test_fetch_error_reaches_every_rank_of_the_group(fold_mesh, num_workers):
    if num_workers and fold_mesh.ddp_size == 1 and fold_mesh.cp != (2, 2):
        pytest.skip("workers: one domain shape per world is enough")
    bad = 3
    message = f"corrupt record rec{bad:03d}: checksum mismatch"
    dataset = tiny(5, fail={bad: message})
    loader = ShardedLoader(
        dataset,
        fold_mesh,
        mode="inference",
        num_workers=num_workers,
        prefetch_factor=2 if num_workers else None,
    )
    seen, err, seconds = _run_until_error(loader)
    hit = fold_mesh.ddp_rank == bad % fold_mesh.ddp_size
    problems = []
    if hit:
        if not isinstance(err, ValueError) or str(err) != message:
            problems.append(f"got {type(err).__name__}: {err}, expected ValueError: {message}")
        elif not isinstance(err.__cause__, RemoteTraceback):
            problems.append(f"cause is {type(err.__cause__).__name__}, not RemoteTraceback")
        elif "__getitem__" not in str(err.__cause__) or message not in str(err.__cause__):
            problems.append(f"the original traceback is missing: {err.__cause__}")
        if seconds > ERROR_BOUND_S:
            problems.append(f"the error took {seconds:.1f} s")
        if seen != list(range(fold_mesh.ddp_rank, bad, fold_mesh.ddp_size)):
            problems.append(f"saw {seen} before the error")
        if loader.position != len(seen):
            problems.append(f"position {loader.position} after {len(seen)} steps")
    elif err is not None:
        problems.append(f"group {fold_mesh.ddp_rank} raised {type(err).__name__}: {err}")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=mesh_id)
def test_invalid_sample_error_reaches_every_rank(fold_mesh):
    """A sample that fails validation on the source raises its error on every rank."""

    class Truncated(Complexes):
        def __getitem__(self, index):
            x = super().__getitem__(index)
            if index == 0:
                x["token_pad_mask"] = x["token_pad_mask"][:-1]
            return x

    loader = ShardedLoader(Truncated(sizes=(5, 6), tiny=True), fold_mesh, mode="inference")
    seen, err, seconds = _run_until_error(loader)
    problems = []
    if fold_mesh.ddp_rank == 0:
        text = str(err)
        if type(err).__name__ != "FeatureValidationError" or "token_pad_mask" not in text:
            problems.append(f"got {type(err).__name__}: {err}")
        if seconds > ERROR_BOUND_S:
            problems.append(f"the error took {seconds:.1f} s")
    elif err is not None:
        problems.append(f"group {fold_mesh.ddp_rank} raised {err!r}")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=mesh_id)
def test_skip_policy_keeps_groups_in_lockstep(fold_mesh):
    fail = {1: "bad record 1", 4: "bad record 4"}
    dataset = tiny(7, fail=fail)
    sizes = dataset.sizes
    loader = ShardedLoader(
        dataset, fold_mesh, mode="train", seed=11, on_error="skip", max_skips=len(fail) * 3
    )
    problems, seen = [], []
    for item in loader:
        seen.append((item.step, item.index, item.skipped))
        if item.index in fail or item.record_id != f"rec{item.index:03d}":
            problems.append(f"step {item.step} yielded index {item.index} ({item.record_id})")
        if any(i not in fail for i in item.skipped):
            problems.append(f"step {item.step} skipped a good index: {item.skipped}")
    steps = -(-len(sizes) // fold_mesh.ddp_size)
    if [s for s, _, _ in seen] != list(range(steps)):
        problems.append(f"steps {[s for s, _, _ in seen]}, want {steps}")
    recorded = [(s.step, s.index, s.message) for s in loader.skipped]
    from_items = [(s, i, fail[i]) for s, _, skipped in seen for i in skipped]
    if recorded != from_items:
        problems.append(f"loader.skipped {recorded} != skipped items {from_items}")
    collective_assert(not problems, "; ".join(problems[:6]))

    gathered = world_gather((fold_mesh.ddp_rank, fold_mesh.rank, seen))
    groups = by_group(gathered, fold_mesh)
    for d, entries in groups.items():
        collective_assert(len({tuple(s) for _, _, s in entries}) == 1, f"group {d} not in step")
    expected_hits = sum(
        1 for entries in groups.values() for _, index, skipped in entries[0][2] for _ in skipped
    )
    collective_assert(expected_hits >= 1, "no group met a failing index: the test is vacuous")


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=mesh_id)
def test_skip_policy_in_inference_flags_the_sample_and_limits_skips(fold_mesh):
    sizes = tiny(5).sizes
    ddp = fold_mesh.ddp_size
    fail = {2: "bad record 2"}
    loader = ShardedLoader(tiny(5, fail=fail), fold_mesh, mode="inference", on_error="skip")
    items = [(i.index, i.has_features, i.error, i.skipped, i.is_padding) for i in loader]
    mine = [i for i, *_ in items if i is not None]
    problems = []
    if mine != list(range(fold_mesh.ddp_rank, len(sizes), ddp)):
        problems.append(f"indices {mine}")
    for index, has_features, error, skipped, _ in items:
        if index == 2 and (has_features or skipped != (2,) or "bad record 2" not in str(error)):
            problems.append(f"failed sample not flagged: {has_features}, {skipped}, {error}")
        if index not in (2, None) and (not has_features or skipped or error):
            problems.append(f"index {index} flagged: {skipped}, {error}")
    collective_assert(not problems, "; ".join(problems))

    # More failures than max_skips raise SkipLimitError in the group that meets them.
    fail = {0: "bad 0", ddp: "bad ddp", 2 * ddp: "bad 2ddp"}
    loader = ShardedLoader(
        tiny(5, fail=fail),
        fold_mesh,
        mode="inference",
        on_error="skip",
        max_skips=1,
    )
    seen, err, _ = _run_until_error(loader)
    if fold_mesh.ddp_rank == 0:
        ok = isinstance(err, SkipLimitError) and "bad ddp" in str(err) and len(seen) == 1
    else:
        ok = err is None
    collective_assert(ok, f"group {fold_mesh.ddp_rank}: {seen}, {err!r}")


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=mesh_id)
def test_resume_from_state_dict_continues_identically(fold_mesh):
    options = dict(mode="train", seed=7, remainder="drop" if fold_mesh.ddp_size == 2 else "wrap")
    reference = ShardedLoader(tiny(5), fold_mesh, **options)
    uninterrupted = [(i.epoch, i.step, i.index) for _ in range(3) for i in reference]

    first = ShardedLoader(tiny(5), fold_mesh, **options)
    before = [(i.epoch, i.step, i.index) for i in first]
    iterator = iter(first)
    before.append(next(map(lambda i: (i.epoch, i.step, i.index), iterator)))
    del iterator
    state = first.state_dict()

    resumed = ShardedLoader(tiny(5), fold_mesh, **options)
    resumed.load_state_dict(state)
    resumed.set_epoch(state["epoch"])  # what Lightning does at the start of an epoch
    after = [(i.epoch, i.step, i.index) for _ in range(2) for i in resumed]
    after = after[: len(uninterrupted) - len(before)]
    collective_assert(
        before + after == uninterrupted,
        f"resumed {before} + {after} != {uninterrupted}",
    )
    collective_assert(state["epoch"] == 1 and state["position"] == 1, f"state {state}")


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 2, 3), (1, 3, 3)], indirect=True, ids=mesh_id)
def test_ranks_with_different_orders_are_refused(fold_mesh):
    seed = 1 if fold_mesh.is_domain_source else 2
    loader = ShardedLoader(tiny(2), fold_mesh, mode="train", seed=seed)
    with pytest.raises(LoaderConfigError, match=r"rank \d+ has order=.*the source has"):
        next(iter(loader))


@pytest.mark.parametrize("fold_mesh", DDP_MESHES, indirect=True, ids=mesh_id)
def test_worker_timeout_is_raised_on_every_rank(fold_mesh):
    """A fetch that never returns is bounded by fetch_timeout_s and raised everywhere."""

    class Slow(Complexes):
        def __getitem__(self, index):
            time.sleep(30)
            return super().__getitem__(index)

    loader = ShardedLoader(
        Slow(sizes=(5, 6, 7), tiny=True),
        fold_mesh,
        mode="train",
        num_workers=1,
        fetch_timeout_s=1.0,
    )
    _, err, seconds = _run_until_error(loader)
    ok = isinstance(err, SerialLoaderError) and "timed out" in str(err) and seconds < ERROR_BOUND_S
    collective_assert(ok, f"{type(err).__name__}: {err} after {seconds:.1f} s")


@pytest.mark.parametrize(
    "fold_mesh", [(2, 1, 2), (1, 2, 2), (1, 2, 3), (1, 3, 3)], indirect=True, ids=mesh_id
)
def test_datamodule_predicts_files_from_disk(fold_mesh):
    sizes = (13, 17, 15)
    registry = FeatureRegistry.preset("boltz2")
    with tempfile.TemporaryDirectory(prefix=f"foldcp-rank{fold_mesh.rank}-") as tmp:
        for index in range(len(sizes)):
            sample = make_complex(sizes[index], seed=index, msa_rows=3)
            save_sample(sample, Path(tmp) / f"target_{index}.{'npz' if index % 2 else 'pt'}")
        problems = predict_with_datamodule(fold_mesh, FeatureFileDataset(tmp, registry), sizes)
    collective_assert(not problems, "; ".join(problems[:6]))


def predict_with_datamodule(fold_mesh, files, sizes) -> list[str]:
    registry = files.registry
    module = FoldCPDataModule(tiny(3), None, files, fold_mesh, registry=registry, seed=2)
    module.setup("fit")
    module.setup("predict")
    train = module.train_dataloader()
    problems = []
    if train is not module.train_dataloader() or train.mode != "train":
        problems.append("train_dataloader is not one persistent training loader")
    first = [i.index for i in train]
    train.set_epoch(0)
    if [i.index for i in train] != first:
        problems.append("set_epoch(0) does not replay epoch 0")
    predict = module.predict_dataloader()
    for item in predict:
        if item.is_padding:
            continue
        expected = make_complex(sizes[item.index], seed=item.index, msa_rows=3)
        expected["record_id"] = f"target_{item.index}"
        if item.record_id != expected["record_id"]:
            problems.append(f"record id {item.record_id} for index {item.index}")
        problems += differences(item.features, expected, registry)
    try:
        module.val_dataloader()
        problems.append("val_dataloader() without a val dataset did not raise")
    except ValueError as err:
        if "no val dataset" not in str(err):
            problems.append(f"val_dataloader(): {err}")
    return problems


class RnaLigandComplexes(Complexes):
    """Complexes with a long RNA chain and ligands (1 to 23 atoms per token)."""

    def __getitem__(self, index: int) -> dict:
        self.calls.append(index)
        x = make_complex(
            self.sizes[index],
            seed=200 + index,
            preset=self.preset,
            msa_rows=2,
            composition={"protein": 0.4, "rna": 0.4, "ligand": 0.2},
        )
        x["record_id"] = f"rec{index:03d}"
        return x


BALANCED_HALF_PAIR = ShardingOptions(balance=BalanceOptions("balanced", pair_weight=0.5))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 2, 3), (1, 3, 3)], indirect=True, ids=mesh_id)
def test_balanced_loader_uses_the_balanced_bounds_of_every_sample(fold_mesh):
    from physicsnemo_foldcp.sharding.balance import (
        atoms_per_token,
        balanced_token_bounds,
        even_token_bounds,
    )

    dataset = RnaLigandComplexes(sizes=(31, 44))
    registry = FeatureRegistry.preset("boltz2")
    cp0, cp1 = fold_mesh.cp
    loader = ShardedLoader(dataset, fold_mesh, mode="inference", options=BALANCED_HALF_PAIR)
    assert loader.options.balance == BalanceOptions("balanced", pair_weight=0.5)
    problems, balanced_differs = [], False
    for item in loader:
        x = dataset[item.index]
        expected = balanced_token_bounds(atoms_per_token(x), cp0, cp1=cp1, pair_weight=0.5)
        got = tuple(item.features.plan.token_bounds)
        if got != tuple(expected):
            problems.append(f"sample {item.index}: bounds {got} != balanced {tuple(expected)}")
        balanced_differs |= got != tuple(even_token_bounds(len(x["token_pad_mask"]), cp0))
        problems += differences(item.features, x, registry)
    if not balanced_differs:
        problems.append("no sample got other bounds than the even split: the test shows nothing")
    collective_assert(not problems, "; ".join(problems[:6]))


def test_balance_options_are_checked():
    with pytest.raises(TypeError, match="unexpected keyword argument 'balance'"):
        ShardedLoader(tiny(2), None, balance="balanced")  # type: ignore[arg-type, call-arg]
    balanced = ShardingOptions(balance=BalanceOptions(mode="balanced"))
    with pytest.raises(ValueError, match=r"computes token_bounds per sample"):
        ShardedLoader(
            tiny(2),
            None,  # type: ignore[arg-type]
            options=balanced,
            token_bounds=(0, 1, 2),
        )
