"""Boltz's YAML / FASTA inputs through Boltz's own processing and Boltz-2 inference featurizer.

The complex: a 19-residue protein, a 5-residue DNA, a 7-residue RNA and benzene (SMILES),
37 tokens, offline (``msa: empty`` or a given ``.a3m``) with a molecule library built by
RDKit (``testing/boltz_library.py``). Each sample must equal, key by key, what Boltz's
``Boltz2InferenceDataModule`` predict loader yields for the same processed record, and
survive the scatter with the ``boltz2`` registry.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import physicsnemo_foldcp as fc
from physicsnemo_foldcp.data.boltz_inputs import (
    MARKER,
    BoltzInputError,
    BoltzInputs,
    MissingMoleculeError,
)
from physicsnemo_foldcp.features import FeatureRegistry
from physicsnemo_foldcp.testing import collective_assert

pytest.importorskip("boltz.main")

PROTEIN = "MKTAYIAKQRQISFVKSHF"
DNA = "ACGTA"
RNA = "GCAUAGC"
LIGAND = "c1ccccc1"
N_TOKENS = len(PROTEIN) + len(DNA) + len(RNA) + 6

COMPLEX_YAML = f"""version: 1
sequences:
  - protein:
      id: A
      sequence: {PROTEIN}
      msa: {{msa}}
  - dna:
      id: B
      sequence: {DNA}
  - rna:
      id: C
      sequence: {RNA}
  - ligand:
      id: D
      smiles: '{LIGAND}'
