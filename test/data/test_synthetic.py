"""Tests of the synthetic Boltz feature generator (single process, CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from physicsnemo_foldcp.data.synthetic import (
    ATOMS_PER_RESIDUE,
    PRESET_KEYS,
    RESIDUE_ATOM_NAMES,
    TOKEN_IDS,
    chains_of,
    make_complex,
)

# Boltz residue-token vocabulary (boltz/data/const.py ``tokens``), written out here.
VOCAB = [
    "<pad>",
    "-",
    "ALA",
    "ARG",
    "ASN",
    "ASP",
    "CYS",
    "GLN",
    "GLU",
    "GLY",
    "HIS",
    "ILE",
    "LEU",
    "LYS",
    "MET",
    "PHE",
    "PRO",
    "SER",
    "THR",
    "TRP",
    "TYR",
    "VAL",
    "UNK",
    "A",
    "G",
    "C",
    "U",
    "N",
    "DA",
    "DG",
    "DC",
    "DT",
    "DN",
]

# Heavy atoms per standard residue (no hydrogens, no terminal OXT; nucleotides with phosphate).
HEAVY_ATOMS = {
    "ALA": 5,
    "ARG": 11,
    "ASN": 8,
    "ASP": 8,
    "CYS": 6,
    "GLN": 9,
    "GLU": 9,
    "GLY": 4,
    "HIS": 10,
    "ILE": 8,
    "LEU": 8,
    "LYS": 9,
    "MET": 8,
    "PHE": 11,
    "PRO": 7,
    "SER": 6,
    "THR": 7,
    "TRP": 14,
    "TYR": 12,
    "VAL": 7,
    "A": 22,
    "G": 23,
    "C": 20,
    "U": 20,
    "DA": 21,
    "DG": 22,
    "DC": 19,
    "DT": 20,
}

PROTEIN, DNA, RNA, LIGAND = 0, 1, 2, 3

COMMON_KEYS = {
    "token_index",
    "residue_index",
    "asym_id",
    "entity_id",
    "sym_id",
    "mol_type",
    "res_type",
    "disto_center",
    "token_bonds",
    "token_pad_mask",
    "token_resolved_mask",
    "token_disto_mask",
    "cyclic_period",
    "ref_pos",
    "atom_resolved_mask",
    "ref_element",
    "ref_charge",
    "ref_atom_name_chars",
    "ref_space_uid",
    "coords",
    "atom_pad_mask",
    "atom_to_token",
    "token_to_rep_atom",
    "r_set_to_rep_atom",
    "disto_target",
    "frames_idx",
    "frame_resolved_mask",
    "msa",
    "msa_paired",
    "deletion_value",
    "has_deletion",
    "deletion_mean",
    "profile",
    "msa_mask",
    "rdkit_bounds_index",
    "rdkit_bounds_bond_mask",
    "rdkit_bounds_angle_mask",
    "rdkit_upper_bounds",
    "rdkit_lower_bounds",
    "chiral_atom_index",
    "chiral_reference_mask",
    "chiral_atom_orientations",
    "stereo_bond_index",
    "stereo_reference_mask",
    "stereo_bond_orientations",
    "planar_bond_index",
    "planar_ring_5_index",
    "planar_ring_6_index",
    "connected_chain_index",
    "connected_atom_index",
    "symmetric_chain_index",
}
EXPECTED_KEYS = {
    "boltz1": COMMON_KEYS | {"pocket_feature"},
    "boltz2": COMMON_KEYS
    | {
        "type_bonds",
        "contact_conditioning",
        "contact_threshold",
        "method_feature",
        "modified",
        "affinity_token_mask",
        "ref_chirality",
        "atom_backbone_feat",
        "token_to_center_atom",
        "disto_coords_ensemble",
        "bfactor",
        "plddt",
        "template_restype",
        "template_frame_rot",
        "template_frame_t",
        "template_cb",
        "template_ca",
        "template_mask_cb",
        "template_mask_frame",
        "template_mask",
        "query_to_template",
        "visibility_ids",
        "ensemble_ref_idxs",
        "contact_pair_index",
        "contact_union_index",
        "contact_negation_mask",
        "contact_thresholds",
    },
}

L, F, B, I8, I32 = torch.long, torch.float32, torch.bool, torch.int8, torch.int32
DTYPES_COMMON = {
    "token_index": L,
    "residue_index": L,
    "asym_id": L,
    "entity_id": L,
    "sym_id": L,
    "mol_type": L,
    "res_type": L,
    "disto_center": F,
    "token_bonds": F,
    "token_pad_mask": F,
    "token_resolved_mask": F,
    "token_disto_mask": F,
    "ref_pos": F,
    "atom_resolved_mask": B,
    "ref_element": L,
    "ref_atom_name_chars": L,
    "ref_space_uid": L,
    "coords": F,
    "atom_pad_mask": F,
    "atom_to_token": L,
    "token_to_rep_atom": L,
    "r_set_to_rep_atom": L,
    "frames_idx": L,
    "frame_resolved_mask": B,
    "msa": L,
    "msa_paired": F,
    "deletion_value": F,
    "has_deletion": B,
    "deletion_mean": F,
    "profile": F,
    "msa_mask": L,
    "rdkit_bounds_index": L,
    "rdkit_bounds_bond_mask": B,
    "rdkit_bounds_angle_mask": B,
    "rdkit_upper_bounds": F,
    "rdkit_lower_bounds": F,
    "chiral_atom_index": L,
    "chiral_reference_mask": B,
    "chiral_atom_orientations": B,
    "stereo_bond_index": L,
    "stereo_reference_mask": B,
    "stereo_bond_orientations": B,
    "planar_bond_index": L,
    "planar_ring_5_index": L,
    "planar_ring_6_index": L,
    "connected_chain_index": L,
    "connected_atom_index": L,
    "symmetric_chain_index": L,
}
DTYPES = {
    "boltz1": DTYPES_COMMON
    | {"pocket_feature": L, "cyclic_period": I32, "ref_charge": I8, "disto_target": L},
    "boltz2": DTYPES_COMMON
    | {
        "cyclic_period": F,
        "ref_charge": F,
        "disto_target": F,
        "type_bonds": L,
        "contact_conditioning": L,
        "contact_threshold": F,
        "method_feature": L,
        "modified": L,
        "affinity_token_mask": F,
        "ref_chirality": L,
        "atom_backbone_feat": L,
        "token_to_center_atom": L,
        "disto_coords_ensemble": F,
        "bfactor": F,
        "plddt": F,
        "template_restype": L,
        "template_frame_rot": F,
        "template_frame_t": F,
        "template_cb": F,
        "template_ca": F,
        "template_mask_cb": F,
        "template_mask_frame": F,
        "template_mask": F,
        "query_to_template": L,
        "visibility_ids": F,
        "ensemble_ref_idxs": L,
        "contact_pair_index": L,
        "contact_union_index": L,
        "contact_negation_mask": B,
        "contact_thresholds": F,
    },
}

# Leading index-list widths of the constraint features.
LIST_WIDTHS = {
    "rdkit_bounds_index": 2,
    "chiral_atom_index": 4,
    "stereo_bond_index": 4,
    "planar_bond_index": 6,
    "planar_ring_5_index": 5,
    "planar_ring_6_index": 6,
    "connected_chain_index": 2,
    "connected_atom_index": 2,
    "symmetric_chain_index": 2,
    "contact_pair_index": 2,
}
LIST_VALUES = {
    "rdkit_bounds_index": [
        "rdkit_bounds_bond_mask",
        "rdkit_bounds_angle_mask",
        "rdkit_upper_bounds",
        "rdkit_lower_bounds",
    ],
    "chiral_atom_index": ["chiral_reference_mask", "chiral_atom_orientations"],
    "stereo_bond_index": ["stereo_reference_mask", "stereo_bond_orientations"],
    "contact_pair_index": ["contact_union_index", "contact_negation_mask", "contact_thresholds"],
}
LIGAND_ATOM_LISTS = [
    "rdkit_bounds_index",
    "chiral_atom_index",
    "stereo_bond_index",
    "planar_bond_index",
    "planar_ring_5_index",
    "planar_ring_6_index",
]


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def sizes(f: dict[str, torch.Tensor], preset: str) -> dict[str, int]:
    out = {
        "N": f["token_pad_mask"].shape[0],
        "A": f["atom_pad_mask"].shape[0],
        "S": f["msa_mask"].shape[0],
        "E": f["coords"].shape[0],
        "R": f["r_set_to_rep_atom"].shape[0],
    }
    if preset == "boltz2":
        out["K"] = f["ensemble_ref_idxs"].shape[0]
        out["T"] = f["template_mask"].shape[0]
    return out


def expected_shapes(z: dict[str, int], preset: str) -> dict[str, tuple[int, ...]]:
    n, a, s, e, r = z["N"], z["A"], z["S"], z["E"], z["R"]
    shapes = {
        **{
            k: (n,)
            for k in (
                "token_index",
                "residue_index",
                "asym_id",
                "entity_id",
                "sym_id",
                "mol_type",
                "token_pad_mask",
                "token_resolved_mask",
                "token_disto_mask",
                "cyclic_period",
                "deletion_mean",
            )
        },
        "res_type": (n, 33),
        "profile": (n, 33),
        "disto_center": (n, 3),
        "token_bonds": (n, n, 1),
        "ref_pos": (a, 3),
        "ref_element": (a, 128),
        "ref_atom_name_chars": (a, 4, 64),
        "ref_charge": (a,),
        "ref_space_uid": (a,),
        "atom_resolved_mask": (a,),
        "atom_pad_mask": (a,),
        "coords": (e, a, 3),
        "atom_to_token": (a, n),
        "token_to_rep_atom": (n, a),
        "r_set_to_rep_atom": (r, a),
        "msa_paired": (s, n),
        "deletion_value": (s, n),
        "has_deletion": (s, n),
        "msa_mask": (s, n),
    }
    if preset == "boltz1":
        shapes |= {
            "pocket_feature": (n, 4),
            "disto_target": (n, n, 64),
            "frames_idx": (n, 3),
            "frame_resolved_mask": (n,),
            "msa": (s, n, 33),
        }
    else:
        k, t = z["K"], z["T"]
        shapes |= {
            **{k2: (n,) for k2 in ("method_feature", "modified", "affinity_token_mask")},
            "type_bonds": (n, n),
            "contact_conditioning": (n, n, 5),
            "contact_threshold": (n, n),
            "disto_target": (n, n, k, 64),
            "disto_coords_ensemble": (k, n, 3),
            "ensemble_ref_idxs": (k,),
            "token_to_center_atom": (n, a),
            "ref_chirality": (a,),
            "atom_backbone_feat": (a, 17),
            "bfactor": (a,),
            "plddt": (a,),
            "frames_idx": (e, n, 3),
            "frame_resolved_mask": (e, n),
            "msa": (s, n),
            "template_restype": (t, n, 33),
            "template_frame_rot": (t, n, 3, 3),
            "template_frame_t": (t, n, 3),
            "template_cb": (t, n, 3),
            "template_ca": (t, n, 3),
            **{
                k2: (t, n)
                for k2 in (
                    "template_mask_cb",
                    "template_mask_frame",
                    "template_mask",
                    "query_to_template",
                    "visibility_ids",
                )
            },
        }
    return shapes


def decode_name(chars: torch.Tensor) -> str:
    """Atom name from a ``[4, 64]`` one-hot of ``ord(c) - 32`` codes (0 = no character)."""
    codes = chars.argmax(-1).tolist()
    return "".join(chr(c + 32) for c in codes if c != 0)


def token_names(f: dict[str, torch.Tensor]) -> list[str]:
    return [VOCAB[i] for i in f["res_type"].argmax(-1).tolist()]


def argmax_or_none(x: torch.Tensor) -> list[int | None]:
    hit = x.sum(-1) > 0
    return [int(i) if h else None for i, h in zip(x.argmax(-1).tolist(), hit.tolist())]


def bin_edges(bin_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distance interval of each Boltz distogram bin (64 bins, 63 edges from 2 to 22 A)."""
    edges = torch.tensor([2.0 + 20.0 * i / 62 for i in range(63)], dtype=torch.float64)
    lo = torch.cat([torch.tensor([-math.inf], dtype=torch.float64), edges])[bin_index]
    hi = torch.cat([edges, torch.tensor([math.inf], dtype=torch.float64)])[bin_index]
    return lo, hi


