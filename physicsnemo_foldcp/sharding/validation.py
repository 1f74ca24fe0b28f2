"""Checking one serial sample against the feature registry, before anything is laid out.

Every check the source rank runs on a sample lives here: the batch axis, dtypes, the
lengths of the axes of one meaning, the ranges of index values, and the atom<->token maps
(one-hot rows, atoms contiguous and in token order, a token's atoms its own). Each error is
a :class:`FeatureValidationError` whose message names the feature, axis, shape or value at
fault. Pure tensor code: no geometry (that is :mod:`physicsnemo_foldcp.sharding.plan`) and
no communication.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from physicsnemo_foldcp.features.axes import TOKENS, Axis
from physicsnemo_foldcp.features.registry import FeatureRegistry
from physicsnemo_foldcp.features.spec import PASSTHROUGH, FeatureSpec


class FeatureValidationError(ValueError):
    """A feature dict that cannot be sharded as given; the message names what is wrong."""


# -- the sample as a whole -----------------------------------------------------------------


def split_sample(
    features: object,
) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Tensor features and the other (passed-through) values of the source's sample.

    Parameters
    ----------
    features : object
        What the source rank passed: a mapping of name -> tensor or value.

    Returns
    -------
    tuple[dict[str, torch.Tensor], dict[str, object]]
        ``(tensors, values)``.

    Raises
    ------
    FeatureValidationError
        If ``features`` is ``None``, not a mapping, or holds no tensor.
    """
    if features is None:
        raise FeatureValidationError(
            "the source rank of the domain group passed features=None: the source must pass "
            "the sample's feature dict (other ranks pass None)"
        )
    if not isinstance(features, Mapping):
        raise FeatureValidationError(
            f"features must be a mapping of name -> tensor, got {type(features).__name__}"
        )
    tensors = {k: v for k, v in features.items() if isinstance(v, torch.Tensor)}
    values = {k: v for k, v in features.items() if not isinstance(v, torch.Tensor)}
    if not tensors:
        raise FeatureValidationError("the feature dict holds no tensors")
    return tensors, values


def detect_batch(tensors: Mapping[str, torch.Tensor], registry: FeatureRegistry) -> bool:
    """True when every feature has a leading batch axis of size 1; errors otherwise."""
    batched_names, plain_names = [], []
    for name, t in tensors.items():
        n = len(registry[name].axes)
        if t.ndim == n:
            plain_names.append(name)
        elif t.ndim == n + 1:
            batched_names.append(name)
        else:
            raise FeatureValidationError(
                f"feature {name!r} has shape {tuple(t.shape)}, but its registry axes "
                f"{registry[name].axes} need {n} dims (or {n + 1} with a leading batch of 1)"
            )
    if batched_names and plain_names:
        raise FeatureValidationError(
            "some features carry a batch axis and some do not: e.g. "
            f"{batched_names[0]!r} {tuple(tensors[batched_names[0]].shape)} vs "
            f"{plain_names[0]!r} {tuple(tensors[plain_names[0]].shape)}"
        )
    if batched_names:
        sizes = {int(tensors[n].shape[0]) for n in batched_names}
        if sizes != {1}:
            raise FeatureValidationError(
                f"batch size {max(sizes)} per domain group: a domain group shards ONE sample; "
                "grow the batch over the ddp axis instead (init_mesh(ddp=...), one sample per "
                "domain group per step)"
            )
    return bool(batched_names)


def check_dtype(spec: FeatureSpec, t: torch.Tensor) -> None:
    """Raise unless ``t``'s dtype is one the registry accepts for ``spec``."""
    if spec.dtypes is not None and t.dtype not in spec.dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in spec.dtypes)
        raise FeatureValidationError(
            f"feature {spec.name!r} has dtype {str(t.dtype).removeprefix('torch.')}; "
            f"the registry accepts {allowed}"
        )
    if spec.index_of is not None and (t.dtype.is_floating_point or t.dtype == torch.bool):
        raise FeatureValidationError(
            f"feature {spec.name!r} holds {spec.index_of} indices and needs an integer dtype, "
            f"got {str(t.dtype).removeprefix('torch.')}"
        )


