"""Boltz's own inputs (YAML / FASTA) as a serial dataset of Boltz-2 inference features.

:class:`BoltzInputs` runs Boltz's ``boltz.main.process_inputs`` on the inputs once, then
Boltz-2's inference dataset (``boltz.data.module.inferencev2.PredictionDataset``) and its
``collate`` per sample: each sample is the dict Boltz's ``predict`` feeds
``Boltz2.predict_step`` (every tensor ``[1, ...]``, ``record`` a list of one Boltz
``Record``), plus a ``record_id`` string, as the project's other datasets have.

Offline by construction
    Boltz is never asked to reach an MSA server. A protein chain needs ``msa: empty``
    (single-sequence mode) or an ``.a3m`` / ``.csv`` file; one without is refused before
    Boltz runs, naming the input and the chain. Residues and CCD ligands come from the
    molecule library (Boltz's cache layout, ``<CODE>.pkl``); a code missing there is a
    :class:`MissingMoleculeError` naming the code and the directory. SMILES ligands are
    built by RDKit.

MSA paths
    Boltz resolves a relative MSA path against the input file's directory; with
    ``msa_dir`` it is resolved against ``msa_dir`` instead. Absolute paths are kept.

The work directory
    Processing happens in ``<work_dir>/boltz_inputs_<key>/``, where ``<key>`` hashes what
    the processed files depend on: the inputs' text, the MSA files' paths, sizes and
    modification times, the molecule library's file names, sizes and modification times,
    the MSA depth limit and Boltz's version. A finished directory holds ``inputs/`` (the
    inputs as processed, with every relative path made absolute), Boltz's ``processed/``
    (``records``, ``structures``, ``msa``, ``constraints``, ``templates``, ``mols``,
    ``manifest.json``), its ``msa/`` and ``predictions/`` (empty: nothing is generated),
    and ``foldcp_inputs.json`` (what it was built from). It is made under a temporary
    name (``.partial``) and renamed when complete, with a lock file held meanwhile, so a
    directory by the final name is always complete and two jobs never write one directory.

    So a stale processed directory is never used: a changed input, MSA or library gives
    another key and is processed afresh, and the same inputs again reuse the finished
    directory without running Boltz. Nothing is deleted or rewritten except the project's
    own ``.partial`` directory of an interrupted run (recognised by its
    ``foldcp_inputs.json``); old ``boltz_inputs_*`` directories stay until the user removes
    them. Other files in ``work_dir`` (a ``boltz predict`` output, say) are not touched.

Processing under ``torchrun``
    Global rank 0 processes while every other rank waits in one broadcast, bounded by the
    job's collective timeout (``init_mesh(timeout_s=...)``, ``FOLDCP_TIMEOUT_S``); an
    error there is raised on every rank with its message. Many or large inputs can be
    processed beforehand on one process (the same constructor, no ``torchrun``): the run
    then finds the finished directory. The work directory must be visible to every rank
    (a shared file system across nodes); every rank reads the records from it, and one
    that cannot says so on every rank.

Randomness
    Boltz's featurizer turns each residue's reference conformer by a random rotation drawn
    from torch's global generator: see ``seed``. Boltz embeds a SMILES ligand's conformer
    with RDKit's unseeded ETKDG when it processes it, so the same SMILES processed twice
    has two reference conformers; a reused work directory keeps the first.

The library's ``.pkl`` files are pickles that Boltz unpickles: they run code as they load,
so point ``library_dir`` only at a library you trust (Boltz's own cache, or one made with
:func:`physicsnemo_foldcp.testing.boltz_library.write_library`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from physicsnemo_foldcp.distributed.errors import on_every_rank, on_rank_zero

INPUT_SUFFIXES = (".yaml", ".yml", ".fasta", ".fa", ".fas")
"""Suffixes of the input files Boltz parses (YAML and FASTA)."""

MSA_SUFFIXES = (".a3m", ".csv")
"""Suffixes of the MSA files Boltz reads."""

MARKER = "foldcp_inputs.json"
"""The file that marks a processing directory as the project's and says what it holds."""

_PREFIX = "boltz_inputs_"
_PARTIAL = ".partial"
_MISSING_CCD = re.compile(r"CCD component (?P<code>\S+) not found")


class BoltzInputError(ValueError):
    """An input Boltz cannot process offline (no MSA, a missing file, clashing record ids)."""