def assert_bins_match(bins: torch.Tensor, dist: torch.Tensor, tol: float) -> None:
    lo, hi = bin_edges(bins)
    d = dist.double()
    bad = (d <= lo - tol) | (d > hi + tol)
    assert not bad.any(), f"{int(bad.sum())} pairs in the wrong distogram bin"


def check_invariants(f: dict[str, torch.Tensor], preset: str) -> None:
    """Structural invariants that hold for any generated complex."""
    assert set(f) == EXPECTED_KEYS[preset]
    z = sizes(f, preset)
    for key, shape in expected_shapes(z, preset).items():
        assert tuple(f[key].shape) == shape, (key, tuple(f[key].shape), shape)
    for key, dtype in DTYPES[preset].items():
        assert f[key].dtype == dtype, (key, f[key].dtype, dtype)

    tok = f["token_pad_mask"] > 0
    atom = f["atom_pad_mask"] > 0
    n_real, a_real = int(tok.sum()), int(atom.sum())
    assert tok[:n_real].all() and not tok[n_real:].any()
    assert atom[:a_real].all() and not atom[a_real:].any()

    a2t = f["atom_to_token"]
    assert set(a2t.unique().tolist()) <= {0, 1}
    assert (a2t[:a_real].sum(1) == 1).all(), "every real atom maps to exactly one token"
    assert (a2t[a_real:] == 0).all(), "pad atoms belong to no token"
    owner = a2t[:a_real].argmax(1)
    assert (owner.diff() >= 0).all(), "atoms are contiguous and in token order"
    counts = a2t.sum(0)
    assert (counts[:n_real] >= 1).all() and (counts[n_real:] == 0).all()
    start = counts.cumsum(0) - counts

    mol = f["mol_type"][:n_real]
    names = token_names(f)[:n_real]
    for t in range(n_real):
        if mol[t] == LIGAND:
            assert counts[t] == 1 and names[t] == "UNK"
        else:
            assert counts[t] == HEAVY_ATOMS[names[t]], (t, names[t], int(counts[t]))
            kind = {PROTEIN: "protein", DNA: "dna", RNA: "rna"}[int(mol[t])]
            assert (kind == "protein") == (names[t] in HEAVY_ATOMS and len(names[t]) == 3)
            assert (kind == "dna") == names[t].startswith("D")

    maps = ["token_to_rep_atom"] + (["token_to_center_atom"] if preset == "boltz2" else [])
    for key in maps:
        m = f[key]
        assert set(m.unique().tolist()) <= {0, 1}
        assert (m[:n_real].sum(1) == 1).all() and (m[n_real:] == 0).all()
        assert (m[:, a_real:] == 0).all()
        picked = m[:n_real].argmax(1)
        assert (owner[picked] == torch.arange(n_real)).all(), f"{key}: atom of another token"

    resolved = f["token_resolved_mask"][:n_real] > 0
    r_set = f["r_set_to_rep_atom"]
    want = (resolved & (mol != LIGAND)).nonzero().flatten()
    rows = r_set[: len(want)]
    assert (rows.sum(1) == 1).all() and (r_set[len(want) :] == 0).all()
    assert (owner[rows.argmax(1)] == want).all()
    assert r_set.shape[0] - len(want) == z["N"] - n_real

    frames = f["frames_idx"] if preset == "boltz1" else f["frames_idx"][0]
    fmask = f["frame_resolved_mask"] if preset == "boltz1" else f["frame_resolved_mask"][0]
    for t in range(n_real):
        atoms_t = frames[t]
        assert ((atoms_t >= 0) & (atoms_t < a_real)).all()
        if mol[t] != LIGAND:
            assert (owner[atoms_t] == t).all(), "polymer frame atoms belong to the token"
        else:
            assert (mol[owner[atoms_t]] == LIGAND).all()
            assert (f["asym_id"][owner[atoms_t]] == f["asym_id"][t]).all()
            if fmask[t]:
                assert atoms_t[1] == start[t], "ligand frame is centered on its own atom"
    assert not frames[n_real:].any() and not fmask[n_real:].any()

    for key, width in LIST_WIDTHS.items():
        if key in f:
            assert f[key].shape[0] == width
            for other in LIST_VALUES.get(key, []):
                assert f[other].shape == (f[key].shape[1],), other
    atom_chain = f["asym_id"][owner]
    for key in LIGAND_ATOM_LISTS:
        idx = f[key]
        if idx.numel() == 0:
            continue
        assert ((idx >= 0) & (idx < a_real)).all(), key
        assert (mol[owner[idx]] == LIGAND).all(), f"{key} holds non-ligand atoms"
        assert (atom_chain[idx] == atom_chain[idx[0]]).all(), f"{key} spans molecules"
        for col in idx.T.tolist():
            assert len(set(col)) == len(col), f"{key} repeats an atom"
    chains = chains_of(f)
    chain_ids = {c for c, _, _ in chains}
    cc, ca = f["connected_chain_index"], f["connected_atom_index"]
    assert cc.shape == ca.shape
    for (c1, c2), (a1, a2) in zip(cc.T.tolist(), ca.T.tolist()):
        assert c1 in chain_ids and c2 in chain_ids and c1 != c2
        assert atom_chain[a1] == c1 and atom_chain[a2] == c2
    entity_of = {int(f["asym_id"][s]): int(f["entity_id"][s]) for _, s, _ in chains}
    for c1, c2 in f["symmetric_chain_index"].T.tolist():
        assert c1 < c2 and entity_of[c1] == entity_of[c2]
    n_pairs = sum(1 for i in entity_of for j in entity_of if i < j and entity_of[i] == entity_of[j])
    assert f["symmetric_chain_index"].shape[1] == n_pairs