def _length_listing(entries: list[tuple[str, int, int]]) -> str:
    """``"22 in res_type[axis 0]; 23 in ..."``: the features of every length, rarest first."""
    groups: dict[int, list[str]] = {}
    for name, dim, n in entries:
        groups.setdefault(n, []).append(f"{name}[axis {dim}]")
    return "; ".join(
        f"{n} in {', '.join(names[:4])}" + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
        for n, names in sorted(groups.items(), key=lambda kv: len(kv[1]))
    )


def axis_lengths(
    tensors: Mapping[str, torch.Tensor], registry: FeatureRegistry, align: bool
) -> dict[Axis, int]:
    """One length per split axis meaning; raises when features disagree (unless aligning).

    Every axis whose meaning is split over the mesh
    (:attr:`~physicsnemo_foldcp.features.axes.Axis.split`: tokens, atoms, msa, rset) must
    have one length in the sample; the others (ensemble, templates) may differ.

    Parameters
    ----------
    tensors : Mapping[str, torch.Tensor]
        Unbatched features.
    registry : FeatureRegistry
        Their axis meanings.
    align : bool
        Take the longest length of each meaning instead of raising.

    Returns
    -------
    dict[Axis, int]
        Length of every split meaning the sample uses (an Axis is looked up by its name).
    """
    seen: dict[Axis, list[tuple[str, int, int]]] = {}
    for name, t in tensors.items():
        spec = registry[name]
        if spec.mode == PASSTHROUGH:
            continue
        pair = spec.axes_of(TOKENS)
        if not align and len(pair) == 2 and t.shape[pair[0]] != t.shape[pair[1]]:
            raise FeatureValidationError(
                f"pair feature {name!r} is not square: its token axes have lengths "
                f"{t.shape[pair[0]]} and {t.shape[pair[1]]} (shape {tuple(t.shape)})"
            )
        for dim, axis in enumerate(spec.axes):
            if axis is not None and axis.split:
                seen.setdefault(axis, []).append((name, dim, int(t.shape[dim])))
    lengths = {}
    for axis, entries in seen.items():
        values = {n for _, _, n in entries}
        if len(values) > 1 and not align:
            raise FeatureValidationError(
                f"the {axis} axes of the features have different lengths {sorted(values)}: "
                f"{_length_listing(entries)}. Every {axis} axis must have one length: pad them "
                "in the featurizer, or pass align_lengths=True to pad each to the longest"
            )
        lengths[axis] = max(values)
    return lengths


def align_to_lengths(
    t: torch.Tensor, spec: FeatureSpec, lengths: Mapping[Axis, int]
) -> torch.Tensor:
    """Pad every checked axis of ``t`` at its end (with the pad value) to the common length."""
    for dim, axis in enumerate(spec.axes):
        if axis in lengths and t.shape[dim] < lengths[axis]:
            shape = list(t.shape)
            shape[dim] = lengths[axis] - t.shape[dim]
            t = torch.cat([t, torch.full(shape, spec.pad_value, dtype=t.dtype)], dim=dim)
    return t


def find_map(
    registry: FeatureRegistry, names: Iterable[str], axes: tuple[str | Axis, str | Axis]
) -> str | None:
    """The first (sorted) one-hot map among ``names`` with these axes, or ``None``."""
    for name in sorted(names):
        spec = registry[name]
        if spec.one_hot and spec.axes == axes:
            return name
    return None


def check_index_range(name: str, t: torch.Tensor, target: str | Axis, length: int) -> None:
    """Raise unless every value of index feature ``name`` lies in ``[0, length)``."""
    if t.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(t))
    if low < 0 or high >= length:
        bad = low if low < 0 else high
        raise FeatureValidationError(
            f"feature {name!r} holds {target} indices, but value {bad} is out of range "
            f"[0, {length}) for the sample's {length} {target}"
        )


