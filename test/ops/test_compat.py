"""One test per private upstream name in ``core/compat.py``: each fails if upstream changes it."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from physicsnemo.domain_parallel import ShardTensor
from physicsnemo.domain_parallel import shard_tensor as shard_tensor_module
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import Replicate, Shard
from torch.overrides import handle_torch_function, has_torch_function

from physicsnemo_foldcp.core import compat
from physicsnemo_foldcp.testing import collective_assert

distributed = pytest.mark.multigpu_static
MESH = pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=str)


def uneven_rows(mesh, columns: int = 3):
    """``[7, columns]`` with rows 4 / 3 over cp0 (uneven), replicated over cp1."""
    full = torch.arange(7 * columns, dtype=torch.float32).reshape(7, columns)
    i = mesh.domain_coordinate[0]
    sizes = [4, 3]
    local = full[sum(sizes[:i]) : sum(sizes[:i]) + sizes[i]].clone()
    shapes = {0: [(n, columns) for n in sizes]}
    st = ShardTensor.from_local(local, mesh.domain_mesh, (Shard(0), Replicate()), shapes)
    return st, local, full, shapes


def probe(x):
    """A function of ours that dispatches on ShardTensors (for the registry test)."""
    if has_torch_function((x,)):
        return handle_torch_function(probe, (x,), x)
    return x


# -- serial: names that need no process group -------------------------------------------------


def test_is_tracing_is_true_exactly_for_fake_operands():
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = torch.ones(2)
    assert compat.is_tracing((real,), {}) is False
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(real)
    assert compat.is_tracing((fake,), {}) is True
    assert compat.is_tracing((), {"x": [fake]}) is True


def test_conversion_active_reads_the_conversion_scope():
    assert compat.conversion_active() is False
    with compat.conversion_scope():
        assert compat.conversion_active() is True
        with compat.conversion_scope():
            assert compat.conversion_active() is True
        assert compat.conversion_active() is True
    assert compat.conversion_active() is False


def test_upstream_fallbacks_are_module_functions_looked_up_at_call_time():
    originals = {n: getattr(shard_tensor_module, n) for n in compat.UPSTREAM_FALLBACKS}
    seen = []

    def wrap(original, name):
        def run(func, args, kwargs=None):
            seen.append(name)
            return original(func, args, kwargs)

        return run

    with compat.observed_upstream_fallbacks(wrap):
        for name in compat.UPSTREAM_FALLBACKS:
            assert getattr(shard_tensor_module, name) is not originals[name]
    for name in compat.UPSTREAM_FALLBACKS:
        assert getattr(shard_tensor_module, name) is originals[name]
    assert not seen


def test_plain_function_call_skips_subclass_dispatch():
    calls = []

    class Counting(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            calls.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    x = torch.ones(2, 3).as_subclass(Counting)
    calls.clear()
    assert compat.plain_function_call(torch.Tensor.size, (x,), {}) == (2, 3)
    assert not calls


def test_at_end_of_backward_runs_when_the_backward_it_was_queued_from_ends():
    from torch.utils.checkpoint import checkpoint

    events = []
    weight = torch.ones(3, requires_grad=True)
    weight.register_post_accumulate_grad_hook(lambda p: events.append("weight"))

    def inner(x):
        out = x * weight
        if out.requires_grad:  # the recomputation inside the checkpoint's backward
            out.register_hook(lambda g: compat.at_end_of_backward(lambda: events.append("nested")))
        return out

    x = torch.ones(3, requires_grad=True)
    y = (checkpoint(inner, x, use_reentrant=True) * 2).sum()
    y.register_hook(lambda g: compat.at_end_of_backward(lambda: events.append("outer")))
    y.backward()
    # The callback queued inside the checkpoint's nested backward runs when that ends (after
    # the weight's gradient, accumulated there); the one queued from the outer backward, first
    # queued, runs last of all.
    assert events == ["weight", "nested", "outer"]
    assert torch.equal(weight.grad, torch.full((3,), 2.0))


# -- distributed: names that describe ShardTensors --------------------------------------------


@distributed
@MESH
def test_local_tensor_is_the_block_without_a_copy(fold_mesh):
    st, local, _, _ = uneven_rows(fold_mesh)
    got = compat.local_tensor(st)
    collective_assert(got is local or got.data_ptr() == local.data_ptr(), "not the same block")


@distributed
@MESH
def test_sharding_shapes_are_the_shapes_given_to_from_local(fold_mesh):
    st, _, _, shapes = uneven_rows(fold_mesh)
    got = {m: [tuple(s) for s in v] for m, v in compat.sharding_shapes(st).items()}
    collective_assert(got == shapes, f"{got} != {shapes}")


@distributed
@MESH
def test_global_shape_is_the_spec_shape(fold_mesh):
    st, _, full, _ = uneven_rows(fold_mesh)
    collective_assert(compat.global_shape(st) == tuple(full.shape), f"{compat.global_shape(st)}")


@distributed
@MESH
def test_registered_function_handler_reads_the_registry(fold_mesh):
    st, *_ = uneven_rows(fold_mesh)
    collective_assert(compat.registered_function_handler(probe) is None, "probe registered")

    def handler(func, types, args, kwargs):
        return "handled"

    ShardTensor.register_function_handler(probe, handler)  # a test-only function
    ok = compat.registered_function_handler(probe) is handler and probe(st) == "handled"
    with compat.function_handlers_removed((probe,)):
        removed = compat.registered_function_handler(probe) is None
    restored = compat.registered_function_handler(probe) is handler
    collective_assert(ok and removed and restored, f"{ok} {removed} {restored}")


@distributed
@MESH
def test_torch_function_fallback_runs_an_op_through_dtensor(fold_mesh):
    st, local, _, _ = uneven_rows(fold_mesh, columns=4)
    out = compat.torch_function_fallback(torch.Tensor.__mul__, (st, 2.0), {})
    good = isinstance(out, ShardTensor) and torch.equal(compat.local_tensor(out), local * 2)
    collective_assert(good, f"fallback gave {type(out).__name__}")


@distributed
@MESH
def test_collectives_are_counted_and_correct(fold_mesh):
    mesh = fold_mesh.domain_mesh
    i, j = fold_mesh.domain_coordinate
    x = torch.full((2, 3), float(1 + i))
    with CommDebugMode() as mode:
        gathered = compat.all_gather(x, 0, mesh, 0)
        reduced = compat.all_reduce(x, "sum", mesh, 0)
        maxed = compat.all_reduce(x, "max", mesh, 0)
        scattered = compat.reduce_scatter(torch.ones(4, 3) * (1 + i), 0, mesh, 0)
    problems = gather_and_scatter_problems(gathered, scattered, mode, 4)
    if not torch.equal(reduced, torch.full((2, 3), 3.0)) or not torch.equal(maxed, x * 0 + 2):
        problems.append("all_reduce")
    collective_assert(not problems and dist.is_initialized(), "; ".join(problems))


def gather_and_scatter_problems(gathered, scattered, mode, collectives: int) -> list[str]:
    """What is wrong with the cp0 gather of ``1 + i``, the scatter of ``(1 + i) * ones(4, 3)``
    and the count of collectives (empty when nothing is)."""
    problems = []
    if not torch.equal(gathered, torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)])):
        problems.append(f"all_gather {gathered}")
    if not torch.equal(scattered, torch.full((2, 3), 3.0)):
        problems.append(f"reduce_scatter {scattered}")
    counts = sum(mode.get_comm_counts().values())
    if counts != collectives:
        problems.append(f"CommDebugMode counted {counts} collectives, not {collectives}")
    return problems


@distributed
@MESH
def test_started_collectives_return_before_the_data_and_are_counted(fold_mesh):
    mesh = fold_mesh.domain_mesh
    i, _ = fold_mesh.domain_coordinate
    x = torch.full((2, 3), float(1 + i))
    with CommDebugMode() as mode:
        gathering = compat.start_all_gather(x, mesh, 0)
        scattering = compat.start_reduce_scatter(torch.ones(4, 3) * (1 + i), mesh, 0)
        pending = [type(t).__name__ for t in (gathering, scattering)]
        gathered, scattered = compat.wait(gathering), compat.wait(scattering)
    problems = gather_and_scatter_problems(gathered, scattered, mode, 2)
    if pending != ["AsyncCollectiveTensor"] * 2:
        problems.append(f"started collectives returned {pending}, not unwaited tensors")
    if type(gathered) is not torch.Tensor or type(scattered) is not torch.Tensor:
        problems.append("wait did not return plain tensors")
    collective_assert(not problems, "; ".join(problems))


class TwoOutputs(torch.nn.Module):
    def forward(self, x):
        return x * 2, x * 3


@distributed
@MESH
def test_comm_counter_counts_and_lets_a_module_output_go_unused(fold_mesh):
    st, local, _, _ = uneven_rows(fold_mesh)
    leaf = local.clone().requires_grad_(True)
    x = ShardTensor.from_local(
        leaf, fold_mesh.domain_mesh, st.placements, compat.sharding_shapes(st)
    )
    with compat.comm_counter() as mode:
        used, _unused = TwoOutputs()(x)
        compat.all_reduce(torch.ones(2), "sum", fold_mesh.domain_mesh, 0)
        used.to_local().sum().backward()
    counts = sum(mode.get_comm_counts().values())
    good = counts == 1 and torch.equal(leaf.grad, torch.full_like(local, 2.0))
    collective_assert(good, f"counted {counts} collectives, grad {leaf.grad}")


@distributed
@MESH
def test_all_to_all_exchanges_uneven_and_empty_pieces(fold_mesh):
    mesh = fold_mesh.domain_mesh
    _, j = fold_mesh.domain_coordinate
    # along cp1: rank 0 sends 0 rows to itself and 3 to rank 1; rank 1 sends 2 and 1
    send_sizes = [[0, 3], [2, 1]][j]
    receive_sizes = [[0, 2], [3, 1]][j]
    t = torch.arange(sum(send_sizes) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * j
    with CommDebugMode() as mode:
        got = compat.all_to_all(t, receive_sizes, send_sizes, mesh, 1)
    expected = [
        torch.tensor([[100.0, 101.0], [102.0, 103.0]]),
        torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [104.0, 105.0]]),
    ][j]
    counts = sum(mode.get_comm_counts().values())
    collective_assert(
        torch.equal(got, expected) and counts == 1, f"got {got}, {counts} collectives counted"
    )


def test_checkpoint_metadata_refers_only_to_the_allowed_globals(tmp_path):
    """DCP's .metadata of a sharded-style save names only what the safe reader allows."""
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp

    from physicsnemo_foldcp.training.safe_dcp import PATH_GLOBALS, read_metadata

    state = {"model": {"w": torch.ones(3, 2), "b": torch.zeros(2, dtype=torch.bfloat16)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(tmp_path))
    seen = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(tmp_path / ".metadata", "rb") as f:
        Recording(f).load()
    allowed = set(compat.checkpoint_metadata_globals()) | set(PATH_GLOBALS)
    dtypes = {("torch", "float32"), ("torch", "bfloat16")}
    assert seen - dtypes <= allowed, seen - dtypes - allowed
    assert set(read_metadata(tmp_path).state_dict_metadata) == {"model.w", "model.b"}


def _saved_dcp(tmp_path, state):
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(tmp_path))