# ------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["boltz1", "boltz2"])
def test_keys_equal_preset_keys(preset: str) -> None:
    f = make_complex(40, preset=preset)
    assert PRESET_KEYS[preset] == EXPECTED_KEYS[preset]
    assert set(f) == set(PRESET_KEYS[preset])
    assert all(isinstance(v, torch.Tensor) for v in f.values())


def test_tables_match_known_chemistry() -> None:
    assert {k: ATOMS_PER_RESIDUE[k] for k in HEAVY_ATOMS} == HEAVY_ATOMS
    assert set(ATOMS_PER_RESIDUE) == set(HEAVY_ATOMS)
    assert {k: len(v) for k, v in RESIDUE_ATOM_NAMES.items()} == ATOMS_PER_RESIDUE
    assert dict(TOKEN_IDS) == {name: i for i, name in enumerate(VOCAB)}
    for aa in ("ALA", "TRP", "GLY"):
        assert RESIDUE_ATOM_NAMES[aa][:4] == ("N", "CA", "C", "O")
    assert "O2'" in RESIDUE_ATOM_NAMES["A"] and "O2'" not in RESIDUE_ATOM_NAMES["DA"]


@pytest.mark.parametrize("preset", ["boltz1", "boltz2"])
def test_deterministic(preset: str) -> None:
    kw = dict(preset=preset, msa_rows=5, n_conformers=2, atom_multiple=32, max_tokens=90)
    a = make_complex(80, seed=7, **kw)
    b = make_complex(80, seed=7, **kw)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    c = make_complex(80, seed=8, **kw)
    assert not torch.equal(a["ref_pos"], c["ref_pos"]) or not torch.equal(a["msa"], c["msa"])