def check_nonnegative_indices(name: str, t: torch.Tensor, target: str | Axis) -> None:
    """Raise unless every value of index feature ``name`` is ``>= 0``.

    For indices whose upper bound the sample does not carry (a conformer id of
    ``ensemble_ref_idxs`` indexes the structure's whole ensemble, not the sample's ``E``).
    """
    if t.numel() and int(t.min()) < 0:
        raise FeatureValidationError(
            f"feature {name!r} holds {target} indices, but value {int(t.min())} is out of "
            "range: indices must be >= 0"
        )


# -- one-hot maps ----------------------------------------------------------------------------


def binary_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Ones per row and the column of each row's first 1, for a 2-D map of 0s and 1s.

    Three reductions over the map (range, row sums, row argmax) and no temporaries of its
    size. Only integer and bool maps are handled here; the caller falls back to exact
    element-wise checks when this returns ``None``.

    Parameters
    ----------
    t : torch.Tensor
        ``[X, Y]`` map.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor] or None
        int64 ``[X]`` count of ones per row and int64 ``[X]`` column of the row's first 1
        (0 for a row without one), or ``None`` when ``t`` is not 2-D, is empty, has a
        floating or complex dtype, or holds a value other than 0 and 1.
    """
    if t.ndim != 2 or t.dtype.is_floating_point or t.dtype.is_complex:
        return None
    if t.numel() == 0:
        return None
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    else:
        low, high = torch.aminmax(t)
        if int(low) < 0 or int(high) > 1:
            return None
    return t.sum(1, dtype=torch.int64), t.argmax(1)


def _exact_one_hot_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise form of :func:`binary_rows` for any dtype: nonzero count, first nonzero."""
    nonzero = t != 0
    return nonzero.sum(1), nonzero.to(torch.int8).argmax(1)


def _check_atom_order(
    tokens: torch.Tensor, has_token: torch.Tensor, atom_pad_mask: torch.Tensor | None
) -> None:
    """Atoms without a token are trailing pads; owned atoms are in token order."""
    orphans = (~has_token).nonzero().flatten()
    if orphans.numel():
        first = int(orphans[0])
        later_owned = has_token[first:].nonzero()
        if later_owned.numel():
            raise FeatureValidationError(
                f"atom_to_token assigns atom {first} to no token, but atom "
                f"{first + int(later_owned[0])} after it has one: only trailing pad atoms "
                "may have no token"
            )
        if atom_pad_mask is not None and bool((atom_pad_mask[orphans] != 0).any()):
            bad = int(orphans[(atom_pad_mask[orphans] != 0).nonzero()[0]])
            raise FeatureValidationError(
                f"atom_to_token assigns atom {bad} to no token, but atom_pad_mask marks it "
                "as a real atom"
            )
    owned = tokens[has_token]
    if owned.numel() > 1 and bool((owned[1:] < owned[:-1]).any()):
        a = int((owned[1:] < owned[:-1]).nonzero()[0]) + 1
        raise FeatureValidationError(
            f"the atoms of each token must be contiguous and in token order: atom {a} "
            f"belongs to token {int(owned[a])}, after an atom of token {int(owned[a - 1])}"
        )


