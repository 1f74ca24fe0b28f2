"""A small Boltz-style trunk and distogram head in plain PyTorch.

:class:`ReferenceFoldModel` reads batched Boltz features (``[1, ...]``) and predicts a
distogram. Its ``forward`` holds no distributed code: called with plain tensors it is the
serial model; called with the ShardTensors of
:func:`physicsnemo_foldcp.scatter_features` (maps tagged by
:func:`physicsnemo_foldcp.ops.tag_maps`) it runs under context parallelism, because every
cross-axis step goes through an op of :mod:`physicsnemo_foldcp.ops` that has a ShardTensor
handler, and everything else (``Linear``, ``LayerNorm``, elementwise ops) acts on local
blocks through PhysicsNeMo's weight promotion.

Data flow (``B = 1``; ``N`` tokens, ``A`` atoms, distributed placements over
``(cp0, cp1)``):

===========================  =====================  =================================
step                         shape                  placement
===========================  =====================  =================================
atom features -> ``c``       ``[B, A, c_atom]``     ``(Shard(1), Replicate())``
token features -> ``s0``     ``[B, N, c_token]``    ``(Shard(1), Replicate())``
tokens -> atoms broadcast    ``[B, A, c_atom]``     ``(Shard(1), Replicate())``
atoms -> tokens mean         ``[B, N, c_token]``    ``(Shard(1), Replicate())``
pair init (outer sum, relpos,
token bonds)                 ``[B, N, N, c_pair]``  ``(Shard(1), Shard(2))``
blocks: pair transition,
pair-biased attention, single
transition, single -> pair   as above
distogram head               ``[B, N, N, bins]``    ``(Shard(1), Shard(2))``
===========================  =====================  =================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from physicsnemo_foldcp.ops import (
    atoms_to_tokens_mean,
    masked_mean,
    outer_sum,
    pair_mask,
    relative_position_encoding,
    relpos_width,
    tokens_to_atoms,
)
from physicsnemo_foldcp.ops.attention import pair_bias_attention

NUM_RESIDUE_TYPES = 33
"""Width of ``res_type`` and ``profile`` (Boltz's token vocabulary)."""
NUM_ELEMENTS = 128
"""Width of ``ref_element``."""
NAME_CHARS = 4 * 64
"""Width of ``ref_atom_name_chars`` flattened (4 characters, 64 classes)."""
NUM_MOL_TYPES = 4
"""Molecule kinds of ``mol_type``: protein, DNA, RNA, ligand."""
ATOM_FEATURES = 3 + 1 + NUM_ELEMENTS + NAME_CHARS
"""Width of the concatenated atom reference features."""
TOKEN_FEATURES = 2 * NUM_RESIDUE_TYPES + 1 + NUM_MOL_TYPES
"""Width of the concatenated token features."""

REQUIRED_FEATURES = (
    "ref_pos",
    "ref_charge",
    "ref_element",
    "ref_atom_name_chars",
    "atom_pad_mask",
    "atom_to_token",
    "res_type",
    "profile",
    "deletion_mean",
    "mol_type",
    "token_pad_mask",
    "residue_index",
    "token_index",
    "asym_id",
    "entity_id",
    "sym_id",
    "token_bonds",
)
"""Features :meth:`ReferenceFoldModel.forward` reads (the loss also reads
``disto_target`` and ``token_disto_mask``)."""


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of :class:`ReferenceFoldModel` (small defaults: a CPU step is quick).

    Attributes
    ----------
    c_atom, c_token, c_pair : int
        Channels of the atom single, token single and pair representations.
    n_blocks : int
        Trunk blocks.
    n_heads : int
        Attention heads; ``c_token`` must be a multiple of it.
    transition_factor : int
        Hidden width of the transitions, as a multiple of their input width.
    num_bins : int
        Distogram bins (64 for Boltz's ``disto_target``).
    r_max, s_max : int
        Clipping of the relative-position encoding.
    """

    c_atom: int = 16
    c_token: int = 32
    c_pair: int = 16
    n_blocks: int = 2
    n_heads: int = 2
    transition_factor: int = 2
    num_bins: int = 64
    r_max: int = 32
    s_max: int = 2

    def __post_init__(self) -> None:
        for name in ("c_atom", "c_token", "c_pair", "n_heads", "transition_factor", "num_bins"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_blocks < 0:
            raise ValueError(f"ModelConfig.n_blocks must be >= 0, got {self.n_blocks}")
        if self.c_token % self.n_heads:
            raise ValueError(
                f"ModelConfig.c_token={self.c_token} must be a multiple of n_heads={self.n_heads}"
            )

    def to_dict(self) -> dict[str, int]:
        """The sizes as a plain dict."""
        return asdict(self)


class Transition(nn.Module):
    """SwiGLU transition: ``fc3(silu(fc1(ln(x))) * fc2(ln(x)))``, on the last axis.

    Parameters
    ----------
    dim : int
        Input and output channels.
    factor : int
        Hidden channels are ``factor * dim``.
    """

    def __init__(self, dim: int, factor: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, factor * dim, bias=False)
        self.fc2 = nn.Linear(dim, factor * dim, bias=False)
        self.fc3 = nn.Linear(factor * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., dim] -> [..., dim]`` (any placement; no communication)."""
        h = self.norm(x)
        return self.fc3(F.silu(self.fc1(h)) * self.fc2(h))


class AtomEncoder(nn.Module):
    """Atom reference features -> atom single, conditioned on the token single, -> tokens.

    ``c = Linear(ref features) * atom_pad_mask``, plus the broadcast of the token single to
    its atoms (``tokens_to_atoms``), a transition, then the mean over each token's atoms
    (``atoms_to_tokens_mean``) projected to ``c_token``.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_atoms = nn.Linear(ATOM_FEATURES, config.c_atom)
        self.token_to_atom = nn.Linear(config.c_token, config.c_atom, bias=False)
        self.transition = Transition(config.c_atom, config.transition_factor)
        self.to_token = nn.Linear(config.c_atom, config.c_token, bias=False)

    def forward(self, feats: Mapping[str, torch.Tensor], s: torch.Tensor) -> torch.Tensor:
        """Aggregate atoms to tokens.

        Parameters
        ----------
        feats : Mapping[str, torch.Tensor]
            ``ref_pos [B, A, 3]``, ``ref_charge [B, A]``, ``ref_element [B, A, 128]``,
            ``ref_atom_name_chars [B, A, 4, 64]``, ``atom_pad_mask [B, A]``,
            ``atom_to_token`` (dense ``[B, A, N]`` or index ``[B, A]``). Distributed:
            ``(Shard(1), Replicate())``.
        s : torch.Tensor
            Token single ``[B, N, c_token]``, ``(Shard(1), Replicate())``.

        Returns
        -------
        torch.Tensor
            ``[B, N, c_token]``, ``(Shard(1), Replicate())``.
        """
        atom_to_token = feats["atom_to_token"]
        pad = feats["atom_pad_mask"].float()
        names = feats["ref_atom_name_chars"].float()
        ref = torch.cat(
            [
                feats["ref_pos"].float(),
                feats["ref_charge"].float().unsqueeze(-1),
                feats["ref_element"].float(),
                names.reshape(*names.shape[:-2], NAME_CHARS),
            ],
            dim=-1,
        )
        c = self.embed_atoms(ref) * pad.unsqueeze(-1)
        c = c + tokens_to_atoms(self.token_to_atom(s), atom_to_token)
        c = c + self.transition(c)
        n_tokens = s.shape[1]
        return atoms_to_tokens_mean(self.to_token(c), atom_to_token, n_tokens=n_tokens)


class PairBiasAttention(nn.Module):
    """Gated multi-head attention of the token single, biased by the pair.

    The pair's layer norm has no bias: it would add the same constant to every logit of a
    query row, which the softmax ignores (its gradient is zero, up to rounding).

    Parameters
    ----------
    c_token, c_pair, n_heads : int
        Single channels, pair channels, heads.
    """

    def __init__(self, c_token: int, c_pair: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.norm_s = nn.LayerNorm(c_token)
        self.norm_z = nn.LayerNorm(c_pair, bias=False)
        self.to_q = nn.Linear(c_token, c_token)
        self.to_k = nn.Linear(c_token, c_token, bias=False)
        self.to_v = nn.Linear(c_token, c_token, bias=False)
        self.to_bias = nn.Linear(c_pair, n_heads, bias=False)
        self.to_gate = nn.Linear(c_token, c_token, bias=False)
        self.to_out = nn.Linear(c_token, c_token, bias=False)

    def forward(self, s: torch.Tensor, z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Update of the single.

        Parameters
        ----------
        s : torch.Tensor
            ``[B, N, c_token]``, ``(Shard(1), Replicate())``.
        z : torch.Tensor
            ``[B, N, N, c_pair]``, ``(Shard(1), Shard(2))``.
        mask : torch.Tensor
            ``[B, N]`` token mask (keys), ``(Shard(1), Replicate())``.

        Returns
        -------
        torch.Tensor
            ``[B, N, c_token]``, ``(Shard(1), Replicate())``.
        """
        x = self.norm_s(s)
        batch, channels = x.shape[0], x.shape[-1]
        q = self.to_q(x).view(batch, -1, self.n_heads, channels // self.n_heads)
        k = self.to_k(x).view(batch, -1, self.n_heads, channels // self.n_heads)
        v = self.to_v(x).view(batch, -1, self.n_heads, channels // self.n_heads)
        bias = self.to_bias(self.norm_z(z))
        o = pair_bias_attention(q, k, v, bias, mask).reshape(batch, -1, channels)
        return self.to_out(torch.sigmoid(self.to_gate(x)) * o)


class SingleToPair(nn.Module):
    """Pair update from the single: ``outer_sum(a(ln(s)), b(ln(s)))``."""

    def __init__(self, c_token: int, c_pair: int):
        super().__init__()
        self.norm = nn.LayerNorm(c_token)
        self.rows = nn.Linear(c_token, c_pair, bias=False)
        self.columns = nn.Linear(c_token, c_pair, bias=False)

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        """``[B, N, c_token]`` (rows sharded) -> ``[B, N, N, c_pair]`` (the pair tile)."""
        x = self.norm(s)
        return outer_sum(self.rows(x), self.columns(x))


class TrunkBlock(nn.Module):
    """Pair transition, pair-biased attention, single transition, single -> pair update."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.pair_transition = Transition(config.c_pair, config.transition_factor)
        self.attention = PairBiasAttention(config.c_token, config.c_pair, config.n_heads)
        self.single_transition = Transition(config.c_token, config.transition_factor)
        self.single_to_pair = SingleToPair(config.c_token, config.c_pair)

    def forward(
        self, s: torch.Tensor, z: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Update ``(s [B, N, c_token], z [B, N, N, c_pair])``; placements are kept."""
        z = z + self.pair_transition(z)
        s = s + self.attention(s, z, mask)
        s = s + self.single_transition(s)
        z = z + self.single_to_pair(s)
        return s, z


class DistogramHead(nn.Module):
    """Distogram logits from the pair: ``Linear(ln(z))``."""

    def __init__(self, c_pair: int, num_bins: int):
        super().__init__()
        self.norm = nn.LayerNorm(c_pair)
        self.proj = nn.Linear(c_pair, num_bins)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """``[B, N, N, c_pair] -> [B, N, N, num_bins]`` (the pair tile stays a tile)."""
        return self.proj(self.norm(z))


class ReferenceFoldModel(nn.Module):
    """A Boltz-style model a Boltz user recognises, small enough for a CPU.

    Atom encoder, token input embedding, pair initialisation (outer sum of singles,
    relative-position encoding, token bonds), ``n_blocks`` trunk blocks (pair and single
    transitions, pair-biased attention over tokens, single -> pair update) and a distogram
    head.

    Parameters
    ----------
    config : ModelConfig, optional
        Sizes; the defaults otherwise. Keyword arguments override fields of it (what the
        Hydra ``model`` group passes: ``ReferenceFoldModel(c_token=64)``).

    Attributes
    ----------
    fsdp_units : tuple[type[nn.Module], ...]
        Submodule types the training loop ``fully_shard``-s one by one under FSDP2 (the
        trunk blocks), before the root.
    compile_regions : tuple[type[nn.Module], ...]
        Submodule types ``compile=regional`` compiles: they compute on local blocks only
        (no cross-axis op), so a compiled graph holds no communication.

    Notes
    -----
    Call it as ``model(**features)`` with batched (``[1, ...]``) features, plain tensors
    or the ShardTensors of :func:`physicsnemo_foldcp.scatter_features` after
    :func:`physicsnemo_foldcp.ops.tag_maps`. Extra features are ignored. Returns
    ``{"pdistogram": [B, N, N, bins], "s": [B, N, c_token], "z": [B, N, N, c_pair]}``
    (pair outputs as the ``(Shard(1), Shard(2))`` tile, ``s`` as ``(Shard(1),
    Replicate())`` when distributed).
    """

    fsdp_units: ClassVar[tuple[type[nn.Module], ...]] = (TrunkBlock,)
    compile_regions: ClassVar[tuple[type[nn.Module], ...]] = (Transition, DistogramHead)

    def __init__(self, config: ModelConfig | None = None, **overrides: int):
        super().__init__()
        config = config or ModelConfig()
        if overrides:
            config = ModelConfig(**{**config.to_dict(), **overrides})
        self.config = config
        self.embed_tokens = nn.Linear(TOKEN_FEATURES, config.c_token)
        self.atom_encoder = AtomEncoder(config)
        self.pair_rows = nn.Linear(config.c_token, config.c_pair, bias=False)
        self.pair_columns = nn.Linear(config.c_token, config.c_pair, bias=False)
        self.relpos = nn.Linear(relpos_width(config.r_max, config.s_max), config.c_pair)
        self.bonds = nn.Linear(1, config.c_pair, bias=False)
        self.blocks = nn.ModuleList(TrunkBlock(config) for _ in range(config.n_blocks))
        self.distogram = DistogramHead(config.c_pair, config.num_bins)

    def embed_inputs(self, feats: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Token single ``[B, N, c_token]`` from the token and atom features."""
        mol_type = feats["mol_type"].long().unsqueeze(-1)
        kinds = torch.arange(NUM_MOL_TYPES, device=mol_type.device)
        tokens = torch.cat(
            [
                feats["res_type"].float(),
                feats["profile"].float(),
                feats["deletion_mean"].float().unsqueeze(-1),
                (mol_type == kinds).float(),
            ],
            dim=-1,
        )
        s = self.embed_tokens(tokens)
        return s + self.atom_encoder(feats, s)

    def init_pair(self, feats: Mapping[str, torch.Tensor], s: torch.Tensor) -> torch.Tensor:
        """Pair ``[B, N, N, c_pair]``: outer sum of ``s`` + relpos + token bonds."""
        relpos = relative_position_encoding(
            feats["residue_index"],
            feats["token_index"],
            feats["asym_id"],
            feats["entity_id"],
            feats["sym_id"],
            r_max=self.config.r_max,
            s_max=self.config.s_max,
            dtype=s.dtype,
        )
        z = outer_sum(self.pair_rows(s), self.pair_columns(s))
        return z + self.relpos(relpos) + self.bonds(feats["token_bonds"].float())

    def forward(self, **feats: torch.Tensor) -> dict[str, torch.Tensor]:
        """Distogram logits of one batched sample (see the class notes)."""
        missing = [name for name in REQUIRED_FEATURES if name not in feats]
        if missing:
            raise KeyError(f"ReferenceFoldModel needs the features {missing}, which are missing")
        mask = feats["token_pad_mask"].float()
        s = self.embed_inputs(feats)
        z = self.init_pair(feats, s)
        for block in self.blocks:
            s, z = block(s, z, mask)
        return {"pdistogram": self.distogram(z), "s": s, "z": z}

    def loss(
        self, outputs: Mapping[str, torch.Tensor], feats: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """The training loss of :meth:`forward`'s outputs: :func:`reference_loss`.

        Parameters
        ----------
        outputs : Mapping[str, torch.Tensor]
            What :meth:`forward` returned (reads ``pdistogram [B, N, N, bins]``).
        feats : Mapping[str, torch.Tensor]
            The features it read (``disto_target``, ``token_disto_mask``).

        Returns
        -------
        torch.Tensor
            The scalar loss; distributed, a replicated ShardTensor holding the serial value.
        """
        return reference_loss(outputs, feats)


def distogram_loss(
    pdistogram: torch.Tensor,
    disto_target: torch.Tensor,
    token_disto_mask: torch.Tensor,
) -> torch.Tensor:
    """Distogram cross-entropy, averaged over the valid token pairs.

    Parameters
    ----------
    pdistogram : torch.Tensor
        Logits ``[B, N, N, bins]``. Distributed: ``(Shard(1), Shard(2))``.
    disto_target : torch.Tensor
        Boltz-1 ``[B, N, N, bins]`` or Boltz-2 ``[B, N, N, K, bins]`` (averaged over the
        ``K`` conformers). Distributed: ``(Shard(1), Shard(2))``.
    token_disto_mask : torch.Tensor
        ``[B, N]``, 1 for tokens with a distogram target. Distributed: ``(Shard(1),
        Replicate())``.

    Returns
    -------
    torch.Tensor
        The scalar loss ``sum(mask * CE) / (sum(mask) + 1e-6)`` over all pairs, with
        ``mask = m_i m_j``. Distributed: a replicated ShardTensor whose local value is the
        serial loss on every rank (the reduction is :func:`physicsnemo_foldcp.ops.
        masked_mean`).
    """
    target = disto_target.float()
    if target.ndim == pdistogram.ndim + 1:
        target = target.mean(dim=-2)
    errors = -(target * F.log_softmax(pdistogram, dim=-1)).sum(dim=-1)
    mask = pair_mask(token_disto_mask.float())
    return masked_mean(errors, mask)


def reference_loss(outputs: Mapping[str, torch.Tensor], feats: Mapping[str, torch.Tensor]):
    """:func:`distogram_loss` of a model's outputs against its features."""
    return distogram_loss(outputs["pdistogram"], feats["disto_target"], feats["token_disto_mask"])


__all__ = [
    "ATOM_FEATURES",
    "REQUIRED_FEATURES",
    "TOKEN_FEATURES",
    "AtomEncoder",
    "DistogramHead",
    "ModelConfig",
    "PairBiasAttention",
    "ReferenceFoldModel",
    "SingleToPair",
    "Transition",
    "TrunkBlock",
    "distogram_loss",
    "reference_loss",
]