def test_no_global_rng_use() -> None:
    torch.manual_seed(0)
    before = torch.rand(3)
    torch.manual_seed(0)
    make_complex(50)
    after = torch.rand(3)
    assert torch.equal(before, after)


@pytest.mark.parametrize("preset", ["boltz1", "boltz2"])
@pytest.mark.parametrize("n_tokens", [1, 2, 5, 37, 160])
def test_invariants_default(preset: str, n_tokens: int) -> None:
    check_invariants(make_complex(n_tokens, preset=preset, seed=n_tokens), preset)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_tokens=st.integers(1, 90),
    seed=st.integers(0, 2**31 - 1),
    preset=st.sampled_from(["boltz1", "boltz2"]),
    msa_rows=st.integers(1, 6),
    n_conformers=st.integers(1, 3),
    n_templates=st.integers(1, 3),
    fractions=st.tuples(*[st.sampled_from([0.0, 0.1, 0.5, 1.0])] * 4).filter(lambda t: sum(t) > 0),
    atom_multiple=st.sampled_from([None, 1, 7, 32]),
    extra_tokens=st.sampled_from([None, 0, 3, 17]),
)
def test_invariants_property(
    n_tokens: int,
    seed: int,
    preset: str,
    msa_rows: int,
    n_conformers: int,
    n_templates: int,
    fractions: tuple[float, float, float, float],
    atom_multiple: int | None,
    extra_tokens: int | None,
) -> None:
    composition = dict(zip(("protein", "dna", "rna", "ligand"), fractions))
    f = make_complex(
        n_tokens,
        seed=seed,
        preset=preset,
        msa_rows=msa_rows,
        n_conformers=n_conformers,
        n_templates=n_templates,
        composition=composition,
        atom_multiple=atom_multiple,
        max_tokens=None if extra_tokens is None else n_tokens + extra_tokens,
    )
    check_invariants(f, preset)
    z = sizes(f, preset)
    assert z["N"] == n_tokens + (extra_tokens or 0)
    assert z["S"] == msa_rows and z["E"] == n_conformers
    if atom_multiple is not None:
        assert z["A"] % atom_multiple == 0
    if preset == "boltz2":
        assert z["K"] == n_conformers and z["T"] == n_templates
    mol = f["mol_type"][:n_tokens]
    for kind, frac in zip((PROTEIN, DNA, RNA, LIGAND), fractions):
        if frac == 0:
            assert not (mol == kind).any()