def atom_tokens_from_map(
    atom_to_token: torch.Tensor, atom_pad_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Owning token of every atom, from a dense one-hot ``atom_to_token [A, N]`` map.

    Parameters
    ----------
    atom_to_token : torch.Tensor
        ``[A, N]`` 0/1 map.
    atom_pad_mask : torch.Tensor, optional
        ``[A]``; an atom with no token must be a pad (0) here.

    Returns
    -------
    torch.Tensor
        int64 ``[A]``: the token of each atom, ``-1`` for trailing atoms with no token.

    Raises
    ------
    FeatureValidationError
        If the map is not 0/1, an atom has several tokens, an atom that is not a trailing
        pad has no token, or the atoms of one token are not contiguous and in token order.
    """
    a2t = atom_to_token
    if a2t.ndim != 2:
        raise FeatureValidationError(f"atom_to_token must be [A, N], got {tuple(a2t.shape)}")
    rows = binary_rows(a2t)
    if rows is None:
        nonbinary = (a2t != 0) & (a2t != 1)
        if nonbinary.any():
            a, t = (int(v) for v in nonbinary.nonzero()[0])
            raise FeatureValidationError(
                f"atom_to_token is not one-hot: value {a2t[a, t].item()} at atom {a}, token {t}"
            )
        rows = _exact_one_hot_rows(a2t)
    counts, columns = rows
    if (counts > 1).any():
        a = int((counts > 1).nonzero()[0])
        raise FeatureValidationError(
            f"atom_to_token is not one-hot: atom {a} belongs to {int(counts[a])} tokens"
        )
    has_token = counts == 1
    tokens = torch.where(has_token, columns, -1)
    _check_atom_order(tokens, has_token, atom_pad_mask)
    return tokens


def _checked_one_hot_rows(t: torch.Tensor, message: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Ones per row and first-one column of a map whose rows hold at most one 1; else raise."""
    rows = binary_rows(t)
    if rows is None:
        if ((t != 0) & (t != 1)).any():
            raise FeatureValidationError(message)
        rows = _exact_one_hot_rows(t)
    if (rows[0] > 1).any():
        raise FeatureValidationError(message)
    return rows


def rset_row_tokens(
    name: str, rows_to_atom: torch.Tensor, atom_tokens: torch.Tensor
) -> torch.Tensor:
    """Token of every row of an ``rset`` one-hot map ``[R, A]`` (rows follow their tokens).

    Parameters
    ----------
    name : str
        Feature key (for the message).
    rows_to_atom : torch.Tensor
        ``[R, A]`` map: each row picks at most one atom.
    atom_tokens : torch.Tensor
        int64 ``[A]`` token of each atom (:func:`atom_tokens_from_map`).

    Returns
    -------
    torch.Tensor
        int64 ``[R]``: the token of the atom each row picks, ``-1`` for an empty row.

    Raises
    ------
    FeatureValidationError
        If a row picks several atoms or holds a value other than 0 and 1.
    """
    counts, atoms = _checked_one_hot_rows(
        rows_to_atom, f"{name} is not one-hot (each row must pick one atom)"
    )
    return torch.where(counts == 1, atom_tokens[atoms], -1)


def check_map_within_tokens(
    name: str, token_to_atom: torch.Tensor, atom_tokens: torch.Tensor
) -> torch.Tensor:
    """Check that a ``[N, A]`` one-hot map picks, for each token, an atom OF that token.

    Returns
    -------
    torch.Tensor
        int64 ``[N]``: the atom each token picks, ``-1`` for none (the map's index form,
        :func:`physicsnemo_foldcp.sharding.maps.dense_map_to_index`).

    Raises
    ------
    FeatureValidationError
        If a row picks several atoms, a non-0/1 value, or an atom of another token (which
        would put the atom outside the rank that holds the token).
    """
    counts, columns = _checked_one_hot_rows(
        token_to_atom, f"{name} is not one-hot (each token picks at most one atom)"
    )
    has_atom = counts == 1
    tokens = has_atom.nonzero().flatten()
    atoms = columns[tokens]
    owners = atom_tokens[atoms]
    wrong = owners != tokens
    if wrong.any():
        k = int(wrong.nonzero()[0])
        raise FeatureValidationError(
            f"{name} maps token {int(tokens[k])} to atom {int(atoms[k])}, which belongs to "
            f"token {int(owners[k])}: a token's atom must be one of its own atoms"
        )
    return torch.where(has_atom, columns, -1)


__all__ = [
    "FeatureValidationError",
    "align_to_lengths",
    "atom_tokens_from_map",
    "axis_lengths",
    "binary_rows",
    "check_dtype",
    "check_index_range",
    "check_map_within_tokens",
    "check_nonnegative_indices",
    "detect_batch",
    "find_map",
    "rset_row_tokens",
    "split_sample",
]
