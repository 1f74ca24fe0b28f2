"""Data: synthetic Boltz feature dicts and the data pipeline for context parallelism.

* :mod:`~physicsnemo_foldcp.data.sampling`: which dataset index each domain group takes
  per step (shuffled training epochs; every index once for inference).
* :mod:`~physicsnemo_foldcp.data.loader`: :class:`ShardedLoader`, a serial dataset in,
  ShardTensor samples out, with cross-rank error propagation.
* :mod:`~physicsnemo_foldcp.data.datamodule`: :class:`FoldCPDataModule`, a Lightning
  data module of sharded loaders (a plain class without Lightning). It is imported on
  first use, so importing the package never imports Lightning.
* :mod:`~physicsnemo_foldcp.data.files`: feature dicts stored one per ``.pt`` / ``.npz``.
* :mod:`~physicsnemo_foldcp.data.boltz_inputs`: :class:`BoltzInputs`, Boltz's YAML / FASTA
  inputs through Boltz's own processing and Boltz-2 featurizer (Boltz is imported on first
  use).
* :mod:`~physicsnemo_foldcp.data.synthetic`: realistic synthetic Boltz-1/2 samples.
"""

from physicsnemo_foldcp.data.boltz_inputs import (
    BoltzInputError,
    BoltzInputs,
    MissingMoleculeError,
)
from physicsnemo_foldcp.data.files import (
    FeatureFileDataset,
    FeatureFileError,
    list_sample_files,
    load_sample,
    save_sample,
    validate_sample,
)
from physicsnemo_foldcp.data.loader import (
    LoaderConfigError,
    SerialLoaderError,
    ShardedLoader,
    ShardedSample,
    SkipLimitError,
    SkippedSample,
)
from physicsnemo_foldcp.data.sampling import (
    EpochSampler,
    InferenceOrder,
    Step,
    TrainingOrder,
)
from physicsnemo_foldcp.data.synthetic import make_complex

__all__ = [
    "BoltzInputError",
    "BoltzInputs",
    "EpochSampler",
    "FeatureFileDataset",
    "FeatureFileError",
    "FoldCPDataModule",
    "InferenceOrder",
    "LoaderConfigError",
    "MissingMoleculeError",
    "SerialLoaderError",
    "ShardedLoader",
    "ShardedSample",
    "SkipLimitError",
    "SkippedSample",
    "Step",
    "TrainingOrder",
    "list_sample_files",
    "load_sample",
    "make_complex",
    "save_sample",
    "validate_sample",
]


def __getattr__(name: str):
    if name == "FoldCPDataModule":
        from physicsnemo_foldcp.data.datamodule import FoldCPDataModule

        return FoldCPDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