@pytest.mark.parametrize("preset", ["boltz1", "boltz2"])
def test_rep_center_and_frame_atom_names(preset: str) -> None:
    f = make_complex(300, preset=preset, seed=11)
    names = token_names(f)
    mol = f["mol_type"]
    atom_names = [decode_name(c) for c in f["ref_atom_name_chars"]]
    rep = f["token_to_rep_atom"].argmax(1).tolist()
    frames = f["frames_idx"] if preset == "boltz1" else f["frames_idx"][0]
    seen = set()
    for t, res in enumerate(names):
        kind = int(mol[t])
        seen.add(kind)
        if kind == PROTEIN:
            assert atom_names[rep[t]] == ("CA" if res == "GLY" else "CB")
            assert [atom_names[i] for i in frames[t].tolist()] == ["N", "CA", "C"]
        elif kind in (DNA, RNA):
            base = res[-1]
            assert atom_names[rep[t]] == ("C4" if base in "AG" else "C2")
            assert [atom_names[i] for i in frames[t].tolist()] == ["C1'", "C3'", "C4'"]
        if kind != LIGAND:
            start = int(f["atom_to_token"][:, : t + 1].sum() - f["atom_to_token"][:, t].sum())
            want = RESIDUE_ATOM_NAMES[res]
            assert tuple(atom_names[start : start + len(want)]) == want
    assert seen == {PROTEIN, DNA, RNA, LIGAND}
    if preset == "boltz2":
        center = f["token_to_center_atom"].argmax(1).tolist()
        for t, kind in enumerate(mol.tolist()):
            if kind == PROTEIN:
                assert atom_names[center[t]] == "CA"
            elif kind in (DNA, RNA):
                assert atom_names[center[t]] == "C1'"
            else:
                assert center[t] == rep[t]
    r_atoms = f["r_set_to_rep_atom"].argmax(1).tolist()
    assert {atom_names[a] for a in r_atoms} == {"CA", "C1'"}