class MissingMoleculeError(BoltzInputError):
    """A CCD code whose molecule is not in the library; names the code and the directory.

    Parameters
    ----------
    code : str
        The CCD code.
    library_dir : str or Path
        The molecule directory searched (``<CODE>.pkl``).
    where : str, default ""
        The input or record that needs it.
    """

    def __init__(self, code: str, library_dir: str | Path, where: str = ""):
        self.code, self.library_dir, self.where = code, str(library_dir), where
        super().__init__(
            f"CCD code {code!r} is not in the molecule library {self.library_dir} (no "
            f"{Path(self.library_dir) / (code + '.pkl')})"
            + (f", needed by {where}" if where else "")
            + ". Add its molecule there in Boltz's cache layout (<CODE>.pkl, an RDKit Mol "
            "pickled with all properties), or give the ligand as SMILES; nothing is downloaded"
        )

    def __reduce__(self):
        return type(self), (self.code, self.library_dir, self.where)


def _missing_molecule(error: BaseException, library: Path, where: str) -> BaseException | None:
    """Boltz's "CCD component X not found!" as a :class:`MissingMoleculeError`, else ``None``."""
    found = _MISSING_CCD.search(str(error)) if isinstance(error, ValueError) else None
    return MissingMoleculeError(found["code"], library, where) if found else None


def molecule_dir(library_dir: str | Path) -> Path:
    """Boltz's molecule directory of ``library_dir``: itself, or its ``mols/`` when it has one.

    Parameters
    ----------
    library_dir : str or Path
        Boltz's cache directory (holding ``mols/``) or the molecule directory itself.

    Raises
    ------
    BoltzInputError
        When it is not a directory.
    """
    path = Path(library_dir).expanduser().resolve()
    if not path.is_dir():
        raise BoltzInputError(f"molecule library {path} is not a directory")
    return path / "mols" if (path / "mols").is_dir() else path


def input_files(inputs: str | Path) -> list[Path]:
    """The input files of ``inputs``: the file itself, or a directory's YAML / FASTA files.

    A directory's other files (MSAs, templates) and subdirectories are left out; the
    files are sorted by name, which is the dataset's order.

    Raises
    ------
    BoltzInputError
        When ``inputs`` does not exist, is a file of another kind, or is a directory with
        no input file; or when two inputs share a record id (the file name without suffix).
    """
    path = Path(inputs).expanduser().resolve()
    if path.is_dir():
        files = sorted(
            p for p in path.iterdir() if p.is_file() and p.suffix.lower() in INPUT_SUFFIXES
        )
        if not files:
            raise BoltzInputError(f"{path} holds no input file ({', '.join(INPUT_SUFFIXES)})")
    elif path.is_file():
        if path.suffix.lower() not in INPUT_SUFFIXES:
            raise BoltzInputError(
                f"{path}: Boltz parses {', '.join(INPUT_SUFFIXES)} files, not {path.suffix!r}"
            )
        files = [path]
    else:
        raise BoltzInputError(f"input {path} does not exist")
    stems: dict[str, Path] = {}
    for file in files:
        if file.stem in stems:
            raise BoltzInputError(
                f"{stems[file.stem]} and {file} give one record id {file.stem!r}: rename one"
            )
        stems[file.stem] = file
    return files


@dataclass(frozen=True)
class _Snapshot:
    """One input as processed: its text with every path absolute, and the MSAs it reads."""

    source: Path
    name: str
    text: str
    msas: tuple[Path, ...]


def _msa_path(value: str, where: str, base: Path) -> Path:
    path = Path(value).expanduser()
    path = (path if path.is_absolute() else base / path).resolve()
    if not path.is_file():
        raise BoltzInputError(f"{where}: MSA file {path} not found")
    if path.suffix not in MSA_SUFFIXES:
        raise BoltzInputError(
            f"{where}: MSA file {path} is not {' or '.join(MSA_SUFFIXES)}, which Boltz reads"
        )
    return path


def _no_msa(source: Path, chains: Any, fasta: bool) -> BoltzInputError:
    how = (
        "end its header with '|empty' (single-sequence mode) or '|<file>.a3m' / '|<file>.csv'"
        if fasta
        else "give it 'msa: empty' (single-sequence mode) or 'msa: <file>.a3m' / '<file>.csv'"
    )
    return BoltzInputError(
        f"{source}: protein chain {chains} has no MSA; {how}. MSAs are never fetched "
        "from a server here"
    )