"""

COMPLEX_FASTA = f""">A|protein|{{msa}}
{PROTEIN}
>B|dna
{DNA}
>C|rna
{RNA}
>D|smiles
{LIGAND}
"""

# The query, then two aligned rows (a gap, a deletion in lower case, a substitution).
A3M = f""">query
{PROTEIN}
>hit1
{PROTEIN[:4]}-{PROTEIN[5:12]}k{PROTEIN[12:]}
>hit2
{"W" + PROTEIN[1:]}
"""


def write_input(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


def boltz_loader_batch(dataset: BoltzInputs, index: int) -> dict:
    """Boltz's own predict-loader batch of record ``index``, from the dataset's processed dir.

    Torch's generator is seeded as the dataset seeds it for that sample (its draws turn the
    reference conformers) after the loader's iterator has drawn its own base seed, so the
    featurizer sees the same stream.
    """
    from boltz.data.module.inferencev2 import Boltz2InferenceDataModule
    from boltz.data.types import Manifest

    processed = dataset.processed_dir
    module = Boltz2InferenceDataModule(
        manifest=Manifest([dataset.records[index]]),
        target_dir=processed / "structures",
        msa_dir=processed / "msa",
        mol_dir=dataset.mol_dir,
        num_workers=0,
        constraints_dir=processed / "constraints",
        template_dir=processed / "templates",
        extra_mols_dir=processed / "mols",
        pin_memory=False,
    )
    batches = iter(module.predict_dataloader())
    torch.manual_seed(dataset.seed + index)
    batch = next(batches)
    assert next(batches, None) is None
    return batch


def differences(got: dict, expected: dict) -> list[str]:
    """Keys whose values differ (tensors by ``torch.equal`` and dtype, others by ``==``)."""
    out = sorted(set(got) ^ set(expected))
    for key in sorted(set(got) & set(expected)):
        a, b = got[key], expected[key]
        if isinstance(b, torch.Tensor):
            same = isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        else:
            same = a == b
        if not same:
            out.append(key)
    return out


@pytest.fixture(scope="module")
def complex_dataset(tmp_path_factory, boltz_library):
    """The complex as a YAML input (``msa: empty``), processed once for the module."""
    root = tmp_path_factory.mktemp("boltz_inputs")
    path = write_input(root / "in", "complex.yaml", COMPLEX_YAML.format(msa="empty"))
    return BoltzInputs(path, boltz_library.parent, root / "work")


@pytest.fixture(scope="module")
def complex_sample(complex_dataset):
    return complex_dataset[0]


@pytest.fixture(scope="module")
def one_process_mesh():
    """A one-process job (1x1 domain mesh)."""
    mesh = fc.init_mesh()
    yield mesh
    fc.shutdown()


def test_a_sample_is_what_boltz_predict_loader_yields(complex_dataset, complex_sample):
    """Every key equal to Boltz's own loader's, the record included, plus ``record_id``."""
    expected = boltz_loader_batch(complex_dataset, 0)
    sample = dict(complex_sample)
    assert sample.pop("record_id") == "complex" == complex_dataset.record_id(0)
    assert differences(sample, expected) == []
    assert [r.id for r in sample["record"]] == ["complex"]
    assert sample["token_pad_mask"].shape == (1, N_TOKENS)
    atoms = sample["atom_pad_mask"].shape[1]
    assert atoms % 32 == 0 and sample["atom_pad_mask"][0, -1] == 0  # whole atom windows
    assert (complex_dataset.structures_dir / "complex.npz").is_file()


def test_every_tensor_key_is_in_the_boltz2_registry(complex_sample):
    registry = FeatureRegistry.preset("boltz2")
    tensors = [k for k, v in complex_sample.items() if isinstance(v, torch.Tensor)]
    assert [k for k in tensors if k not in registry] == []
    assert sorted(set(complex_sample) - set(tensors)) == ["record", "record_id"]


def test_the_sample_scatters_and_gathers_back_exactly(complex_sample, one_process_mesh):
    """On a 1x1 mesh with the boltz2 registry; ``record`` passes through as it is."""
    sharded = fc.scatter_features(
        complex_sample, one_process_mesh, registry=FeatureRegistry.preset("boltz2")
    )
    assert sharded["record"] == complex_sample["record"]
    assert differences(fc.gather_features(sharded), complex_sample) == []


def test_the_loader_with_a_worker_gives_the_same_sample(complex_dataset, one_process_mesh):
    """A DataLoader worker featurizes the record itself (seeded per sample): same sample."""
    from physicsnemo_foldcp.data import ShardedLoader

    loader = ShardedLoader(complex_dataset, one_process_mesh, mode="inference", num_workers=1)
    (item,) = list(loader)
    assert item.record_id == "complex"
    assert differences(fc.gather_features(item.features), complex_dataset[0]) == []


def test_the_same_inputs_reuse_the_processed_directory(complex_dataset, boltz_library):
    """No second run of Boltz: the finished directory is found; nothing else is made."""
    work = complex_dataset.processed_dir.parent.parent
    before = sorted(p.name for p in work.iterdir())
    again = BoltzInputs(complex_dataset.inputs, boltz_library.parent, work)
    assert again.processed_dir == complex_dataset.processed_dir
    assert sorted(p.name for p in work.iterdir()) == before
    assert (complex_dataset.processed_dir.parent / MARKER).is_file()


def test_a_changed_input_is_processed_afresh_and_the_old_files_stay(tmp_path, boltz_library):
    source = write_input(tmp_path / "in", "x.yaml", COMPLEX_YAML.format(msa="empty"))
    mine = write_input(tmp_path / "work" / "processed" / "records", "mine.json", "{}")
    first = BoltzInputs(source, boltz_library, tmp_path / "work")
    structure = first.structures_dir / "x.npz"
    stamp = structure.stat().st_mtime_ns
    source.write_text(COMPLEX_YAML.format(msa="empty").replace(DNA, DNA + "C"))
    second = BoltzInputs(source, boltz_library, tmp_path / "work")
    assert second.processed_dir != first.processed_dir
    assert second[0]["token_pad_mask"].shape == (1, N_TOKENS + 1)
    assert structure.stat().st_mtime_ns == stamp and mine.read_text() == "{}"


def test_a_missing_ccd_code_names_the_code_and_the_library(tmp_path, boltz_library):
    from physicsnemo_foldcp.testing.boltz_library import LIBRARY_CODES, write_library

    library = write_library(tmp_path / "cache", [c for c in LIBRARY_CODES if c != "DT"])
    source = write_input(tmp_path / "in", "x.yaml", COMPLEX_YAML.format(msa="empty"))
    with pytest.raises(MissingMoleculeError) as info:
        BoltzInputs(source, library, tmp_path / "work")
    message = str(info.value)
    assert "'DT'" in message and str(library) in message and str(source) in message
    assert info.value.code == "DT" and info.value.library_dir == str(library)
    ligand = COMPLEX_YAML.format(msa="empty") + "  - ligand:\n      id: E\n      ccd: ATP\n"
    source.write_text(ligand)
    with pytest.raises(MissingMoleculeError, match=r"'ATP' is not in the molecule library"):
        BoltzInputs(source, boltz_library, tmp_path / "work")


def test_a_fasta_input_gives_the_features_of_the_same_yaml(tmp_path, complex_sample, boltz_library):
    """Equal to the YAML's sample but for the ligand's reference conformer, which Boltz embeds
    with RDKit's unseeded ETKDG each time it processes a SMILES."""
    source = write_input(tmp_path / "in", "complex.fasta", COMPLEX_FASTA.format(msa="empty"))
    dataset = BoltzInputs(source, boltz_library, tmp_path / "work")
    sample = dataset[0]
    assert differences(sample, {**boltz_loader_batch(dataset, 0), "record_id": "complex"}) == []
    assert differences(sample, complex_sample) == ["ref_pos"]
    ligand_atoms = (sample["atom_to_token"][0].float() @ (sample["mol_type"][0] == 3).float()) > 0
    assert int(ligand_atoms.sum()) == 6
    polymer = ~ligand_atoms
    assert torch.equal(sample["ref_pos"][0, polymer], complex_sample["ref_pos"][0, polymer])