@pytest.mark.parametrize("preset", ["boltz1", "boltz2"])
def test_elements_and_backbone(preset: str) -> None:
    f = make_complex(200, preset=preset, seed=5)
    atom_names = [decode_name(c) for c in f["ref_atom_name_chars"]]
    element = f["ref_element"].argmax(1)
    owner = f["atom_to_token"].argmax(1)
    mol = f["mol_type"][owner]
    atomic = {"C": 6, "N": 7, "O": 8, "S": 16, "P": 15}
    for i, name in enumerate(atom_names):
        if mol[i] != LIGAND:
            assert int(element[i]) == atomic[name[0]], name
        else:
            assert int(element[i]) in {6, 7, 8, 9, 15, 16, 17}
            assert name[0].isalpha() and name.upper() == name
    if preset == "boltz2":
        bb = f["atom_backbone_feat"].argmax(1)
        for i, name in enumerate(atom_names):
            if mol[i] == PROTEIN and name in ("N", "CA", "C", "O"):
                assert int(bb[i]) == 1 + ("N", "CA", "C", "O").index(name)
            elif mol[i] == PROTEIN or mol[i] == LIGAND:
                assert int(bb[i]) == 0
            elif name in ("P", "C1'"):
                assert int(bb[i]) == (5 if name == "P" else 16)


@pytest.mark.parametrize("n_conformers", [1, 3])
def test_distogram_boltz2_matches_coordinates(n_conformers: int) -> None:
    f = make_complex(220, preset="boltz2", seed=2, n_conformers=n_conformers)
    dt = f["disto_target"]
    assert ((dt == 0) | (dt == 1)).all() and (dt.sum(-1) == 1).all()
    assert torch.equal(f["ensemble_ref_idxs"], torch.arange(n_conformers))
    bins = dt.argmax(-1)  # [N, N, K]
    for k in range(n_conformers):
        x = f["disto_coords_ensemble"][k].double()
        d = (x[:, None] - x[None]).norm(dim=-1)
        assert_bins_match(bins[:, :, k], d, tol=1e-4)
        rep = f["token_to_rep_atom"].double() @ f["coords"][k].double()
        d_coords = (rep[:, None] - rep[None]).norm(dim=-1)
        assert_bins_match(bins[:, :, k], d_coords, tol=1e-3)
    assert torch.equal(f["disto_center"], f["disto_coords_ensemble"][0])
    assert len(bins.unique()) > 20, "distances should cover many bins"


def test_distogram_boltz1_matches_coordinates() -> None:
    f = make_complex(220, preset="boltz1", seed=2)
    dt = f["disto_target"]
    assert set(dt.unique().tolist()) == {0, 1} and (dt.sum(-1) == 1).all()
    x = f["disto_center"].double()
    bins = dt.argmax(-1)
    assert_bins_match(bins, (x[:, None] - x[None]).norm(dim=-1), tol=1e-4)
    rep = f["token_to_rep_atom"].double() @ f["coords"][0].double()
    assert_bins_match(bins, (rep[:, None] - rep[None]).norm(dim=-1), tol=1e-3)


def test_coordinates_follow_chains() -> None:
    f = make_complex(400, preset="boltz2", seed=4, n_conformers=3)
    coords = f["coords"].double()
    resolved = f["atom_resolved_mask"]
    for e in range(3):
        assert coords[e][resolved].mean(0).abs().max() < 1e-3, "centered on resolved atoms"
    center = f["token_to_center_atom"].double() @ coords[0]
    mol, asym = f["mol_type"], f["asym_id"]
    same_chain = asym[1:] == asym[:-1]
    step = (center[1:] - center[:-1]).norm(dim=-1)
    prot = same_chain & (mol[1:] == PROTEIN)
    assert prot.any() and torch.allclose(step[prot], torch.full_like(step[prot], 3.8), atol=0.05)
    nuc = same_chain & ((mol[1:] == DNA) | (mol[1:] == RNA))
    assert nuc.any() and ((step[nuc] > 4.5) & (step[nuc] < 7.5)).all()
    lig = same_chain & (mol[1:] == LIGAND)
    assert lig.any() and (step[lig] < 30).all()
    owner = f["atom_to_token"].argmax(1)
    spread = (coords[0] - center[owner]).norm(dim=-1)
    assert (spread[mol[owner] == PROTEIN] < 2.1).all()
    assert (spread[(mol[owner] == DNA) | (mol[owner] == RNA)] < 4.0).all()
    rms = (coords[1:] - coords[:1]).pow(2).sum(-1).mean().sqrt()
    assert 0.05 < rms < 1.5, "conformers are small perturbations of each other"
    # ligand bonds in the bounds list are chemically sized
    idx = f["rdkit_bounds_index"][:, f["rdkit_bounds_bond_mask"]]
    if idx.numel():
        d = (coords[0][idx[0]] - coords[0][idx[1]]).norm(dim=-1)
        assert ((d > 1.2) & (d < 1.9)).all()
        lo, hi = f["rdkit_lower_bounds"], f["rdkit_upper_bounds"]
        assert (lo < hi).all() and (lo > 0).all()