def _yaml_snapshot(source: Path, msa_base: Path) -> _Snapshot:
    import yaml

    data = yaml.safe_load(source.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("sequences"), list):
        raise BoltzInputError(f"{source}: a Boltz YAML input needs a 'sequences' list")
    msas = []
    for item in data["sequences"]:
        if not isinstance(item, dict) or len(item) != 1:
            continue  # Boltz's parser says what is wrong with it
        kind, entity = next(iter(item.items()))
        if str(kind).lower() != "protein" or not isinstance(entity, dict):
            continue
        msa = entity.get("msa")
        if msa in (None, ""):
            raise _no_msa(source, entity.get("id"), fasta=False)
        if msa != "empty":
            path = _msa_path(str(msa), f"{source} (protein {entity.get('id')})", msa_base)
            entity["msa"] = str(path)
            msas.append(path)
    for template in data.get("templates") or ():
        for key in ("cif", "pdb"):
            if isinstance(template, dict) and isinstance(template.get(key), str):
                path = Path(template[key]).expanduser()
                template[key] = str(path if path.is_absolute() else (source.parent / path))
    text = yaml.safe_dump(data, sort_keys=False)
    return _Snapshot(source, source.name, text, tuple(msas))


def _fasta_snapshot(source: Path, msa_base: Path) -> _Snapshot:
    lines, msas = [], []
    for line in source.read_text().splitlines():
        if line.startswith(">"):
            head, _, rest = line[1:].partition(" ")
            fields = head.split("|")
            if len(fields) >= 2 and fields[1].lower() == "protein":
                msa = fields[2] if len(fields) > 2 else ""
                if msa == "":
                    raise _no_msa(source, fields[0], fasta=True)
                if msa != "empty":
                    path = _msa_path(msa, f"{source} (protein {fields[0]})", msa_base)
                    if any(c.isspace() for c in str(path)):
                        raise BoltzInputError(
                            f"{source}: MSA path {path} holds white space, which ends a "
                            "FASTA record id; move the MSA or use a YAML input"
                        )
                    fields[2] = str(path)
                    msas.append(path)
                line = ">" + "|".join(fields) + (" " + rest if rest else "")
        lines.append(line)
    return _Snapshot(source, source.name, "\n".join(lines) + "\n", tuple(msas))


def _snapshot(source: Path, msa_dir: Path | None) -> _Snapshot:
    base = msa_dir if msa_dir is not None else source.parent
    if source.suffix.lower() in (".yaml", ".yml"):
        return _yaml_snapshot(source, base)
    return _fasta_snapshot(source, base)


def _stat(path: Path) -> list[Any]:
    info = path.stat()
    return [str(path), info.st_size, info.st_mtime_ns]


def _library_listing(mol_dir: Path) -> list[list[Any]]:
    with os.scandir(mol_dir) as entries:
        listing = [
            [e.name, e.stat().st_size, e.stat().st_mtime_ns]
            for e in entries
            if e.name.endswith(".pkl")
        ]
    return sorted(listing)


def _boltz_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("boltz-community")
    except PackageNotFoundError:
        import boltz

        return str(getattr(boltz, "__version__", "unknown"))


def _description(snapshots: Sequence[_Snapshot], mol_dir: Path, max_msa_seqs: int) -> dict:
    """Everything the processed files depend on (hashed into the directory's key)."""
    return {
        "boltz": _boltz_version(),
        "library": str(mol_dir),
        "library_files": _library_listing(mol_dir),
        "max_msa_seqs": max_msa_seqs,
        "inputs": [
            {
                "source": str(s.source),
                "name": s.name,
                "sha256": hashlib.sha256(s.text.encode()).hexdigest(),
                "msas": [_stat(p) for p in s.msas],
            }
            for s in snapshots
        ],
    }


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (made when missing) while the block runs."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _is_ours(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def _process(snapshots: Sequence[_Snapshot], out_dir: Path, mol_dir: Path, max_msa_seqs: int):
    """Run Boltz's ``process_inputs`` on each snapshot in ``out_dir`` (offline)."""
    from boltz.main import process_inputs

    for snapshot in snapshots:
        path = out_dir / "inputs" / snapshot.name
        try:
            process_inputs(
                data=[path],
                out_dir=out_dir,
                ccd_path=mol_dir / "ccd.pkl",  # unused by Boltz-2 (it reads mol_dir)
                mol_dir=mol_dir,
                msa_server_url="",
                msa_pairing_strategy="greedy",
                max_msa_seqs=max_msa_seqs,
                use_msa_server=False,
                boltz2=True,
            )
        except Exception as err:
            missing = _missing_molecule(err, mol_dir, str(snapshot.source))
            if missing is not None:
                raise missing from err
            err.add_note(f"while Boltz processed {snapshot.source}")
            raise


