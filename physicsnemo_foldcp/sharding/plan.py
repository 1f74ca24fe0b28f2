"""The sharding plan: which tokens, atoms and rows each rank of a ``cp0 x cp1`` mesh holds.

Token row blocks go over ``cp0`` (contiguous, uneven allowed), token column blocks over
``cp1``; each row block's atoms are exactly the atoms of its tokens (atoms follow their
tokens), so atom<->token products are local. Optional per-shard padding rounds each row
block's tokens and atoms up to a multiple; the resulting *padded layout* is the global
layout of every sharded feature (``full_tensor()``), and :meth:`ShardingPlan.to_padded` /
:meth:`ShardingPlan.from_padded` convert between it and the serial layout exactly.

A plan is small, picklable, and the same on every rank of a domain group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from physicsnemo_foldcp.features.spec import ATOMS, LAYOUT_AXES, MSA, RSET, TOKENS


class FeatureValidationError(ValueError):
    """A feature dict that cannot be sharded as given; the message names what is wrong."""


def split_sizes(length: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous blocks of ``length`` items, the larger blocks first.

    The same rule as :func:`torch.tensor_split`: sizes differ by at most one.
    """
    base, extra = divmod(length, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _bounds(sizes: Sequence[int]) -> tuple[int, ...]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return tuple(out)


@dataclass(frozen=True)
class ShardingPlan:
    """Blocks per rank for one sample on a ``(cp0, cp1)`` domain mesh.

    Parameters
    ----------
    cp : tuple[int, int]
        ``(cp0, cp1)``.
    token_bounds : tuple[int, ...]
        ``cp0 + 1`` serial token boundaries: row block ``i`` holds serial tokens
        ``token_bounds[i]:token_bounds[i + 1]``.
    atom_bounds : tuple[int, ...]
        ``cp0 + 1`` serial atom boundaries: the atoms of row block ``i``'s tokens (the
        last block also holds trailing atoms that belong to no token: serial pad atoms).
    rset_bounds : tuple[int, ...] or None
        ``cp0 + 1`` boundaries of the rows of ``rset`` features (rows follow their token).
    msa_rows : int or None
        MSA depth S, split over ``cp0`` in :func:`split_sizes` blocks.
    token_multiple : int
        Each row block's token count is padded up to a multiple of this.
    atom_multiple : int
        Each row block's atom count is padded up to a multiple of this.
    """

    cp: tuple[int, int]
    token_bounds: tuple[int, ...]
    atom_bounds: tuple[int, ...]
    rset_bounds: tuple[int, ...] | None = None
    msa_rows: int | None = None
    token_multiple: int = 1
    atom_multiple: int = 1

    # -- sizes --------------------------------------------------------------------------

    @property
    def n_tokens(self) -> int:
        """Serial token count N."""
        return self.token_bounds[-1]

    @property
    def n_atoms(self) -> int:
        """Serial atom count A."""
        return self.atom_bounds[-1]

    def _serial_bounds(self, axis: str) -> tuple[int, ...]:
        if axis == TOKENS:
            return self.token_bounds
        if axis == ATOMS:
            return self.atom_bounds
        if axis == RSET:
            if self.rset_bounds is None:
                raise FeatureValidationError("the plan has no rset axis (no r_set feature)")
            return self.rset_bounds
        raise ValueError(f"axis {axis!r} has no row blocks")

    def _multiple(self, axis: str) -> int:
        return {TOKENS: self.token_multiple, ATOMS: self.atom_multiple}.get(axis, 1)

    def row_sizes(self, axis: str) -> list[int]:
        """Padded local length of ``axis`` on each ``cp0`` row block."""
        if axis == MSA:
            if self.msa_rows is None:
                raise FeatureValidationError("the plan has no msa axis (no MSA feature)")
            return split_sizes(self.msa_rows, self.cp[0])
        b, m = self._serial_bounds(axis), self._multiple(axis)
        return [_round_up(b[i + 1] - b[i], m) for i in range(self.cp[0])]

    def padded_length(self, axis: str) -> int:
        """Global length of ``axis`` in the padded layout."""
        return sum(self.row_sizes(axis))

    def column_sizes(self) -> list[int]:
        """Local length of the token axis on each ``cp1`` column block.

        The same blocks as the rows when ``cp0 == cp1``; otherwise the padded token axis
        split into ``cp1`` blocks that differ by at most one.
        """
        rows = self.row_sizes(TOKENS)
        if self.cp[1] == self.cp[0]:
            return rows
        return split_sizes(sum(rows), self.cp[1])

    def sizes(self, axis: str, mesh_dim: int) -> list[int]:
        """Local lengths of ``axis`` over the blocks of ``mesh_dim`` (0: cp0, 1: cp1)."""
        if mesh_dim == 0:
            return self.row_sizes(axis)
        if axis != TOKENS:
            raise ValueError(f"only the token axis is split over cp1, not {axis!r}")
        return self.column_sizes()

    def block(self, axis: str, mesh_dim: int, index: int) -> tuple[int, int]:
        """``(start, stop)`` of block ``index`` of ``axis`` over ``mesh_dim``, padded layout."""
        b = _bounds(self.sizes(axis, mesh_dim))
        return b[index], b[index + 1]

    def serial_range(self, axis: str, row: int) -> tuple[int, int]:
        """``(start, stop)`` of row block ``row`` of ``axis`` in the SERIAL layout."""
        b = self._serial_bounds(axis)
        return b[row], b[row + 1]

    # -- layout maps --------------------------------------------------------------------

    def has_padding(self, axis: str) -> bool:
        """Whether the padded layout of ``axis`` differs from the serial one."""
        if axis not in LAYOUT_AXES:
            return False
        return self.padded_length(axis) != self._serial_bounds(axis)[-1]

    def positions(self, axis: str) -> torch.Tensor:
        """Padded-layout position of every serial index of ``axis`` (int64, ``[length]``)."""
        serial = self._serial_bounds(axis)
        padded = _bounds(self.row_sizes(axis))
        pieces = [
            torch.arange(serial[i], serial[i + 1], dtype=torch.int64) - serial[i] + padded[i]
            for i in range(self.cp[0])
        ]
        return torch.cat(pieces)

    def is_pad(self, axis: str) -> torch.Tensor:
        """Bool ``[padded_length]``: True at positions the plan inserted (per-shard pads)."""
        mask = torch.ones(self.padded_length(axis), dtype=torch.bool)
        mask[self.positions(axis)] = False
        return mask

    def to_padded(
        self, tensor: torch.Tensor, axes: Sequence[str | None], pad_value: float | int | bool
    ) -> torch.Tensor:
        """Serial layout -> padded layout along every tokens/atoms/rset axis of ``tensor``.

        Parameters
        ----------
        tensor : torch.Tensor
            An unbatched feature in the serial layout.
        axes : sequence of str or None
            Its axis meanings (``FeatureSpec.axes``).
        pad_value : bool, int or float
            Value written at the inserted positions.
        """
        out = tensor
        for dim, axis in enumerate(axes):
            if axis in LAYOUT_AXES and self.has_padding(axis):
                shape = list(out.shape)
                shape[dim] = self.padded_length(axis)
                grown = torch.full(shape, pad_value, dtype=out.dtype, device=out.device)
                out = grown.index_copy_(dim, self.positions(axis).to(out.device), out)
        return out

    def from_padded(self, tensor: torch.Tensor, axes: Sequence[str | None]) -> torch.Tensor:
        """Padded layout -> serial layout (drops the positions the plan inserted)."""
        out = tensor
        for dim, axis in enumerate(axes):
            if axis in LAYOUT_AXES and self.has_padding(axis):
                out = out.index_select(dim, self.positions(axis).to(out.device))
        return out

    def remap_index_values(self, values: torch.Tensor, axis: str) -> torch.Tensor:
        """Serial indices into ``axis`` -> indices into its padded layout."""
        if not self.has_padding(axis):
            return values
        return self.positions(axis).to(values.device)[values.long()].to(values.dtype)

    def unmap_index_values(self, values: torch.Tensor, axis: str) -> torch.Tensor:
        """Padded-layout indices into ``axis`` -> serial indices (inverse of the remap)."""
        if not self.has_padding(axis):
            return values
        inverse = torch.full((self.padded_length(axis),), -1, dtype=torch.int64)
        inverse[self.positions(axis)] = torch.arange(self._serial_bounds(axis)[-1])
        out = inverse.to(values.device)[values.long()]
        if (out < 0).any():
            raise FeatureValidationError(f"an index points at a pad position of axis {axis!r}")
        return out.to(values.dtype)

    def describe(self) -> str:
        """Per-row-block token, atom and MSA ranges, one line each."""
        lines = [
            f"plan on cp0 x cp1 = {self.cp[0]} x {self.cp[1]}: {self.n_tokens} tokens "
            f"(padded {self.padded_length(TOKENS)}), {self.n_atoms} atoms "
            f"(padded {self.padded_length(ATOMS)}), token columns {self.column_sizes()}"
        ]
        msa = self.row_sizes(MSA) if self.msa_rows is not None else None
        for i in range(self.cp[0]):
            t0, t1 = self.serial_range(TOKENS, i)
            a0, a1 = self.serial_range(ATOMS, i)
            line = (
                f"  row {i}: tokens [{t0}, {t1}) -> {self.row_sizes(TOKENS)[i]} local, "
                f"atoms [{a0}, {a1}) -> {self.row_sizes(ATOMS)[i]} local"
            )
            if msa is not None:
                line += f", msa rows {msa[i]}"
            lines.append(line)
        return "\n".join(lines)


# -- building a plan from a feature dict --------------------------------------------------


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


def atom_tokens_from_map(atom_to_token: torch.Tensor, atom_pad_mask: torch.Tensor | None = None):
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


def _rows_per_block(
    name: str, rows_to_atom: torch.Tensor, atom_tokens: torch.Tensor, token_bounds: Sequence[int]
) -> tuple[int, ...]:
    """Row boundaries of an ``rset`` one-hot map whose rows follow their tokens."""
    counts, atoms = _checked_one_hot_rows(
        rows_to_atom, f"{name} is not one-hot (each row must pick one atom)"
    )
    row_tokens = torch.where(counts == 1, atom_tokens[atoms], -1)
    bounds = torch.tensor(token_bounds[1:-1], dtype=torch.int64)
    blocks = torch.bucketize(row_tokens, bounds, right=True)
    blocks = torch.where(row_tokens < 0, len(token_bounds) - 2, blocks)
    if blocks.numel() > 1 and bool((blocks[1:] < blocks[:-1]).any()):
        r = int((blocks[1:] < blocks[:-1]).nonzero()[0]) + 1
        raise FeatureValidationError(
            f"{name}: rows must be in token order with empty rows last; row {r} is out of order"
        )
    per_block = torch.bincount(blocks, minlength=len(token_bounds) - 1)
    return _bounds(per_block.tolist())


def check_map_within_tokens(
    name: str, token_to_atom: torch.Tensor, atom_tokens: torch.Tensor
) -> torch.Tensor:
    """Check that a ``[N, A]`` one-hot map picks, for each token, an atom OF that token.

    Returns
    -------
    torch.Tensor
        int64 ``[N]``: the atom each token picks, ``-1`` for none (the map's index form,
        :func:`physicsnemo_foldcp.sharding.layout.dense_map_to_index`).

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


def build_plan(
    lengths: Mapping[str, int],
    cp: tuple[int, int],
    *,
    atom_tokens: torch.Tensor | None = None,
    rset_bounds_from: tuple[str, torch.Tensor] | None = None,
    token_multiple: int = 1,
    atom_multiple: int = 1,
    token_bounds: Sequence[int] | None = None,
) -> ShardingPlan:
    """Make the plan for one sample.

    Parameters
    ----------
    lengths : Mapping[str, int]
        Length of every axis meaning the sample uses (``tokens`` required; ``atoms``,
        ``msa``, ``rset`` when present).
    cp : tuple[int, int]
        ``(cp0, cp1)``.
    atom_tokens : torch.Tensor, optional
        int64 ``[A]`` token of each atom (-1 for trailing pads), from
        :func:`atom_tokens_from_map`; required when the sample has atoms.
    rset_bounds_from : tuple[str, torch.Tensor], optional
        ``(name, [R, A] map)`` of the feature that defines the rset rows.
    token_multiple, atom_multiple : int, default 1
        Per-shard padding multiples.
    token_bounds : sequence of int, optional
        Explicit ``cp0 + 1`` row-block token boundaries (a balanced plan); the default
        splits tokens into blocks that differ by at most one.
    """
    for label, m in (("token_multiple", token_multiple), ("atom_multiple", atom_multiple)):
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"{label} must be an integer >= 1, got {m!r}")
    cp0 = cp[0]
    n_tokens = int(lengths[TOKENS])
    if token_bounds is None:
        token_bounds = _bounds(split_sizes(n_tokens, cp0))
    token_bounds = tuple(int(b) for b in token_bounds)
    if (
        len(token_bounds) != cp0 + 1
        or token_bounds[0] != 0
        or token_bounds[-1] != n_tokens
        or any(b > c for b, c in zip(token_bounds, token_bounds[1:]))
    ):
        raise ValueError(
            f"token_bounds {token_bounds} must be {cp0 + 1} non-decreasing boundaries from 0 "
            f"to N={n_tokens}"
        )
    if ATOMS in lengths:
        if atom_tokens is None:
            raise FeatureValidationError("atom features need atom_to_token to place their atoms")
        per_token = torch.bincount(atom_tokens[atom_tokens >= 0], minlength=n_tokens)
        starts = _bounds(per_token.tolist())
        atom_bounds = tuple(starts[b] for b in token_bounds[:-1]) + (int(lengths[ATOMS]),)
    else:
        atom_bounds = (0,) * (cp0 + 1)
    rset_bounds = None
    if rset_bounds_from is not None and atom_tokens is not None:
        rset_bounds = _rows_per_block(*rset_bounds_from, atom_tokens, token_bounds)
    return ShardingPlan(
        cp=(int(cp[0]), int(cp[1])),
        token_bounds=token_bounds,
        atom_bounds=atom_bounds,
        rset_bounds=rset_bounds,
        msa_rows=int(lengths[MSA]) if MSA in lengths else None,
        token_multiple=token_multiple,
        atom_multiple=atom_multiple,
    )