def test_frames_mostly_resolved() -> None:
    f = make_complex(300, preset="boltz2", seed=9)
    mol = f["mol_type"]
    fm = f["frame_resolved_mask"][0]
    polymer = (mol != LIGAND) & (f["token_resolved_mask"] > 0)
    assert fm[polymer].float().mean() > 0.95
    assert not fm[f["token_resolved_mask"] == 0].any()


@pytest.mark.parametrize("preset", ["boltz1", "boltz2"])
def test_msa_consistency(preset: str) -> None:
    f = make_complex(150, preset=preset, seed=3, msa_rows=16)
    ids = f["msa"] if preset == "boltz2" else f["msa"].argmax(-1)
    if preset == "boltz1":
        assert (f["msa"].sum(-1) == 1).all()
    assert torch.equal(ids[0], f["res_type"].argmax(-1)), "row 0 is the query"
    assert (ids[1:] != ids[0]).any(), "other rows mutate the query"
    assert ((ids >= 1) & (ids < 33)).all()
    non_protein = f["mol_type"] != PROTEIN
    assert (ids[1:, non_protein] == TOKEN_IDS["-"]).all()
    profile = torch.nn.functional.one_hot(ids, 33).float().mean(0)
    assert torch.allclose(f["profile"], profile)
    dv = f["deletion_value"]
    assert torch.equal(f["has_deletion"], dv > 0)
    assert f["has_deletion"].any() and not f["has_deletion"][0].any()
    assert torch.allclose(f["deletion_mean"], dv.mean(0))
    raw = torch.tan(dv / (math.pi / 2)) * 3
    assert torch.allclose(raw, raw.round(), atol=1e-3), "deletion counts are integers"
    assert (f["msa_mask"] == 1).all()
    assert (f["msa_paired"][0] == 1).all()
    assert set(f["msa_paired"].unique().tolist()) <= {0.0, 1.0}


def test_chains_and_entities() -> None:
    multi = 0
    for seed in range(6):
        f = make_complex(120, seed=seed)
        chains = chains_of(f)
        multi += len(chains) >= 2
        for i, (asym, s, e) in enumerate(chains):
            assert asym == i
            assert (f["asym_id"][s:e] == asym).all()
            mol = f["mol_type"][s:e]
            assert (mol == mol[0]).all()
            if mol[0] != LIGAND:
                assert torch.equal(f["residue_index"][s:e], torch.arange(e - s))
            else:
                assert (f["residue_index"][s:e] == 0).all()
        by_entity: dict[int, list[int]] = {}
        for asym, s, _ in chains:
            by_entity.setdefault(int(f["entity_id"][s]), []).append(asym)
        for members in by_entity.values():
            syms = [int(f["sym_id"][chains[a][1]]) for a in members]
            assert syms == list(range(len(members)))
        assert torch.equal(f["token_index"], torch.arange(120))
    assert multi == 6


def test_constraints_present_and_consistent() -> None:
    totals = dict.fromkeys(LIGAND_ATOM_LISTS, 0)
    for seed in range(8):
        f = make_complex(200, seed=seed, composition={"protein": 0.5, "ligand": 0.5})
        check_invariants(f, "boltz2")
        for k in totals:
            totals[k] += f[k].shape[1]
        rb = f["rdkit_bounds_bond_mask"] & f["rdkit_bounds_angle_mask"]
        assert not rb.any()
        assert f["connected_chain_index"].shape[1] == 1
        cpi = f["contact_pair_index"]
        if cpi.numel():
            owner = f["atom_to_token"].argmax(1)
            t1, t2 = owner[cpi[0, 0]], owner[cpi[1, 0]]
            assert (owner[cpi[0]] == t1).all() and (owner[cpi[1]] == t2).all()
            cc = f["contact_conditioning"].argmax(-1)
            assert cc[t1, t2] == 4 and cc[t2, t1] == 4
            assert f["contact_threshold"][t1, t2] == f["contact_thresholds"][0]
            assert (f["contact_negation_mask"]).all() and (f["contact_union_index"] == 0).all()
        tb = f["token_bonds"][..., 0]
        assert torch.equal(tb, tb.T) and torch.equal(tb > 0, f["type_bonds"] > 0)
    for k, total in totals.items():
        assert total > 0, k


