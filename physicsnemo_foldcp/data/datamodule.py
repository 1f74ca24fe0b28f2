"""A Lightning data module of sharded loaders (a plain class where Lightning is absent).

:class:`FoldCPDataModule` holds the serial train / val / test / predict datasets and the
sharding options, and hands out :class:`~physicsnemo_foldcp.data.loader.ShardedLoader`s:
a training loader (shuffled epochs) from :meth:`~FoldCPDataModule.train_dataloader`, and
inference loaders (every sample once, in order) for the others.

Where ``pytorch_lightning`` (Boltz's Lightning, the ``boltz`` extra) is installed, the
class is a real ``pytorch_lightning.LightningDataModule``: ``Trainer.fit(datamodule=...)``
takes it, and its loader positions go into Lightning's checkpoints through
:meth:`~FoldCPDataModule.state_dict`. Without Lightning it has the same methods and works
in any loop. The loaders split the data over the ``ddp`` mesh axis themselves; under
Lightning train with :class:`~physicsnemo_foldcp.lightning.FoldCPStrategy`, which also
hands the data module its mesh (``mesh=None``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from physicsnemo_foldcp.data.loader import (
    ShardedLoader,
    check_fetch_options,
    loader_sharding_options,
)
from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.features.registry import FeatureRegistry
from physicsnemo_foldcp.sharding.options import ShardingOptions


def _base_class() -> type:
    """``pytorch_lightning.LightningDataModule`` when Lightning is installed, else ``object``."""
    try:
        from pytorch_lightning import LightningDataModule
    except ImportError:
        return object
    return LightningDataModule


STAGES = ("fit", "validate", "test", "predict")
"""Stages of :meth:`FoldCPDataModule.setup` (Lightning's names)."""

_NEEDS = {
    "fit": ("train",),
    "validate": ("val",),
    "test": ("test",),
    "predict": ("predict",),
}


class FoldCPDataModule(_base_class()):
    """Serial datasets in, sharded loaders out: Lightning's data module over the mesh.

    Parameters
    ----------
    train_dataset, val_dataset, predict_dataset : map-style dataset, optional
        Serial datasets (``dataset[i]`` -> feature dict); see :class:`ShardedLoader`.
    mesh : FoldMesh, optional
        From :func:`physicsnemo_foldcp.init_mesh`; ``None`` under a Lightning ``Trainer``
        whose strategy is :class:`~physicsnemo_foldcp.lightning.FoldCPStrategy` (its mesh
        is taken when the first loader is built).
    test_dataset : map-style dataset, optional
        Serial test dataset.
    registry : FeatureRegistry, optional
        Axis meanings of the features; the Boltz-2 preset by default.
    options : ShardingOptions, optional
        How every sample is sharded, for every loader (see :class:`ShardedLoader`).
    seed : int, default 0
        Seed of the training order (the same on every rank).
    shuffle : bool, default True
        Shuffle the training set every epoch.
    remainder : {"wrap", "drop"}, default "wrap"
        How the last training round of an epoch is evened out over the domain groups.
    num_workers : int, default 0
        DataLoader workers on each source rank.
    prefetch_factor : int, optional
        Samples prefetched per worker.
    fetch_timeout_s : float, optional
        Bound on waiting for one sample from the workers.
    dataloader_kwargs : Mapping[str, Any], optional
        Further DataLoader arguments for the source ranks.
    on_error : {"raise", "skip"}, default "raise"
        Failed-sample policy of every loader (see :class:`ShardedLoader`).
    max_skips : int, default 10
        Failed samples tolerated per pass with ``on_error="skip"``.
    record_key : str or None, default "record_id"
        Sample entry reported as the record id.
    token_bounds : sequence of int, optional
        Fixed row-block token boundaries for every sample of every loader (see
        :class:`ShardedLoader`).

    All options are checked here, by the loader's own checks, before any loader is built.

    Examples
    --------
    >>> dm = FoldCPDataModule(train_ds, val_ds, None, mesh, seed=1)  # doctest: +SKIP
    >>> dm.setup("fit")  # doctest: +SKIP
    >>> for item in dm.train_dataloader():  # doctest: +SKIP
    ...     loss = model(**item.features)
    """

    def __init__(
        self,
        train_dataset: Any = None,
        val_dataset: Any = None,
        predict_dataset: Any = None,
        mesh: FoldMesh | None = None,
        *,
        test_dataset: Any = None,
        registry: FeatureRegistry | None = None,
        options: ShardingOptions | None = None,
        seed: int = 0,
        shuffle: bool = True,
        remainder: str = "wrap",
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        fetch_timeout_s: float | None = None,
        dataloader_kwargs: Mapping[str, Any] | None = None,
        on_error: str = "raise",
        max_skips: int = 10,
        record_key: str | None = "record_id",
        token_bounds: Sequence[int] | None = None,
    ):
        super().__init__()
        self._mesh = mesh
        self.datasets: dict[str, Any] = {
            "train": train_dataset,
            "val": val_dataset,
            "test": test_dataset,
            "predict": predict_dataset,
        }
        fetch: dict[str, Any] = {
            "num_workers": num_workers,
            "prefetch_factor": prefetch_factor,
            "fetch_timeout_s": fetch_timeout_s,
            "dataloader_kwargs": dict(dataloader_kwargs or {}),
            "on_error": on_error,
            "max_skips": max_skips,
        }
        check_fetch_options(**fetch)
        self.options, token_bounds = loader_sharding_options(
            options, token_bounds, caller="FoldCPDataModule"
        )
        self.registry = registry if registry is not None else FeatureRegistry.preset("boltz2")
        self.seed = seed
        self.shuffle = shuffle
        self.remainder = remainder
        self.loader_options: dict[str, Any] = {
            "registry": self.registry,
            "options": self.options,
            "record_key": record_key,
            "token_bounds": token_bounds,
            **fetch,
        }
        self._loaders: dict[str, ShardedLoader] = {}
        self._pending_state: dict[str, Any] = {}

    @property
    def mesh(self) -> FoldMesh:
        """The mesh given, or else that of the attached Trainer's ``FoldCPStrategy``.

        Raises
        ------
        TypeError
            When no mesh was given and no Trainer with a ``FoldCPStrategy`` is attached.
        """
        if self._mesh is None:
            strategy = getattr(getattr(self, "trainer", None), "strategy", None)
            mesh = getattr(strategy, "mesh", None)
            if not isinstance(mesh, FoldMesh):
                raise TypeError(
                    "FoldCPDataModule has no mesh: pass mesh=init_mesh(ddp, cp=(cp0, cp1)), "
                    "or use it with Trainer(strategy=FoldCPStrategy(...)), which provides it"
                )
            self._mesh = mesh
        return self._mesh

    # -- Lightning hooks --------------------------------------------------------------------

    def prepare_data(self) -> None:
        """Nothing to download or write; present for Lightning compatibility."""

    def setup(self, stage: str | None = None) -> None:
        """Build the loaders that ``stage`` needs (all available ones for ``None``).

        Parameters
        ----------
        stage : {"fit", "validate", "test", "predict"} or None
            Lightning's stage; ``"fit"`` needs the train dataset (and uses val if given).

        Raises
        ------
        ValueError
            For an unknown stage, or when the stage's dataset was not given.
        """
        if stage is not None and stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES} or None, got {stage!r}")
        if stage is None:
            splits = [name for name, ds in self.datasets.items() if ds is not None]
        else:
            splits = list(_NEEDS[stage])
            if stage == "fit" and self.datasets["val"] is not None:
                splits.append("val")
        for split in splits:
            self._loader(split)

    def teardown(self, stage: str | None = None) -> None:
        """Drop the loaders of ``stage`` (all for ``None``); the training position is kept."""
        if stage is not None and stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES} or None, got {stage!r}")
        splits = list(self._loaders) if stage is None else list(_NEEDS[stage])
        for split in splits:
            loader = self._loaders.pop(split, None)
            if loader is not None:
                self._pending_state[split] = loader.state_dict()

    def train_dataloader(self) -> ShardedLoader:
        """The training loader (the same object on every call, so it keeps its position)."""
        return self._loader("train")

    def val_dataloader(self) -> ShardedLoader:
        """The validation loader: every sample once per pass, in order."""
        return self._loader("val")

    def test_dataloader(self) -> ShardedLoader:
        """The test loader: every sample once per pass, in order."""
        return self._loader("test")

    def predict_dataloader(self) -> ShardedLoader:
        """The prediction loader: every sample once, in order, each with its record id."""
        return self._loader("predict")

    def state_dict(self) -> dict[str, Any]:
        """Position of every loader built so far (epoch and step), for checkpoints."""
        state = dict(self._pending_state)
        state.update({split: loader.state_dict() for split, loader in self._loaders.items()})
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore loader positions from :meth:`state_dict` (now or when built)."""
        unknown = set(state) - set(self.datasets)
        if unknown:
            raise ValueError(f"data module state has unknown split(s) {sorted(unknown)}")
        for split, loader_state in state.items():
            if split in self._loaders:
                self._loaders[split].load_state_dict(loader_state)
            else:
                self._pending_state[split] = dict(loader_state)

    # -- helpers ----------------------------------------------------------------------------

    def _loader(self, split: str) -> ShardedLoader:
        if split in self._loaders:
            return self._loaders[split]
        dataset = self.datasets[split]
        if dataset is None:
            raise ValueError(
                f"no {split} dataset: pass {split}_dataset= to FoldCPDataModule to use "
                f"{split}_dataloader()"
            )
        if split == "train":
            loader = ShardedLoader(
                dataset,
                self.mesh,
                mode="train",
                seed=self.seed,
                shuffle=self.shuffle,
                remainder=self.remainder,
                **self.loader_options,
            )
        else:
            loader = ShardedLoader(dataset, self.mesh, mode="inference", **self.loader_options)
        if split in self._pending_state:
            loader.load_state_dict(self._pending_state.pop(split))
        self._loaders[split] = loader
        return loader

    def __repr__(self) -> str:
        sizes = ", ".join(
            f"{split}={len(ds)}" for split, ds in self.datasets.items() if ds is not None
        )
        mesh = self._mesh.shape if self._mesh is not None else "from the Trainer"
        return f"FoldCPDataModule({sizes}; mesh {mesh})"


__all__ = ["STAGES", "FoldCPDataModule"]