def test_checkpoint_storage_info_type_holds_the_file_and_the_bytes_of_each_record(tmp_path):
    """Each storage record names a shard file of the directory and the bytes of one tensor."""
    import io
    import pickle

    state = {"model": {"w": torch.arange(6.0).reshape(3, 2), "b": torch.ones(4)}}
    _saved_dcp(tmp_path, state)
    metadata = pickle.loads((tmp_path / ".metadata").read_bytes())
    records = metadata.storage_data
    assert records and all(
        isinstance(info, compat.checkpoint_storage_info_type()) for info in records.values()
    )
    for index, info in records.items():
        assert not info.transform_descriptors
        data = (tmp_path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        tensor = torch.load(io.BytesIO(data), weights_only=True)
        assert torch.equal(tensor, state["model"][index.fqn.split(".", 1)[1]])


def test_replace_reader_file_system_opens_every_shard_through_it(tmp_path):
    """A FileSystem set on the reader opens every shard file DCP reads, and nothing else."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem

    _saved_dcp(tmp_path, {"model": {"w": torch.arange(6.0)}})
    opened = []

    class Recording(FileSystem):
        def create_stream(self, path, mode):
            opened.append((Path(path).name, mode))
            return super().create_stream(path, mode)

    reader = FileSystemReader(str(tmp_path))
    compat.replace_reader_file_system(reader, Recording())
    target = {"model": {"w": torch.zeros(6)}}
    dcp.load(target, storage_reader=reader)
    assert torch.equal(target["model"]["w"], torch.arange(6.0))
    files = {name for name, _ in opened}
    assert files == {".metadata"} | {p.name for p in tmp_path.glob("*.distcp")}, opened
    assert {mode for _, mode in opened} == {"rb"}


def test_lightning_forward_redirection_runs_the_method_inside_the_wrappers_forward():
    pl = pytest.importorskip("pytorch_lightning")
    calls = []

    class Module(pl.LightningModule):
        def training_step(self, value):
            calls.append(("step", value))
            return value * 2

    module = Module()
    module.register_forward_pre_hook(lambda *_: calls.append(("hook",)))
    strategy = pl.strategies.SingleDeviceStrategy(device="cpu")
    redirect = compat.lightning_forward_redirection(strategy)
    assert redirect(module, module, "training_step", 21) == 42
    assert calls == [("hook",), ("step", 21)]
    assert module.forward.__func__ is pl.LightningModule.forward


def test_profiled_cpu_allocations_pair_each_block_with_its_address():
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    )
    with prof:
        a = torch.empty(1000, 250)  # 1,000,000 bytes
        b = torch.empty(500, 250)  # 500,000 bytes
        address_a, address_b = a.data_ptr(), b.data_ptr()
        del a
    events = compat.profiled_cpu_allocations(prof)
    assert events == sorted(events)
    by_address = {}
    for _, size, address in events:
        by_address.setdefault(address, []).append(size)
    assert by_address[address_a] == [1_000_000, -1_000_000]
    assert by_address[address_b] == [500_000]