def test_ligand_constraints_follow_bond_graph() -> None:
    for seed in range(6):
        f = make_complex(160, seed=seed, composition={"protein": 0.4, "ligand": 0.6})
        owner = f["atom_to_token"].argmax(1)
        bonded = f["token_bonds"][..., 0] > 0

        def linked(a: int, b: int, bonded=bonded, owner=owner) -> bool:
            return bool(bonded[owner[a], owner[b]])

        for n0, n1, n2, c in f["chiral_atom_index"].T.tolist():
            assert all(linked(c, x) for x in (n0, n1, n2)), "chiral center bonds its neighbors"
        for a, b, c, d in f["stereo_bond_index"].T.tolist():
            assert linked(a, b) and linked(b, c) and linked(c, d)
            assert f["type_bonds"][owner[b], owner[c]] == 3, "stereo bond is a double bond"
        for i, i1, i2, j, j1, j2 in f["planar_bond_index"].T.tolist():
            assert linked(i, j) and linked(i, i1) and linked(i, i2)
            assert linked(j, j1) and linked(j, j2)
        for key in ("planar_ring_5_index", "planar_ring_6_index"):
            for ring in f[key].T.tolist():
                assert all(linked(ring[k], ring[(k + 1) % len(ring)]) for k in range(len(ring)))
        idx = f["rdkit_bounds_index"]
        is_bond = f["rdkit_bounds_bond_mask"]
        for (a, b), bond in zip(idx.T.tolist(), is_bond.tolist()):
            assert linked(a, b) == bond


def test_empty_constraint_lists_without_ligands() -> None:
    f = make_complex(60, seed=1, composition={"protein": 1.0})
    for key in LIGAND_ATOM_LISTS + ["connected_chain_index", "connected_atom_index"]:
        assert f[key].shape == (LIST_WIDTHS[key], 0), key
    assert (f["mol_type"] == PROTEIN).all()


def test_ligand_only() -> None:
    f = make_complex(25, seed=1, composition={"ligand": 1.0})
    check_invariants(f, "boltz2")
    assert (f["atom_to_token"].sum(0) == 1).all()
    assert torch.equal(f["atom_to_token"], torch.eye(25, dtype=torch.long))
    assert f["r_set_to_rep_atom"].shape[0] == 0


@pytest.mark.parametrize("preset", ["boltz1", "boltz2"])
def test_padding_keeps_real_part(preset: str) -> None:
    n, pad_n = 70, 96
    base = make_complex(n, seed=6, preset=preset, n_conformers=2)
    f = make_complex(n, seed=6, preset=preset, n_conformers=2, atom_multiple=32, max_tokens=pad_n)
    check_invariants(f, preset)
    a = base["atom_pad_mask"].shape[0]
    big_a = f["atom_pad_mask"].shape[0]
    assert big_a % 32 == 0 and a <= big_a < a + 32
    z = expected_shapes(sizes(base, preset), preset)
    for key, shape in z.items():
        real = f[key][tuple(slice(0, s) for s in shape)]
        assert torch.equal(real, base[key]), key
        rest = f[key].clone()
        rest[tuple(slice(0, s) for s in shape)] = 0
        if key == "msa":
            pad_cols = f[key][:, n:]
            if preset == "boltz2":
                assert (pad_cols == TOKEN_IDS["-"]).all()
            else:
                assert (pad_cols == 1).all(), "boltz-1 pads its one-hot msa with ones"
            rest[:, n:] = 0
        if key.startswith("template_") or key in ("query_to_template", "visibility_ids"):
            continue
        assert not rest.any(), f"{key}: padding is not zero"
    r_real = base["r_set_to_rep_atom"].shape[0]
    assert f["r_set_to_rep_atom"].shape[0] == r_real + pad_n - n
    for key in LIST_WIDTHS:
        if key in f:
            assert torch.equal(f[key], base[key]), key


def test_dummy_templates() -> None:
    f = make_complex(30, n_templates=2, max_tokens=40)
    assert f["template_restype"].shape == (2, 40, 33)
    assert (f["template_restype"].argmax(-1) == 0).all()
    assert (f["template_restype"].sum(-1) == 1).all()
    for key in ("template_frame_rot", "template_cb", "template_mask", "visibility_ids"):
        assert not f[key].any()


def test_presets_share_the_complex() -> None:
    f1 = make_complex(90, seed=12, preset="boltz1")
    f2 = make_complex(90, seed=12, preset="boltz2")
    for key in ("asym_id", "res_type", "coords", "atom_to_token", "token_to_rep_atom"):
        assert torch.equal(f1[key], f2[key]), key
    assert torch.equal(f1["msa"].argmax(-1), f2["msa"])
    assert torch.equal(f1["frames_idx"], f2["frames_idx"][0])


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        make_complex(10, preset="boltz3")
    with pytest.raises(ValueError):
        make_complex(10, max_tokens=5)
    with pytest.raises(ValueError):
        make_complex(10, composition={"water": 1.0})
    with pytest.raises(ValueError):
        make_complex(0)