@pytest.mark.parametrize("kind", ["yaml", "fasta"])
def test_a_given_a3m_msa_is_read_from_the_msa_dir(tmp_path, boltz_library, kind):
    """A relative MSA path is looked up in ``msa_dir``; its rows become the MSA features."""
    from boltz.data import const
    from boltz.data.types import MSA

    write_input(tmp_path / "msas", "prot.a3m", A3M)
    text = (COMPLEX_YAML if kind == "yaml" else COMPLEX_FASTA).format(msa="prot.a3m")
    source = write_input(tmp_path / "in", f"x.{kind}", text)
    dataset = BoltzInputs(source, boltz_library, tmp_path / "work", msa_dir=tmp_path / "msas")
    sample = dataset[0]
    assert differences(sample, {**boltz_loader_batch(dataset, 0), "record_id": "x"}) == []
    msa = sample["msa"][0]
    assert msa.shape == (3, N_TOKENS)
    letters = [
        "".join(const.prot_token_to_letter.get(const.tokens[t], "-") for t in row[:19])
        for row in msa.tolist()
    ]
    assert letters == [PROTEIN, PROTEIN[:4] + "-" + PROTEIN[5:], "W" + PROTEIN[1:]]
    parsed = MSA.load(dataset.processed_dir / "msa" / "x_0.npz")  # Boltz's parse of the file
    assert [tuple(d) for d in parsed.deletions.tolist()] == [(12, 1)]  # the lower-case k


def test_a_protein_without_an_msa_is_refused_offline(tmp_path, boltz_library):
    no_msa = COMPLEX_YAML.format(msa="empty").replace("      msa: empty\n", "")
    source = write_input(tmp_path / "in", "x.yaml", no_msa)
    with pytest.raises(BoltzInputError, match=r"x\.yaml: protein chain A has no MSA.*msa: empty"):
        BoltzInputs(source, boltz_library, tmp_path / "work")
    fasta = write_input(tmp_path / "in2", "y.fasta", COMPLEX_FASTA.format(msa=""))
    with pytest.raises(BoltzInputError, match=r"y\.fasta: protein chain A has no MSA.*\|empty"):
        BoltzInputs(fasta, boltz_library, tmp_path / "work")
    missing = write_input(tmp_path / "in3", "z.yaml", COMPLEX_YAML.format(msa="nowhere.a3m"))
    with pytest.raises(BoltzInputError, match=r"MSA file .*nowhere\.a3m not found"):
        BoltzInputs(missing, boltz_library, tmp_path / "work")
    assert not list((tmp_path / "work").glob("boltz_inputs_*/"))