def prepare_inputs(
    inputs: str | Path,
    library_dir: str | Path,
    work_dir: str | Path,
    *,
    msa_dir: str | Path | None = None,
    max_msa_seqs: int = 8192,
) -> tuple[Path, list[str]]:
    """Process the inputs with Boltz (one process), or find them processed.

    Parameters
    ----------
    inputs, library_dir, work_dir, msa_dir, max_msa_seqs
        See :class:`BoltzInputs`.

    Returns
    -------
    tuple[Path, list[str]]
        The processed directory (``<work_dir>/boltz_inputs_<key>/processed``) and the
        record ids, in input order.

    Raises
    ------
    BoltzInputError
        For an input Boltz cannot process offline (see :class:`BoltzInputs`);
        :class:`MissingMoleculeError` for a CCD code the library lacks. Boltz's own errors
        are raised as they are, with a note naming the input.
    """
    mol_dir = molecule_dir(library_dir)
    base = None if msa_dir is None else Path(msa_dir).expanduser().resolve()
    if base is not None and not base.is_dir():
        raise BoltzInputError(f"MSA directory {base} is not a directory")
    snapshots = [_snapshot(f, base) for f in input_files(inputs)]
    description = _description(snapshots, mol_dir, max_msa_seqs)
    key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
    work = Path(work_dir).expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    final = work / f"{_PREFIX}{key}"
    ids = [Path(s.name).stem for s in snapshots]
    with _locked(work / f"{_PREFIX}{key}.lock"):
        if not final.exists():
            partial = work / f"{_PREFIX}{key}{_PARTIAL}"
            if partial.exists():
                if not _is_ours(partial):
                    raise BoltzInputError(
                        f"{partial} exists and was not made by this project; move it away"
                    )
                shutil.rmtree(partial)  # an interrupted run of ours: start it over
            (partial / "inputs").mkdir(parents=True)
            (partial / MARKER).write_text(json.dumps(description, indent=1) + "\n")
            for snapshot in snapshots:
                (partial / "inputs" / snapshot.name).write_text(snapshot.text)
            _process(snapshots, partial, mol_dir, max_msa_seqs)
            partial.rename(final)
        elif not _is_ours(final):
            raise BoltzInputError(f"{final} exists and was not made by this project; move it away")
    processed = final / "processed"
    missing = [i for i in ids if not (processed / "records" / f"{i}.json").is_file()]
    if missing:
        raise BoltzInputError(f"{processed} holds no record of {missing}")
    return processed, ids


