"""Boltz-2's trunk and distogram head, composed from Boltz's own modules.

:class:`Boltz2Trunk` holds the submodules of ``boltz.model.models.boltz2.Boltz2`` that
compute the distogram (input embedder, pair initialisation, recycling, templates, MSA
module, Pairformer, distogram head) under the SAME attribute names, so its ``state_dict``
is the trunk part of a ``Boltz2`` checkpoint (:func:`trunk_state_dict`,
:meth:`Boltz2Trunk.from_boltz2`), and runs them in the order of ``Boltz2.forward``. The
diffusion (structure) module, the confidence, affinity and B-factor heads are left out.

This module imports ``boltz`` (an optional extra): ``import physicsnemo_foldcp`` does not
import it, only ``physicsnemo_foldcp.models.boltz2_trunk`` (or the lazily resolved
``physicsnemo_foldcp.models.Boltz2Trunk``) does.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any, ClassVar

import boltz.model.layers.initialize as boltz_init
import torch
from boltz.data import const
from boltz.model.layers.pairformer import PairformerLayer, PairformerModule, PairformerNoSeqLayer
from boltz.model.loss.distogramv2 import distogram_loss
from boltz.model.modules.encodersv2 import RelativePositionEncoder
from boltz.model.modules.trunkv2 import (
    ContactConditioning,
    DistogramModule,
    InputEmbedder,
    MSALayer,
    MSAModule,
    TemplateModule,
    TemplateV2Module,
)
from torch import nn

from physicsnemo_foldcp.models.boltz2_config import Boltz2TrunkConfig

#: Width of Boltz-2's per-atom features before the optional groups (``ref_pos`` 3,
#: ``ref_charge`` 1, ``ref_element`` 128, ``ref_atom_name_chars`` 4 x 64).
ATOM_FEATURES_BASE = 3 + 1 + 128
ATOM_NAME_CHAR_FEATURES = 4 * 64
#: ``atom_backbone_feat`` width (``use_atom_backbone_feat``).
ATOM_BACKBONE_FEATURES = 17
#: ``res_type`` + ``modified`` + one-hot ``mol_type`` per atom (``use_residue_feats_atoms``).
ATOM_RESIDUE_FEATURES = 33 + 1 + 4

#: ``Boltz2.__init__`` arguments that :class:`Boltz2Trunk` takes (same names, same
#: meaning); :meth:`Boltz2Trunk.from_boltz2` copies them from a model's hyperparameters.
BOLTZ2_TRUNK_HPARAMS = tuple(
    f.name for f in dataclasses.fields(Boltz2TrunkConfig) if f.name != "recycling_steps"
)

#: Top-level ``Boltz2`` submodules a trunk may hold (``token_bonds_type`` with
#: ``bond_type_feature``, ``template_module`` with ``use_templates``).
TRUNK_PREFIXES = (
    "input_embedder",
    "s_init",
    "z_init_1",
    "z_init_2",
    "rel_pos",
    "token_bonds",
    "token_bonds_type",
    "contact_conditioning",
    "s_norm",
    "z_norm",
    "s_recycle",
    "z_recycle",
    "template_module",
    "msa_module",
    "pairformer_module",
    "distogram_module",
)


def atom_feature_width(
    use_no_atom_char: bool = False,
    use_atom_backbone_feat: bool = False,
    use_residue_feats_atoms: bool = False,
) -> int:
    """``atom_feature_dim`` that Boltz-2's atom encoder reads with these flags.

    Parameters
    ----------
    use_no_atom_char, use_atom_backbone_feat, use_residue_feats_atoms : bool
        The ``Boltz2`` flags of the same names.

    Returns
    -------
    int
        ``132`` (+ ``256`` atom-name characters unless ``use_no_atom_char``, + ``17``
        backbone features, + ``38`` residue features).
    """
    width = ATOM_FEATURES_BASE
    if not use_no_atom_char:
        width += ATOM_NAME_CHAR_FEATURES
    if use_atom_backbone_feat:
        width += ATOM_BACKBONE_FEATURES
    if use_residue_feats_atoms:
        width += ATOM_RESIDUE_FEATURES
    return width


def trunk_state_dict(
    state_dict: Mapping[str, torch.Tensor], prefixes: tuple[str, ...] = TRUNK_PREFIXES
) -> dict[str, torch.Tensor]:
    """The entries of a ``Boltz2`` state dict that belong to the trunk.

    Parameters
    ----------
    state_dict : Mapping[str, torch.Tensor]
        ``Boltz2.state_dict()`` or a checkpoint's ``"state_dict"``.
    prefixes : tuple[str, ...]
        Top-level submodule names kept (:data:`TRUNK_PREFIXES` by default).

    Returns
    -------
    dict[str, torch.Tensor]
        The entries whose first dotted component is in ``prefixes``.
    """
    return {k: v for k, v in state_dict.items() if k.split(".", 1)[0] in prefixes}


class Boltz2Trunk(nn.Module):
    """Boltz-2's trunk (embedding, recycling, MSA module, Pairformer) and distogram head.

    Composes Boltz's own modules exactly as ``boltz.model.models.boltz2.Boltz2`` builds
    and calls them up to ``pdistogram``; the arguments are ``Boltz2.__init__``'s of the
    same names (defaults: small, for a CPU, with Boltz-2's feature flags on).

    Parameters
    ----------
    config : Boltz2TrunkConfig, optional
        The hyperparameters (``Boltz2.__init__``'s of the same names); the small defaults
        otherwise.
    **overrides : Any
        Fields of ``config`` to replace (what the Hydra ``model`` group passes:
        ``Boltz2Trunk(token_z=64, pairformer_args={...})``).

    Attributes
    ----------
    config : Boltz2TrunkConfig
        The hyperparameters it was built with.
    input_embedder : boltz.model.modules.trunkv2.InputEmbedder
        Atom encoder + atom attention + token features -> ``s_inputs [B, N, token_s]``.
    s_init : nn.Linear
        ``token_s -> token_s``, no bias: ``s_init``.
    z_init_1, z_init_2 : nn.Linear
        ``token_s -> token_z``, no bias: outer sum of rows and columns.
    rel_pos : boltz.model.modules.encodersv2.RelativePositionEncoder
        Relative position encoding ``[B, N, N, token_z]``.
    token_bonds : nn.Linear
        ``1 -> token_z``, no bias, of ``token_bonds``.
    token_bonds_type : nn.Embedding
        Only with ``bond_type_feature``: ``len(const.bond_types) + 1`` bond types.
    contact_conditioning : boltz.model.modules.trunkv2.ContactConditioning
        Pair contact constraints (``contact_conditioning``, ``contact_threshold``).
    s_norm, z_norm : nn.LayerNorm
        Norms of the recycled ``s`` and ``z``.
    s_recycle, z_recycle : nn.Linear
        Recycling projections (gating-initialised, no bias).
    template_module : TemplateV2Module or TemplateModule
        Only with ``use_templates``.
    msa_module : boltz.model.modules.trunkv2.MSAModule
        MSA stack; layers are ``MSALayer``.
    pairformer_module : boltz.model.layers.pairformer.PairformerModule
        Pairformer; layers are ``PairformerLayer``.
    distogram_module : boltz.model.modules.trunkv2.DistogramModule
        Symmetrised pair -> ``[B, N, N, 1, num_bins]`` logits.
    fsdp_units : tuple[type[nn.Module], ...]
        The layer classes the training loop ``fully_shard``-s one by one under FSDP2.
    compile_regions : tuple[type[nn.Module], ...]
        Empty: no region is marked for ``compile=regional``.

    Notes
    -----
    Call it as ``model(**features)`` with batched (``[1, ...]``) Boltz-2 features (the
    atom axis padded to a multiple of ``atoms_per_window_queries``); extra features are
    ignored. Returns ``{"pdistogram": [B, N, N, 1, num_bins], "s": [B, N, token_s], "z":
    [B, N, N, token_z]}``: Boltz-2's own output shapes (one distogram).

    Unlike ``Boltz2.forward``, which turns gradients off outside training, gradients
    follow the caller's grad mode; as in Boltz, only the last recycling pass records
    them. Boltz-community's FlashPairformer inference route (a CUDA bf16 kernel scope
    that ``Boltz2.forward`` enters in eval mode) is not entered.

    The distogram reads ``z`` only, and Boltz's Pairformer never updates ``z`` from
    ``s``: :meth:`loss` gives zero gradients to ``s_init``, ``s_norm``, ``s_recycle`` and
    the Pairformer's single updates (in ``Boltz2`` the structure module reads ``s``).
    """

    fsdp_units: ClassVar[tuple[type[nn.Module], ...]] = (
        MSALayer,
        PairformerLayer,
        PairformerNoSeqLayer,
    )
    compile_regions: ClassVar[tuple[type[nn.Module], ...]] = ()

    #: The hyperparameter class (a subclass's adds fields).
    config_class: ClassVar[type[Boltz2TrunkConfig]] = Boltz2TrunkConfig

    def __init__(self, config: Boltz2TrunkConfig | None = None, **overrides: Any) -> None:
        super().__init__()
        config = config or self.config_class()
        if overrides:
            config = self.config_class(**{**config.to_dict(), **overrides})
        self.config = c = config
        atom_feature_dim = c.atom_feature_dim
        if atom_feature_dim is None:
            atom_feature_dim = atom_feature_width(
                c.use_no_atom_char, c.use_atom_backbone_feat, c.use_residue_feats_atoms
            )
        token_s, token_z = c.token_s, c.token_z
        self.atom_feature_dim = atom_feature_dim
        self.num_bins = c.num_bins
        self.aggregate_distogram = c.aggregate_distogram
        self.bond_type_feature = c.bond_type_feature
        self.use_templates = c.use_templates
        self.use_kernels = c.use_kernels
        self.use_flash_attn = c.use_flash_attn
        self.recycling_steps = c.recycling_steps

        self.input_embedder = InputEmbedder(
            atom_s=c.atom_s,
            atom_z=c.atom_z,
            token_s=token_s,
            token_z=token_z,
            atoms_per_window_queries=c.atoms_per_window_queries,
            atoms_per_window_keys=c.atoms_per_window_keys,
            atom_feature_dim=atom_feature_dim,
            use_no_atom_char=c.use_no_atom_char,
            use_atom_backbone_feat=c.use_atom_backbone_feat,
            use_residue_feats_atoms=c.use_residue_feats_atoms,
            **c.embedder_args,
        )
        self.s_init = nn.Linear(token_s, token_s, bias=False)
        self.z_init_1 = nn.Linear(token_s, token_z, bias=False)
        self.z_init_2 = nn.Linear(token_s, token_z, bias=False)
        self.rel_pos = RelativePositionEncoder(
            token_z, fix_sym_check=c.fix_sym_check, cyclic_pos_enc=c.cyclic_pos_enc
        )
        self.token_bonds = nn.Linear(1, token_z, bias=False)
        if c.bond_type_feature:
            self.token_bonds_type = nn.Embedding(len(const.bond_types) + 1, token_z)
        self.contact_conditioning = ContactConditioning(
            token_z=token_z,
            cutoff_min=c.conditioning_cutoff_min,
            cutoff_max=c.conditioning_cutoff_max,
        )
        self.s_norm = nn.LayerNorm(token_s)
        self.z_norm = nn.LayerNorm(token_z)
        self.s_recycle = nn.Linear(token_s, token_s, bias=False)
        self.z_recycle = nn.Linear(token_z, token_z, bias=False)
        boltz_init.gating_init_(self.s_recycle.weight)
        boltz_init.gating_init_(self.z_recycle.weight)
        if c.use_templates:
            template_cls = TemplateV2Module if c.use_templates_v2 else TemplateModule
            self.template_module = template_cls(token_z, **(c.template_args or {}))
        self.msa_module = MSAModule(token_z=token_z, token_s=token_s, **c.msa_args)
        self.pairformer_module = PairformerModule(token_s, token_z, **c.pairformer_args)
        self.distogram_module = DistogramModule(token_z, c.num_bins)

    @classmethod
    def from_boltz2(cls, model: nn.Module, *, recycling_steps: int = 0) -> Boltz2Trunk:
        """The trunk of a ``Boltz2`` model: its hyperparameters and weights (strict load).

        Parameters
        ----------
        model : nn.Module
            A ``boltz.model.models.boltz2.Boltz2`` (its ``hparams`` and ``state_dict``;
            built without ``compile_msa`` / ``compile_pairformer`` / ``compile_templates``).
        recycling_steps : int
            Default recycling steps of the trunk.

        Returns
        -------
        Boltz2Trunk
            On the CPU, holding copies of ``model``'s trunk weights.
        """
        # Boltz2's own defaults (not this config's) for anything the hparams lack.
        signature = inspect.signature(type(model).__init__).parameters.items()
        hparams = {n: p.default for n, p in signature if p.default is not inspect.Parameter.empty}
        hparams.update(model.hparams)
        kwargs = {name: hparams[name] for name in BOLTZ2_TRUNK_HPARAMS if name in hparams}
        trunk = cls(Boltz2TrunkConfig(**kwargs, recycling_steps=recycling_steps))
        trunk.load_state_dict(trunk_state_dict(model.state_dict()), strict=True)
        return trunk

    @property
    def atom_multiple(self) -> int:
        """Atoms per query window (``embedder_args.atoms_per_window_queries``).

        The sample's atom count must be a multiple of it, as Boltz's featurizer pads atoms.
        """
        return self.input_embedder.atom_encoder.atoms_per_window_queries

    def forward(
        self, recycling_steps: int | None = None, **feats: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Distogram logits of batched Boltz-2 features, in ``Boltz2.forward``'s order.

        Parameters
        ----------
        recycling_steps : int, optional
            Recycling steps (``self.recycling_steps`` if None).
        **feats : torch.Tensor
            Boltz-2 features, batched ``[B, ...]``.

        Returns
        -------
        dict[str, torch.Tensor]
            ``pdistogram [B, N, N, 1, num_bins]``, ``s [B, N, token_s]``,
            ``z [B, N, N, token_z]``.
        """
        out = self.run_trunk(
            feats, self.recycling_steps if recycling_steps is None else recycling_steps
        )
        return {key: out[key] for key in ("pdistogram", "s", "z")}

    def run_trunk(
        self, feats: Mapping[str, torch.Tensor], recycling_steps: int
    ) -> dict[str, torch.Tensor]:
        """The trunk pass of ``Boltz2.forward``, with what the structure module reads.

        Parameters
        ----------
        feats : Mapping[str, torch.Tensor]
            Boltz-2 features, batched ``[B, ...]``.
        recycling_steps : int
            Recycling steps (``recycling_steps + 1`` passes; only the last records
            gradients, as in Boltz).

        Returns
        -------
        dict[str, torch.Tensor]
            ``s_inputs [B, N, token_s]``, ``relative_position_encoding
            [B, N, N, token_z]``, ``s [B, N, token_s]``, ``z [B, N, N, token_z]`` and
            ``pdistogram [B, N, N, 1, num_bins]``; on a domain, ``s`` / ``s_inputs`` are
            row-sharded and the pair tensors tiles, as the features are.
        """
        grad = torch.is_grad_enabled()
        feats = dict(feats)
        s_inputs = self.input_embedder(feats)
        s_init = self.s_init(s_inputs)
        z_init = self.z_init_1(s_inputs)[:, :, None] + self.z_init_2(s_inputs)[:, None, :]
        relative_position_encoding = self.rel_pos(feats)
        z_init = z_init + relative_position_encoding
        z_init = z_init + self.token_bonds(feats["token_bonds"].float())
        if self.bond_type_feature:
            z_init = z_init + self.token_bonds_type(feats["type_bonds"].long())
        z_init = z_init + self.contact_conditioning(feats)

        s = torch.zeros_like(s_init)
        z = torch.zeros_like(z_init)
        mask = feats["token_pad_mask"].float()
        pair_mask = mask[:, :, None] * mask[:, None, :]
        kernels = {"use_kernels": self.use_kernels, "use_flash_attn": self.use_flash_attn}
        for i in range(recycling_steps + 1):
            last = i == recycling_steps
            with torch.set_grad_enabled(grad and last):
                if self.training and last and torch.is_autocast_enabled():
                    torch.clear_autocast_cache()
                s = s_init + self.s_recycle(self.s_norm(s))
                z = z_init + self.z_recycle(self.z_norm(z))
                if self.use_templates:
                    z = z + self.template_module(z, feats, pair_mask, **kernels)
                z = z + self.msa_module(z, s_inputs, feats, **kernels)
                s, z = self.pairformer_module(s, z, mask=mask, pair_mask=pair_mask, **kernels)

        return {
            "s_inputs": s_inputs,
            "relative_position_encoding": relative_position_encoding,
            "s": s,
            "z": z,
            "pdistogram": self.distogram_module(z),
        }

    def loss(
        self, outputs: Mapping[str, torch.Tensor], feats: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """Boltz-2's distogram loss (``boltz.model.loss.distogramv2.distogram_loss``).

        Plus ``0 * s.sum()``: the value is the distogram loss, and the single ``s`` gets a
        gradient (zeros). In ``Boltz2`` the structure module reads ``s``; here nothing
        would, and FSDP2's backward hook on each Pairformer layer, which needs a gradient
        for every input that requires one, would hand the ShardTensor ``s`` a plain zero
        tensor instead (and DDP would find unused parameters).

        Parameters
        ----------
        outputs : Mapping[str, torch.Tensor]
            What :meth:`forward` returned (reads ``pdistogram [B, N, N, 1, bins]`` and
            ``s [B, N, token_s]``).
        feats : Mapping[str, torch.Tensor]
            ``disto_target [B, N, N, K, bins]`` and ``token_disto_mask [B, N]``.

        Returns
        -------
        torch.Tensor
            The scalar loss (Boltz's global loss, the batch mean).
        """
        global_loss, _ = distogram_loss(
            dict(outputs), dict(feats), aggregate_distogram=self.aggregate_distogram
        )
        return global_loss + 0.0 * outputs["s"].sum()


__all__ = [
    "BOLTZ2_TRUNK_HPARAMS",
    "TRUNK_PREFIXES",
    "Boltz2Trunk",
    "atom_feature_width",
    "trunk_state_dict",
]