@pytest.mark.parametrize("app", ["predict", "train"])
def test_the_data_group_builds_the_dataset(app, complex_dataset, boltz_library):
    """``data=boltz_inputs``: the apps' dataset builder gives the same (already processed) data."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from physicsnemo_foldcp.training.config import BoltzInputsDataConfig, build_dataset, data_config

    work = complex_dataset.processed_dir.parent.parent
    overrides = [
        "data=boltz_inputs",
        f"data.inputs={complex_dataset.inputs}",
        f"data.library_dir={boltz_library}",
        f"data.work_dir={work}",
    ]
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        data = compose(config_name=app, overrides=overrides).data
        missing = compose(config_name=app, overrides=overrides[:1]).data
    assert data_config(data) == BoltzInputsDataConfig(
        inputs=str(complex_dataset.inputs), library_dir=str(boltz_library), work_dir=str(work)
    )
    dataset = build_dataset(data)
    assert isinstance(dataset, BoltzInputs) and len(dataset) == 1
    assert dataset.processed_dir == complex_dataset.processed_dir
    with pytest.raises(ValueError, match=r"data.inputs needs a value"):
        data_config(missing)
    for option, value in (("max_msa_seqs", 0), ("seed", -1), ("num_workers", -1)):
        with pytest.raises(ValueError, match=rf"data.{option}={value} is out of range"):
            data_config({**OmegaConf.to_container(data), option: value})


@pytest.mark.multigpu_static
@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=["1x2x2"])
def test_rank_zero_processes_and_every_rank_gets_the_sample(fold_mesh, shared_dir):
    """One processed directory for the job; its sample scatters on 2x2 and gathers back;
    a missing CCD code is raised on every rank."""
    from physicsnemo_foldcp.testing.boltz_library import LIBRARY_CODES, write_library

    if dist.get_rank() == 0:
        write_library(shared_dir / "cache")
        write_library(shared_dir / "partial", [c for c in LIBRARY_CODES if c != "DA"])
        write_input(shared_dir / "in", "c.yaml", COMPLEX_YAML.format(msa="empty"))
    dist.barrier()
    dataset = BoltzInputs(shared_dir / "in", shared_dir / "cache", shared_dir / "work")
    dirs = [None] * dist.get_world_size()
    dist.all_gather_object(dirs, str(dataset.processed_dir))
    made = sorted(p.name for p in (shared_dir / "work").glob("boltz_inputs_*") if p.is_dir())
    collective_assert(len(set(dirs)) == 1 and len(made) == 1, f"{dirs}, {made}")
    serial = dataset[0] if fold_mesh.is_domain_source else None
    sharded = fc.scatter_features(serial, fold_mesh, registry=FeatureRegistry.preset("boltz2"))
    gathered = fc.gather_features(sharded)
    same = differences(gathered, serial) == [] if fold_mesh.is_domain_source else True
    collective_assert(same, "the gathered sample differs from the serial one")
    raised = None
    try:
        BoltzInputs(shared_dir / "in", shared_dir / "partial", shared_dir / "work")
    except MissingMoleculeError as err:
        raised = str(err)
    collective_assert(raised is not None and "'DA'" in raised, f"rank raised {raised!r}")
    # The failed run left only its own .partial directory; the finished one is unchanged.
    dirs = sorted(p.name for p in (shared_dir / "work").glob("boltz_inputs_*") if p.is_dir())
    finished = [d for d in dirs if not d.endswith(".partial")]
    marker = json.loads((shared_dir / "work" / made[0] / MARKER).read_text())
    collective_assert(
        finished == made and len(dirs) == 2 and marker["inputs"][0]["name"] == "c.yaml",
        f"work directory holds {dirs}",
    )
