"""Hydra structured configs of the apps, and the run's pieces built from them.

Every config group of ``conf/`` has a schema here, registered in Hydra's ConfigStore as
``<group>/schema`` (``data/synthetic_schema``, ``data/files_schema``,
``data/boltz_inputs_schema``, ``model/reference_schema``, ``model/boltz2_trunk_schema``);
the group's YAML files select it and only override a value deliberately, with a comment
saying why. Composition refuses
unknown keys and values of the wrong type, naming them; building a schema's dataclass
checks every numeric option with a range (:mod:`~physicsnemo_foldcp.training.bounds`),
so an app stops on a bad value before it writes anything. Each default is written once: in
the schema, or in the class or function the schema configures, from which the schema
reads it.

=============  ===============================  ====================================
group          schema                           defaults from
=============  ===============================  ====================================
``mesh``       :class:`MeshConfig`              ``init_mesh``'s signature
``data``       :class:`SyntheticDataConfig`,    ``SyntheticComplexes``,
               :class:`FilesDataConfig`,        ``FeatureFileDataset``, here,
               :class:`BoltzInputsDataConfig`   ``BoltzInputs``
``model``      :data:`REFERENCE_MODEL_SCHEMA`,  ``models.ModelConfig``,
               :data:`BOLTZ2_TRUNK_SCHEMA`      ``models.Boltz2TrunkConfig``
``optimizer``  ``loop.OptimizerSettings``       itself
``train``      ``loop.TrainSettings``           itself
``predict``    :class:`PredictConfig`           here, ``predict()``'s signature
``registry``   :class:`RegistryConfig`          here
``sharding``   :data:`SHARDING_SCHEMA`          ``sharding.options.ShardingOptions``
``logging``    ``logs.LoggingSettings``         itself
=============  ===============================  ====================================

The apps' root schemas are :class:`TrainAppConfig`, :class:`PredictAppConfig` and
:class:`ScatterAppConfig` (``train_app``, ``predict_app``, ``scatter_app``). The
``model`` group is instantiated by its ``_target_``: a model other than the reference
one needs only its own ``conf/model/*.yaml`` (with or without a schema) and its class
(see :mod:`~physicsnemo_foldcp.training.hooks`).

The builders take a typed node, a plain mapping (e.g. ``OmegaConf.to_container`` of a
group) or the dataclass itself, so the apps and tests use them alike.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, ValidationError
from torch import nn

from physicsnemo_foldcp.boltz import install_for
from physicsnemo_foldcp.data.boltz_inputs import BoltzInputs
from physicsnemo_foldcp.data.datasets import BatchedFiles, SyntheticComplexes
from physicsnemo_foldcp.data.files import FeatureFileDataset
from physicsnemo_foldcp.data.loader import ShardedLoader
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.distributed.bootstrap import init_mesh
from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.kernels.budget import (
    DEFAULT_WORK_BUDGET_MIB,
    set_kernel_recompute,
    set_work_budget,
)
from physicsnemo_foldcp.models.boltz2_config import Boltz2Config, Boltz2TrunkConfig
from physicsnemo_foldcp.models.reference import ModelConfig
from physicsnemo_foldcp.sharding.options import ShardingOptions
from physicsnemo_foldcp.training.bounds import check_range, check_seed
from physicsnemo_foldcp.training.checkpoint import LOADED_WEIGHTS
from physicsnemo_foldcp.training.logs import LoggingSettings
from physicsnemo_foldcp.training.loop import OptimizerSettings, TrainSettings
from physicsnemo_foldcp.training.predict import predict
from physicsnemo_foldcp.training.structures import OUTPUT_FORMATS, predict_structures

logger = logging.getLogger("physicsnemo_foldcp.training")

T = TypeVar("T")

DATA_KINDS = ("synthetic", "files", "boltz_inputs")
"""Values of ``data.kind``."""


def default_of(function: Callable[..., Any], name: str) -> Any:
    """The default value of ``function``'s parameter ``name`` (a class: its ``__init__``).

    Raises
    ------
    ValueError
        When the parameter has no default.
    """
    parameter = inspect.signature(function).parameters[name]
    if parameter.default is inspect.Parameter.empty:
        raise ValueError(f"{function.__qualname__}({name}) has no default")
    return parameter.default


def schema_of(source: type, *, name: str | None = None, target: bool = False) -> type:
    """A mutable structured-config dataclass with the fields, types and defaults of ``source``.

    OmegaConf cannot override a frozen dataclass, and a schema written by hand would restate
    the defaults; this reads them from ``source`` (a dataclass, frozen or not; nested
    dataclass fields become nested schemas). Build the real object from the composed node
    (``source(**values)``), which keeps its own value checks.

    Parameters
    ----------
    source : type
        A dataclass.
    name : str, optional
        Name of the schema class (shown in OmegaConf's messages); ``source``'s by default.
    target : bool, default False
        Add a mandatory ``_target_`` field first (the class Hydra instantiates).
    """
    hints = typing.get_type_hints(source)
    specs: list[tuple[str, Any, Any]] = [("_target_", str, MISSING)] if target else []
    for f in dataclasses.fields(source):
        kind = hints[f.name]
        has_factory = f.default_factory is not dataclasses.MISSING
        if dataclasses.is_dataclass(kind) and (has_factory or f.default is not dataclasses.MISSING):
            nested = schema_of(kind)  # type: ignore[arg-type]
            default = f.default_factory() if has_factory else f.default  # type: ignore[misc]
            factory = functools.partial(_as, nested, default)
            specs.append((f.name, nested, field(default_factory=factory)))
        elif f.default is not dataclasses.MISSING:
            specs.append((f.name, kind, f.default))
        elif f.default_factory is not dataclasses.MISSING:
            specs.append((f.name, kind, field(default_factory=f.default_factory)))
        else:
            specs.append((f.name, kind, MISSING))
    doc = f"Structured config of :class:`{source.__module__}.{source.__qualname__}`."
    return dataclasses.make_dataclass(
        name or source.__name__, specs, namespace={"__doc__": doc, "__module__": __name__}
    )


def _as(schema: type, value: Any) -> Any:
    """The dataclass instance ``value`` as an instance of its mirror ``schema``."""
    kinds = {f.name: f.type for f in dataclasses.fields(schema)}
    return schema(
        **{
            name: _as(kinds[name], v) if dataclasses.is_dataclass(v) else v
            for name, v in ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
        }
    )


SHARDING_SCHEMA = schema_of(ShardingOptions)
"""Schema of the ``sharding`` group: the fields and defaults of ``ShardingOptions``."""

REFERENCE_MODEL_SCHEMA = schema_of(ModelConfig, target=True)
"""Schema of ``model/reference_schema``: ``_target_`` and the sizes of ``ModelConfig``."""

BOLTZ2_TRUNK_SCHEMA = schema_of(Boltz2TrunkConfig, target=True)
"""Schema of ``model/boltz2_trunk_schema``: ``_target_`` and ``Boltz2TrunkConfig``'s fields."""

BOLTZ2_SCHEMA = schema_of(Boltz2Config, target=True)
"""Schema of ``model/boltz2_schema``: ``_target_`` and ``Boltz2Config``'s fields."""


@dataclass
class MeshConfig:
    """The ``ddp x cp0 x cp1`` mesh (``mesh`` group), see :func:`~physicsnemo_foldcp.init_mesh`.

    Attributes
    ----------
    ddp : int
        Domain groups (data-parallel replicas); -1 infers it from the world size.
    cp : list[int]
        ``[cp0, cp1]``: token rows over cp0, token columns over cp1.
    timeout_s : float or None
        Bound on every collective wait; ``None``: ``FOLDCP_TIMEOUT_S`` or 600 s.
    work_budget_mib : float
        Per-rank budget of one kernel piece's transient buffers (triangle attention's key
        sub-chunks, triangle multiplication's panels), see
        :mod:`~physicsnemo_foldcp.kernels.budget`: larger is faster while it fits.
    kernel_recompute : bool
        Whether the triangle attention and the outer product mean recompute their scores
        and outer product in backward (least memory) instead of keeping them from forward
        as Boltz's modules do (the serial step's FLOPs, more memory), see
        :func:`~physicsnemo_foldcp.kernels.budget.set_kernel_recompute`.
    """

    ddp: int = default_of(init_mesh, "ddp")
    cp: list[int] = field(default_factory=lambda: list(default_of(init_mesh, "cp")))
    timeout_s: float | None = default_of(init_mesh, "timeout_s")
    work_budget_mib: float = DEFAULT_WORK_BUDGET_MIB
    kernel_recompute: bool = True

    def __post_init__(self) -> None:
        # The sizes are checked against the world size by init_mesh, before any work.
        if self.timeout_s is not None:
            check_range("mesh.timeout_s", self.timeout_s, low=0.0, low_open=True)
        check_range("mesh.work_budget_mib", self.work_budget_mib, low=0.0, low_open=True)


def build_mesh(mesh: MeshConfig) -> FoldMesh:
    """Start the job's ``ddp x cp0 x cp1`` mesh; set the kernels' work budget and recompute.

    Parameters
    ----------
    mesh : MeshConfig
        The ``mesh`` group.

    Returns
    -------
    FoldMesh
        From :func:`~physicsnemo_foldcp.init_mesh`.
    """
    set_work_budget(mesh.work_budget_mib)
    set_kernel_recompute(mesh.kernel_recompute)
    return init_mesh(ddp=mesh.ddp, cp=tuple(mesh.cp), timeout_s=mesh.timeout_s)


@dataclass
class SyntheticDataConfig:
    """Synthetic Boltz complexes (``data=synthetic``), see :class:`SyntheticComplexes`.

    Attributes
    ----------
    kind : {"synthetic"}
        Selects this dataset.
    n_samples : int
        Complexes in the dataset.
    min_tokens, max_tokens : int
        Range of their token counts (inclusive); small so a CPU step is quick.
    seed, preset, msa_rows, n_conformers
        See :class:`SyntheticComplexes` (``preset`` must match the registry).
    num_workers : int
        DataLoader workers prefetching on each domain source.
    """

    kind: str = "synthetic"
    n_samples: int = 8
    min_tokens: int = 16
    max_tokens: int = 32
    seed: int = default_of(SyntheticComplexes, "seed")
    preset: str = default_of(SyntheticComplexes, "preset")
    msa_rows: int = default_of(SyntheticComplexes, "msa_rows")
    n_conformers: int = default_of(SyntheticComplexes, "n_conformers")
    num_workers: int = default_of(ShardedLoader, "num_workers")

    def __post_init__(self) -> None:
        check_range("data.n_samples", self.n_samples, low=1, integer=True)
        check_range("data.min_tokens", self.min_tokens, low=2, integer=True)
        check_range("data.max_tokens", self.max_tokens, low=self.min_tokens, integer=True)
        check_seed("data.seed", self.seed)
        check_range("data.msa_rows", self.msa_rows, low=1, integer=True)
        check_range("data.n_conformers", self.n_conformers, low=1, integer=True)
        check_range("data.num_workers", self.num_workers, low=0, integer=True)


@dataclass
class FilesDataConfig:
    """Feature files, one sample per ``.pt`` / ``.npz`` (``data=files``), see :class:`BatchedFiles`.

    Attributes
    ----------
    kind : {"files"}
        Selects this dataset.
    path : str
        A directory of sample files, or one file (mandatory).
    validate : bool
        Check every sample against the registry when it is loaded.
    max_sample_bytes : int
        Largest sample read, in bytes once decompressed (checked from the sizes a file
        declares, before anything is decompressed).
    num_workers : int
        DataLoader workers prefetching on each domain source.
    """

    kind: str = "files"
    path: str = MISSING
    validate: bool = default_of(FeatureFileDataset, "validate")
    max_sample_bytes: int = default_of(FeatureFileDataset, "max_bytes")
    num_workers: int = default_of(ShardedLoader, "num_workers")

    def __post_init__(self) -> None:
        check_range("data.max_sample_bytes", self.max_sample_bytes, low=1, integer=True)
        check_range("data.num_workers", self.num_workers, low=0, integer=True)


@dataclass
class BoltzInputsDataConfig:
    """Boltz's YAML / FASTA inputs (``data=boltz_inputs``), see :class:`BoltzInputs`.

    Processed once by Boltz's ``process_inputs`` (global rank 0; the other ranks wait)
    into ``<work_dir>/boltz_inputs_<key>/processed``, then featurized by Boltz-2's
    inference featurizer on each domain source. Offline: no MSA server, no download.

    Attributes
    ----------
    kind : {"boltz_inputs"}
        Selects this dataset.
    inputs : str
        A ``.yaml`` / ``.yml`` / ``.fasta`` file, or a directory of them (mandatory).
    library_dir : str
        Boltz's molecule directory (``<CODE>.pkl``, e.g. ``~/.boltz/mols``) or the cache
        directory holding it as ``mols/`` (mandatory).
    work_dir : str
        Where the processed files go; nothing else in it is touched.
    msa_dir : str or None
        Relative MSA paths of the inputs are resolved here; ``None``: next to each input.
    max_msa_seqs : int
        MSA rows kept when an MSA file is read (Boltz's ``--max_msa_seqs``).
    method : str or None
        Boltz-2's method conditioning (Boltz's ``--method``).
    seed : int or None
        Seed of the featurizer's random conformer rotation: sample ``i`` uses ``seed + i``.
    num_workers : int
        DataLoader workers prefetching on each domain source.
    """

    kind: str = "boltz_inputs"
    inputs: str = MISSING
    library_dir: str = MISSING
    work_dir: str = "runs/boltz_inputs"
    msa_dir: str | None = default_of(BoltzInputs, "msa_dir")
    max_msa_seqs: int = default_of(BoltzInputs, "max_msa_seqs")
    method: str | None = default_of(BoltzInputs, "method")
    seed: int | None = default_of(BoltzInputs, "seed")
    num_workers: int = default_of(ShardedLoader, "num_workers")

    def __post_init__(self) -> None:
        check_range("data.max_msa_seqs", self.max_msa_seqs, low=1, integer=True)
        if self.seed is not None:
            check_seed("data.seed", self.seed)
        check_range("data.num_workers", self.num_workers, low=0, integer=True)


@dataclass
class PredictConfig:
    """What the prediction app writes (``predict`` group).

    Attributes
    ----------
    checkpoint : str or None
        A training checkpoint directory (``<checkpoint_dir>/step_<k>``, from any mesh
        and wrapper); ``None``: the model as initialised from ``seed``.
    seed : int
        Seed of the model's initialisation.
    out_dir : str
        Directory of the ``<record_id>.npz`` distograms (one file per record id; ids
        that map to one file name are refused before anything is written).
    overwrite : bool
        Replace prediction files already in ``out_dir``; otherwise they are refused, by
        name, before anything is written.
    precision : {"fp32", "tf32", "bf16"}
        Numerics of the forward pass (see :func:`~physicsnemo_foldcp.training.predict`).
    output_format : {"mmcif", "pdb"}
        Structure files of a model that predicts structures (``model=boltz2``), as
        ``boltz predict --output_format``.
    weights : {"auto", "model", "ema"}
        What of the checkpoint the model predicts with: the moving average of the weights
        when it has one (``auto``, as Boltz's EMA callback predicts), the trained weights,
        or the average (refused without one); see
        :func:`~physicsnemo_foldcp.training.checkpoint.load_checkpoint`.
    """

    checkpoint: str | None = None
    seed: int = 0
    out_dir: str = "runs/predict"
    overwrite: bool = default_of(predict, "overwrite")
    precision: str = default_of(predict, "precision")
    output_format: str = default_of(predict_structures, "output_format")
    weights: str = "auto"

    def __post_init__(self) -> None:
        check_seed("predict.seed", self.seed)
        if self.weights not in LOADED_WEIGHTS:
            raise ValueError(f"predict.weights={self.weights!r} is not one of {LOADED_WEIGHTS}")
        if self.output_format not in OUTPUT_FORMATS:
            raise ValueError(
                f"predict.output_format={self.output_format!r} is not one of {OUTPUT_FORMATS}"
            )


@dataclass
class RegistryConfig:
    """The feature registry (``registry`` group), see ``FeatureRegistry.from_config``.

    Attributes
    ----------
    preset : str or None
        Preset to start from (``boltz1``, ``boltz2``); ``None``: an empty registry.
    features : dict[str, Any]
        ``{name: {axes, pad_value, dtypes, index_of, one_hot, mode, description,
        allow_nonfinite}}`` added or replacing the preset's.
    remove : list[str]
        Features dropped from the preset.
    """

    preset: str | None = None
    features: dict[str, Any] = field(default_factory=dict)
    remove: list[str] = field(default_factory=list)


@dataclass
class SampleConfig:
    """The complex of the scatter app (``sample`` section), see ``make_complex``.

    Attributes
    ----------
    n_tokens : int
        Tokens of the complex.
    seed : int
        Seed of the complex (plus the ddp rank, so domain groups differ).
    msa_rows : int
        MSA depth; deeper than ``make_complex``'s default, so the MSA blocks show.
    n_conformers : int
        Conformers.
    """

    n_tokens: int = 256
    seed: int = default_of(make_complex, "seed")
    msa_rows: int = 64
    n_conformers: int = default_of(make_complex, "n_conformers")

    def __post_init__(self) -> None:
        check_range("sample.n_tokens", self.n_tokens, low=1, integer=True)
        check_seed("sample.seed", self.seed)
        check_range("sample.msa_rows", self.msa_rows, low=1, integer=True)
        check_range("sample.n_conformers", self.n_conformers, low=1, integer=True)


@dataclass
class TrainAppConfig:
    """Root schema of ``conf/train.yaml`` (``examples/train.py``).

    Attributes
    ----------
    run_dir : str
        Directory of the checkpoints, per-step metrics (rank 0) and the run summary.
    """

    mesh: MeshConfig = MISSING
    data: Any = MISSING
    model: Any = MISSING
    optimizer: OptimizerSettings = MISSING
    train: TrainSettings = MISSING
    registry: RegistryConfig = MISSING
    sharding: SHARDING_SCHEMA = MISSING  # type: ignore[valid-type]
    logging: LoggingSettings = MISSING
    run_dir: str = "runs/train"


@dataclass
class PredictAppConfig:
    """Root schema of ``conf/predict.yaml`` (``examples/predict.py``)."""

    mesh: MeshConfig = MISSING
    data: Any = MISSING
    model: Any = MISSING
    registry: RegistryConfig = MISSING
    sharding: SHARDING_SCHEMA = MISSING  # type: ignore[valid-type]
    predict: PredictConfig = MISSING


@dataclass
class ScatterAppConfig:
    """Root schema of ``conf/scatter.yaml`` (``examples/scatter_sample.py``).

    Attributes
    ----------
    report : bool
        Print the per-rank sharding report on rank 0.
    """

    mesh: MeshConfig = MISSING
    registry: RegistryConfig = MISSING
    sharding: SHARDING_SCHEMA = MISSING  # type: ignore[valid-type]
    sample: SampleConfig = field(default_factory=SampleConfig)
    report: bool = True


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore (done when this module is imported)."""
    store = ConfigStore.instance()
    for group, name, node in (
        ("mesh", "schema", MeshConfig),
        ("data", "synthetic_schema", SyntheticDataConfig),
        ("data", "files_schema", FilesDataConfig),
        ("data", "boltz_inputs_schema", BoltzInputsDataConfig),
        ("model", "reference_schema", REFERENCE_MODEL_SCHEMA),
        ("model", "boltz2_trunk_schema", BOLTZ2_TRUNK_SCHEMA),
        ("model", "boltz2_schema", BOLTZ2_SCHEMA),
        ("optimizer", "schema", OptimizerSettings),
        ("train", "schema", TrainSettings),
        ("predict", "schema", PredictConfig),
        ("registry", "schema", RegistryConfig),
        ("sharding", "schema", SHARDING_SCHEMA),
        ("logging", "schema", LoggingSettings),
    ):
        store.store(group=group, name=name, node=node)
    store.store(name="train_app", node=TrainAppConfig)
    store.store(name="predict_app", node=PredictAppConfig)
    store.store(name="scatter_app", node=ScatterAppConfig)


register_configs()


def _plain(values: Any) -> Any:
    """A composed node as plain containers (interpolations resolved, ``???`` kept)."""
    if isinstance(values, DictConfig):
        return OmegaConf.to_container(values, resolve=True)
    return values


def typed(schema: type[T], values: Any, group: str | None) -> T:
    """``values`` checked against ``schema`` and built as the schema's dataclass.

    The values are read as plain data first, so a key added on the command line with
    ``+`` is refused here like any unknown key.

    Parameters
    ----------
    schema : type
        A structured-config dataclass.
    values : DictConfig, Mapping or schema instance
        A composed node, a plain mapping (e.g. from ``OmegaConf.to_container``), or the
        dataclass itself (returned as is).
    group : str or None
        The config group, for messages (``None``: the root).

    Raises
    ------
    ValueError
        Naming the key, for an unknown key, a value of the wrong type or a mandatory
        value not given; the dataclass's own checks raise their errors as they are.
    """
    if isinstance(values, schema):
        return values
    try:
        node = OmegaConf.merge(OmegaConf.structured(schema), _plain(values))
        return OmegaConf.to_object(node)  # type: ignore[return-value]
    except (ConfigKeyError, ValidationError, MissingMandatoryValue) as err:
        where = ".".join(k for k in (group, err.full_key) if k) or schema.__name__
        if isinstance(err, MissingMandatoryValue):
            raise ValueError(f"{where} needs a value: give {where}=...") from err
        raise ValueError(f"{where}: {str(err).splitlines()[0]}") from err


def data_config(data: Any) -> SyntheticDataConfig | FilesDataConfig | BoltzInputsDataConfig:
    """The ``data`` group as its schema's dataclass (picked by ``data.kind``).

    Raises
    ------
    ValueError
        For an unknown ``kind`` or key, ``kind=files`` without ``path``, or
        ``kind=boltz_inputs`` without ``inputs`` or ``library_dir``.
    """
    if isinstance(data, (SyntheticDataConfig, FilesDataConfig, BoltzInputsDataConfig)):
        return data
    data = _plain(data)
    kind = data.get("kind")
    if kind not in DATA_KINDS:
        raise ValueError(f"data.kind must be one of {DATA_KINDS}, got {kind!r}")
    if kind == "files" and (data.get("path") in (None, "", MISSING)):
        raise ValueError("data.kind=files needs data.path (a directory or file of samples)")
    if kind == "boltz_inputs":
        return typed(BoltzInputsDataConfig, data, "data")
    schema = SyntheticDataConfig if kind == "synthetic" else FilesDataConfig
    return typed(schema, data, "data")


def build_dataset(
    data: Any, model: nn.Module | None = None
) -> SyntheticComplexes | BatchedFiles | BoltzInputs:
    """The serial, batched dataset of a ``data`` group.

    Parameters
    ----------
    data : DictConfig, Mapping or data config
        ``kind: synthetic`` (:class:`SyntheticDataConfig`) or ``kind: files``
        (:class:`FilesDataConfig`) or ``kind: boltz_inputs``
        (:class:`BoltzInputsDataConfig`; call on every rank: rank 0 processes the inputs).
    model : nn.Module, optional
        The model the data is for: synthetic complexes get their atoms padded to its
        ``atom_multiple`` (Boltz's atom window), when it has one.
    """
    config = data_config(data)
    if isinstance(config, BoltzInputsDataConfig):
        return BoltzInputs(
            config.inputs,
            config.library_dir,
            config.work_dir,
            msa_dir=config.msa_dir,
            max_msa_seqs=config.max_msa_seqs,
            method=config.method,
            seed=config.seed,
        )
    if isinstance(config, FilesDataConfig):
        return BatchedFiles(
            config.path, validate=config.validate, max_bytes=config.max_sample_bytes
        )
    return SyntheticComplexes(
        config.n_samples,
        config.min_tokens,
        config.max_tokens,
        seed=config.seed,
        preset=config.preset,
        msa_rows=config.msa_rows,
        n_conformers=config.n_conformers,
        atom_multiple=getattr(model, "atom_multiple", None),
    )


def sharding_options(sharding: Any) -> ShardingOptions:
    """The :class:`ShardingOptions` of a ``sharding`` group (value checks are its own).

    Raises
    ------
    ValueError
        Naming the option (``sharding.<key>``), for an unknown key or an invalid value.
    """
    if isinstance(sharding, ShardingOptions):
        return sharding
    node = typed(SHARDING_SCHEMA, sharding, "sharding")
    try:
        return ShardingOptions.from_mapping(dataclasses.asdict(node))
    except ValueError as err:
        raise ValueError(f"sharding.{err}") from err


def loader_options(options: ShardingOptions, **loader: Any) -> dict[str, Any]:
    """:class:`~physicsnemo_foldcp.data.ShardedLoader` arguments for ``options``.

    Parameters
    ----------
    options : ShardingOptions
        How each sample is sharded.
    **loader : Any
        Further loader arguments (e.g. ``num_workers``), passed on as they are.
    """
    return {"options": options, **loader}


def train_settings(train: Any) -> TrainSettings:
    """:class:`TrainSettings` of a ``train`` group, its values checked."""
    return typed(TrainSettings, train, "train")


def optimizer_settings(optimizer: Any) -> OptimizerSettings:
    """:class:`OptimizerSettings` of an ``optimizer`` group, its values checked."""
    return typed(OptimizerSettings, optimizer, "optimizer")


def build_model(model: Mapping[str, Any] | DictConfig, seed: int) -> nn.Module:
    """The model of a ``model`` group (``_target_`` and its arguments), seeded with ``seed``.

    The same ``seed`` on every rank gives every rank the same initial parameters. A model
    that holds Boltz's modules gets their distributed forwards
    (:func:`physicsnemo_foldcp.boltz.install_for`).

    Raises
    ------
    ValueError
        When the group has no ``_target_``.
    TypeError
        When the target does not build an ``nn.Module``.
    """
    if not model.get("_target_"):
        raise ValueError(
            "model: needs _target_, the model class (e.g. "
            "physicsnemo_foldcp.models.ReferenceFoldModel)"
        )
    torch.manual_seed(seed)
    built = instantiate(model)
    if not isinstance(built, nn.Module):
        raise TypeError(f"model: {model['_target_']} built a {type(built).__name__}, not a Module")
    if install_for(built):
        logger.info("model: Boltz modules found, their distributed forwards are installed")
    return built


__all__ = [
    "BOLTZ2_SCHEMA",
    "BOLTZ2_TRUNK_SCHEMA",
    "DATA_KINDS",
    "REFERENCE_MODEL_SCHEMA",
    "SHARDING_SCHEMA",
    "BoltzInputsDataConfig",
    "FilesDataConfig",
    "MeshConfig",
    "PredictAppConfig",
    "PredictConfig",
    "RegistryConfig",
    "SampleConfig",
    "ScatterAppConfig",
    "SyntheticDataConfig",
    "TrainAppConfig",
    "build_dataset",
    "build_mesh",
    "build_model",
    "data_config",
    "default_of",
    "loader_options",
    "optimizer_settings",
    "register_configs",
    "schema_of",
    "sharding_options",
    "train_settings",
    "typed",
]