class BoltzInputs(Dataset):
    """Boltz YAML / FASTA inputs as Boltz-2 inference features, one sample per record.

    Sample ``i`` is what Boltz's ``Boltz2InferenceDataModule`` predict loader yields for
    record ``i`` (Boltz-2's ``PredictionDataset`` item through its ``collate``): every
    tensor ``[1, ...]`` (atoms padded to whole 32-atom windows by Boltz's featurizer),
    ``record`` a list of one ``boltz.data.types.Record``, plus ``record_id`` (the input's
    file name without suffix). Construction processes the inputs (see the module's
    description: once, on global rank 0, in a work directory keyed by what they depend
    on); call it on every rank. Samples are featurized when fetched, on the ranks that
    fetch them.

    Parameters
    ----------
    inputs : str or Path
        A Boltz YAML (``.yaml`` / ``.yml``) or FASTA (``.fasta`` / ``.fa`` / ``.fas``)
        file, or a directory of them (other files in it are left out).
    library_dir : str or Path
        Boltz's molecule directory (``<CODE>.pkl`` per CCD code: the amino acids and
        ``UNK``, the DNA and RNA residues, any CCD ligand or modified residue used), or the
        cache directory that holds it as ``mols/``.
    work_dir : str or Path
        Where the processed files go (``boltz_inputs_<key>/``); made when missing.
    msa_dir : str or Path, optional
        Directory that relative MSA paths of the inputs are resolved against; ``None``:
        each input's own directory, as Boltz does.
    max_msa_seqs : int, default 8192
        MSA rows Boltz keeps when it reads an MSA file (its ``--max_msa_seqs``).
    method : str, optional
        Boltz-2's method conditioning (its ``--method``, e.g. ``"x-ray diffraction"``);
        ``None``: none.
    seed : int or None, default 0
        Boltz's featurizer turns each residue's reference conformer (``ref_pos``) by a
        random rotation drawn from torch's global generator. With a seed, sample ``i`` is
        featurized with that generator seeded to ``seed + i`` and restored afterwards, so
        a sample is the same on every mesh, rank and loader worker; ``None`` draws from
        the generator as it is, as Boltz's own loader does.

    Attributes
    ----------
    processed_dir : Path
        Boltz's ``processed/`` directory (``structures/<record_id>.npz`` for its writer,
        ``records``, ``msa``, ``constraints``, ``templates``, ``mols``, ``manifest.json``).
    mol_dir : Path
        The molecule directory read.
    records : list
        The Boltz ``Record`` of every sample, in order.

    Raises
    ------
    BoltzInputError
        On every rank, for an input that cannot run offline: a protein chain without an
        MSA (neither ``msa: empty`` nor a file), an MSA file that does not exist, no input
        file, two inputs with one record id.
    MissingMoleculeError
        On every rank, for a CCD code that is not in the library (a ``BoltzInputError``).
    """

    def __init__(
        self,
        inputs: str | Path,
        library_dir: str | Path,
        work_dir: str | Path,
        *,
        msa_dir: str | Path | None = None,
        max_msa_seqs: int = 8192,
        method: str | None = None,
        seed: int | None = 0,
    ):
        if max_msa_seqs < 1:
            raise ValueError(f"max_msa_seqs must be >= 1, got {max_msa_seqs}")
        self.inputs = Path(inputs)
        self.mol_dir = on_every_rank(lambda: molecule_dir(library_dir), "reading the library")
        self.method = method
        self.seed = seed
        self.processed_dir, ids = on_rank_zero(
            lambda: prepare_inputs(
                inputs, library_dir, work_dir, msa_dir=msa_dir, max_msa_seqs=max_msa_seqs
            ),
            "processing the Boltz inputs",
        )
        self.records = on_every_rank(lambda: self._read_records(ids), "reading the records")
        self._features: Any = None

    def _read_records(self, ids: Sequence[str]) -> list[Any]:
        from boltz.data.types import Record

        folder = self.processed_dir / "records"
        if not folder.is_dir():
            raise BoltzInputError(
                f"{folder} is not visible on this rank: the work directory must be on a "
                "file system every rank reads"
            )
        return [Record.load(folder / f"{i}.json") for i in ids]

    @property
    def structures_dir(self) -> Path:
        """``processed/structures``: ``<record_id>.npz`` per record, which Boltz's writer reads."""
        return self.processed_dir / "structures"

    def __len__(self) -> int:
        return len(self.records)

    def record_id(self, index: int) -> str:
        """The record id of sample ``index`` (the input's file name without suffix)."""
        return self.records[index].id

    def _boltz_dataset(self) -> Any:
        """Boltz-2's ``PredictionDataset`` over the records, as its predict loader builds it."""
        if self._features is None:
            from boltz.data.module.inferencev2 import PredictionDataset
            from boltz.data.types import Manifest

            processed = self.processed_dir
            try:
                self._features = PredictionDataset(
                    manifest=Manifest(list(self.records)),
                    target_dir=processed / "structures",
                    msa_dir=processed / "msa",
                    mol_dir=self.mol_dir,
                    constraints_dir=processed / "constraints",
                    template_dir=processed / "templates",
                    extra_mols_dir=processed / "mols",
                    override_method=self.method,
                )
            except ValueError as err:
                missing = _missing_molecule(err, self.mol_dir, "Boltz's canonical residues")
                if missing is not None:
                    raise missing from err
                raise
        return self._features

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} records")
        from boltz.data.module.inferencev2 import collate

        features = self._boltz_dataset()
        try:
            if self.seed is None:
                sample = features[index]
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(self.seed + index)
                    sample = features[index]
        except ValueError as err:
            missing = _missing_molecule(err, self.mol_dir, f"record {self.record_id(index)!r}")
            if missing is not None:
                raise missing from err
            raise
        out = collate([sample])
        out["record_id"] = self.record_id(index)
        return out

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers build their own Boltz dataset (it holds RDKit molecules).
        return {**self.__dict__, "_features": None}

    def __repr__(self) -> str:
        return (
            f"BoltzInputs({len(self)} records from {self.inputs}, processed in "
            f"{self.processed_dir})"
        )


__all__ = [
    "INPUT_SUFFIXES",
    "MARKER",
    "MSA_SUFFIXES",
    "BoltzInputError",
    "BoltzInputs",
    "MissingMoleculeError",
    "input_files",
    "molecule_dir",
    "prepare_inputs",
]
