"""Deterministic synthetic Boltz-1 / Boltz-2 feature dicts for one complex, unbatched.

:func:`make_complex` returns what a Boltz featurizer returns for one sample at inference
(``BoltzFeaturizer.process`` for ``"boltz1"``, ``Boltz2Featurizer.process`` for
``"boltz2"``, both with constraint features on), built from a random but chemically
plausible complex: protein chains (a homodimer when large enough), a DNA duplex, an RNA
chain and small ligands, one of them covalently bound to a protein residue.

Conventions (shared with Boltz):

* tokens are ordered chain by chain; a protein / nucleic residue is one token, a ligand
  heavy atom is one token; the atoms of a token are contiguous on the atom axis, in token
  order;
* ``token_to_center_atom`` / ``r_set_to_rep_atom`` pick the center atom (``CA``, ``C1'``,
  the ligand atom); ``token_to_rep_atom`` and ``disto_center`` use the distogram atom
  (``CB``, ``CA`` for glycine, ``C4`` for purines, ``C2`` for pyrimidines, the ligand
  atom);
* ``coords`` are centered on the resolved atoms of each conformer; ``disto_center`` and
  ``disto_coords_ensemble`` keep the raw frame (as Boltz does), so only their pairwise
  distances agree with ``coords``;
* padding value 0 everywhere, except ``msa`` whose pad is ``"-"`` (id 1): for Boltz-1,
  whose ``msa`` is one-hot, padded token columns are all ones, as Boltz pads the one-hot
  tensor itself with 1;
* ``r_set_to_rep_atom`` gets ``max_tokens - N`` zero rows appended when token padding is
  asked for (Boltz pads its first axis like a token axis).

Every value is a ``torch.Tensor``. All randomness comes from one local
:class:`torch.Generator` seeded with ``seed``; both presets draw the same complex for the
same arguments (same chains, coordinates, MSA), only the emitted features differ.

The generator is split by feature family, one module each: :mod:`.vocab` (Boltz's ids and
class counts), :mod:`.residues` (residue chemistry tables), :mod:`.chains` (composition
and chains), :mod:`.ligands` (ligand graphs), :mod:`.tokens`, :mod:`.atoms` (layouts,
maps, reference conformers), :mod:`.structure` (coordinates), :mod:`.pairs` (bonds,
distogram), :mod:`.frames`, :mod:`.msa`, :mod:`.constraints` (conditioning and
constraint lists), :mod:`.templates`, :mod:`.keys` (keys per preset), and
:mod:`.complex`, which assembles them.
"""

from physicsnemo_foldcp.data.synthetic.chains import chains_of
from physicsnemo_foldcp.data.synthetic.complex import make_complex
from physicsnemo_foldcp.data.synthetic.keys import PRESET_KEYS
from physicsnemo_foldcp.data.synthetic.residues import ATOMS_PER_RESIDUE, RESIDUE_ATOM_NAMES
from physicsnemo_foldcp.data.synthetic.vocab import DISTO_BOUNDARIES, MOL_TYPE_IDS, TOKEN_IDS

__all__ = [
    "ATOMS_PER_RESIDUE",
    "DISTO_BOUNDARIES",
    "MOL_TYPE_IDS",
    "PRESET_KEYS",
    "RESIDUE_ATOM_NAMES",
    "TOKEN_IDS",
    "chains_of",
    "make_complex",
]
