"""Boltz-2 whole: the trunk, diffusion sampling, confidence and B-factor heads.

:class:`Boltz2Model` is :class:`~physicsnemo_foldcp.models.boltz2_trunk.Boltz2Trunk` plus
the submodules of ``boltz.model.models.boltz2.Boltz2`` past the trunk, built by Boltz's own
classes under Boltz's attribute names (``diffusion_conditioning``, ``structure_module``,
``confidence_module``, ``bfactor_module``), so a ``Boltz2`` state dict loads into it with
``strict=True`` (:meth:`Boltz2Model.from_boltz2`). :meth:`Boltz2Model.predict_step` runs
them in ``Boltz2.forward``'s order and returns what ``Boltz2.predict_step`` returns, which
is what Boltz's writer reads.

Training keeps the trunk's :meth:`~Boltz2Trunk.forward` and :meth:`~Boltz2Trunk.loss`.
Not built here (refused by :func:`check_supported`): the affinity module and steering
potentials.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from boltz.model.layers.structure_checks import check_structures
from boltz.model.modules.confidencev2 import ConfidenceModule
from boltz.model.modules.diffusion_conditioning import DiffusionConditioning
from boltz.model.modules.diffusionv2 import AtomDiffusion
from boltz.model.modules.trunkv2 import BFactorModule
from physicsnemo.domain_parallel import ShardTensor
from torch import nn

from physicsnemo_foldcp.core.whole import rows_of_whole, whole
from physicsnemo_foldcp.models.boltz2_config import Boltz2Config
from physicsnemo_foldcp.models.boltz2_trunk import Boltz2Trunk

#: ``Boltz2.__init__`` arguments that :class:`Boltz2Model` takes (same names, same
#: meaning); :meth:`Boltz2Model.from_boltz2` copies them from a model's hyperparameters.
BOLTZ2_HPARAMS = tuple(
    name for name in Boltz2Config.__dataclass_fields__ if name != "recycling_steps"
)

#: Keys of the ``predict_step`` output that the confidence module adds when PAE is on.
PAE_OUTPUTS = (
    "pae",
    "complex_pae",
    "complex_ipae",
    "chains_pae",
    "pair_chains_pae",
    "complex_pae_unweighted",
    "complex_ipae_unweighted",
    "chains_pae_unweighted",
    "pair_chains_pae_unweighted",
    "ptm",
    "iptm",
    "ligand_iptm",
    "protein_iptm",
    "pair_chains_iptm",
)
#: Features Boltz's ``check_structures`` reads (small index lists, replicated).
STRUCTURE_CHECK_FEATURES = (
    "chiral_atom_index",
    "chiral_reference_mask",
    "chiral_atom_orientations",
    "rdkit_bounds_index",
    "rdkit_bounds_bond_mask",
    "rdkit_bounds_angle_mask",
    "rdkit_lower_bounds",
    "rdkit_upper_bounds",
)
#: ``DiffusionConditioning.forward``'s outputs, in order: the sampler's
#: ``diffusion_conditioning`` keys.
CONDITIONING_OUTPUTS = ("q", "c", "to_keys", "atom_enc_bias", "atom_dec_bias", "token_trans_bias")
#: Confidence outputs that ``predict_step`` always returns.
CONFIDENCE_OUTPUTS = ("plddt", "complex_plddt", "complex_iplddt", "complex_pde", "complex_ipde")


class UnsupportedBoltz2Option(ValueError):
    """A ``Boltz2`` option this project does not run; the message says what to do."""


def check_supported(config: Boltz2Config) -> None:
    """Refuse the ``Boltz2`` options that :class:`Boltz2Model` does not run.

    Parameters
    ----------
    config : Boltz2Config
        The model's hyperparameters.

    Raises
    ------
    UnsupportedBoltz2Option
        ``use_kernels`` (cuequivariance's CUDA kernels: not distributed), or
        ``affinity_prediction`` (the affinity module and its crop are not distributed:
        run Boltz's own ``boltz predict`` with the affinity property on one GPU), or a
        steering potential switched on (``fk_steering``, ``physical_guidance_update``,
        ``contact_guidance_update``: the potentials read the whole structure each step;
        predict without them).
    """
    if config.use_kernels:
        raise UnsupportedBoltz2Option(
            "use_kernels=True: the cuequivariance triangle kernels are not distributed (the "
            "project's own triangle handlers run instead); set use_kernels=false, as "
            "`boltz predict --no_kernels`"
        )
    if config.affinity_prediction:
        raise UnsupportedBoltz2Option(
            "affinity_prediction=True: the affinity module is not distributed; predict the "
            "structure here and the affinity with Boltz's own `boltz predict` on one GPU"
        )
    steering = [
        key
        for key in ("fk_steering", "physical_guidance_update", "contact_guidance_update")
        if config.steering_args.get(key)
    ]
    if steering:
        raise UnsupportedBoltz2Option(
            f"steering_args {', '.join(steering)} = true: steering potentials are not "
            "distributed; set them to false (Boltz's `--use_potentials` off)"
        )


class Boltz2Model(Boltz2Trunk):
    """Boltz-2 for prediction: the trunk, structure module, confidence and B-factor heads.

    Parameters
    ----------
    config : Boltz2Config, optional
        The hyperparameters (``Boltz2.__init__``'s of the same names); small defaults
        otherwise.
    **overrides : Any
        Fields of ``config`` to replace (what the Hydra ``model`` group passes).

    Attributes
    ----------
    diffusion_conditioning : boltz.model.modules.diffusion_conditioning.DiffusionConditioning
        Pair and atom conditioning of the diffusion module, computed once per complex.
    structure_module : boltz.model.modules.diffusionv2.AtomDiffusion
        The diffusion sampler; its ``score_model`` is Boltz's ``DiffusionModule``.
    confidence_module : boltz.model.modules.confidencev2.ConfidenceModule
        Only with ``confidence_prediction``: pLDDT, PDE, PAE, resolved; ptm / iptm.
    bfactor_module : boltz.model.modules.trunkv2.BFactorModule
        Only with ``predict_bfactor``: the B-factor histogram of each token.

    Notes
    -----
    The trunk's attributes and :meth:`forward` / :meth:`loss` are :class:`Boltz2Trunk`'s.
    """

    config_class: ClassVar[type[Boltz2Config]] = Boltz2Config
    #: The prediction app writes structures for it (``predict_step``), not distograms.
    predicts_structures: ClassVar[bool] = True

    def __init__(self, config: Boltz2Config | None = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)
        c: Boltz2Config = self.config
        check_supported(c)
        score = c.score_model_args
        self.diffusion_conditioning = DiffusionConditioning(
            token_s=c.token_s,
            token_z=c.token_z,
            atom_s=c.atom_s,
            atom_z=c.atom_z,
            atoms_per_window_queries=c.atoms_per_window_queries,
            atoms_per_window_keys=c.atoms_per_window_keys,
            atom_encoder_depth=score["atom_encoder_depth"],
            atom_encoder_heads=score["atom_encoder_heads"],
            token_transformer_depth=score["token_transformer_depth"],
            token_transformer_heads=score["token_transformer_heads"],
            atom_decoder_depth=score["atom_decoder_depth"],
            atom_decoder_heads=score["atom_decoder_heads"],
            atom_feature_dim=self.atom_feature_dim,
            conditioning_transition_layers=score["conditioning_transition_layers"],
            use_no_atom_char=c.use_no_atom_char,
            use_atom_backbone_feat=c.use_atom_backbone_feat,
            use_residue_feats_atoms=c.use_residue_feats_atoms,
        )
        self.structure_module = AtomDiffusion(
            score_model_args={
                "token_s": c.token_s,
                "atom_s": c.atom_s,
                "atoms_per_window_queries": c.atoms_per_window_queries,
                "atoms_per_window_keys": c.atoms_per_window_keys,
                **score,
            },
            **c.diffusion_process_args,
        )
        if c.predict_bfactor:
            self.bfactor_module = BFactorModule(c.token_s, c.num_bins)
        if c.confidence_prediction:
            self.confidence_module = ConfidenceModule(
                c.token_s,
                c.token_z,
                token_level_confidence=c.token_level_confidence,
                bond_type_feature=c.bond_type_feature,
                fix_sym_check=c.fix_sym_check,
                cyclic_pos_enc=c.cyclic_pos_enc,
                conditioning_cutoff_min=c.conditioning_cutoff_min,
                conditioning_cutoff_max=c.conditioning_cutoff_max,
                **c.confidence_model_args,
            )

    @classmethod
    def from_boltz2(
        cls, model: nn.Module, *, predict_args: Mapping[str, Any] | None = None
    ) -> Boltz2Model:
        """The same model as a ``Boltz2``: its hyperparameters and weights (strict load).

        Parameters
        ----------
        model : nn.Module
            A ``boltz.model.models.boltz2.Boltz2`` built without ``compile_*``.
        predict_args : Mapping[str, Any], optional
            Replaces the model's ``predict_args``.

        Returns
        -------
        Boltz2Model
            On the CPU, holding copies of ``model``'s weights.
        """
        signature = inspect.signature(type(model).__init__).parameters.items()
        hparams = {n: p.default for n, p in signature if p.default is not inspect.Parameter.empty}
        hparams.update(model.hparams)
        kwargs = {name: hparams[name] for name in BOLTZ2_HPARAMS if hparams.get(name) is not None}
        if predict_args is not None:
            kwargs["predict_args"] = dict(predict_args)
        ours = cls(Boltz2Config(**kwargs))
        ours.load_state_dict(model.state_dict(), strict=True)
        return ours

    def predict_step(self, feats: Mapping[str, Any]) -> dict[str, Any]:
        """One prediction of batched Boltz-2 features, as ``Boltz2.predict_step`` makes it.

        On scattered features, the coordinates ``[M, A, 3]`` are plain tensors, the same on
        every rank of the domain (:mod:`physicsnemo_foldcp.boltz.diffusion`): Boltz's
        sampler and structure checks run on them as they are, and the ranks draw the serial
        noise from their shared random stream.

        Runs the trunk (``predict_args.recycling_steps``), the diffusion conditioning, the
        sampler (``sampling_steps``, ``diffusion_samples`` samples, at most
        ``max_parallel_samples`` at a time), Boltz's structure checks and the confidence
        module (samples one by one), without gradients.

        Parameters
        ----------
        feats : Mapping[str, Any]
            Boltz-2 inference features, batched (``B = 1``).

        Returns
        -------
        dict[str, Any]
            ``Boltz2.predict_step``'s keys: ``coords [M, A, 3]``, ``masks [1, A]``,
            ``token_masks [1, N]``, ``s``, ``z``, the structure-check counts ``[M]``, and
            with confidence ``plddt [M, N]``, ``pde [M, N, N]``, ``pae [M, N, N]``,
            ``confidence_score [M]``, ptm / iptm and complex / chain values, and
            ``exception: False``. As in Boltz, the B-factor head is not run.
        """
        args = self.config.predict_args
        samples = int(args["diffusion_samples"])
        feats = dict(feats)
        with torch.no_grad():
            trunk = self.run_trunk(feats, int(args["recycling_steps"]))
            s, z, s_inputs = trunk["s"], trunk["z"], trunk["s_inputs"]
            # the conditioning is read by the sampler only, the relative positions by the
            # conditioning only: neither stays alive into the confidence module
            conditioning = dict(
                zip(
                    CONDITIONING_OUTPUTS,
                    self.diffusion_conditioning(
                        s_trunk=s,
                        z_trunk=z,
                        relative_position_encoding=trunk.pop("relative_position_encoding"),
                        feats=feats,
                    ),
                    strict=True,
                )
            )
            with torch.autocast(s.device.type, enabled=False):
                sampled = self.structure_module.sample(
                    s_trunk=s.float(),
                    s_inputs=s_inputs.float(),
                    feats=feats,
                    num_sampling_steps=int(args["sampling_steps"]),
                    atom_mask=whole(feats["atom_pad_mask"]).float(),
                    multiplicity=samples,
                    max_parallel_samples=args["max_parallel_samples"],
                    steering_args=self.config.steering_args,
                    diffusion_conditioning=conditioning,
                )
            coords = sampled["sample_atom_coords"]
            del conditioning, sampled
            out: dict[str, Any] = {
                "exception": False,
                "masks": feats["atom_pad_mask"],
                "token_masks": feats["token_pad_mask"],
                "s": s,
                "z": z,
                "coords": coords,
            }
            checked = {k: whole(feats[k]) for k in STRUCTURE_CHECK_FEATURES if k in feats}
            checks = check_structures(coords.detach(), checked, samples)
            if self.config.confidence_prediction:
                out.update(self._confidence(trunk, coords, feats, samples))
            out.update(checks)
        return out

    def _confidence(
        self,
        trunk: Mapping[str, torch.Tensor],
        coords: torch.Tensor,
        feats: Mapping[str, Any],
        samples: int,
    ) -> dict[str, torch.Tensor]:
        """The confidence module's outputs that ``Boltz2.predict_step`` returns."""
        ref_pos = feats["ref_pos"]
        x_pred = rows_of_whole(coords, ref_pos) if isinstance(ref_pos, ShardTensor) else coords
        conf = self.confidence_module(
            s_inputs=trunk["s_inputs"],
            s=trunk["s"],
            z=trunk["z"],
            x_pred=x_pred,
            feats=dict(feats),
            pred_distogram_logits=trunk["pdistogram"][:, :, :, 0],
            multiplicity=samples,
            run_sequentially=True,
            use_kernels=self.use_kernels,
        )
        args = self.config.predict_args
        out = {key: conf[key] for key in CONFIDENCE_OUTPUTS}
        if args.get("write_full_pde", True):
            out["pde"] = conf["pde"]
        iptm = conf["iptm"]
        # Boltz ranks by 4/5 complex pLDDT + 1/5 ipTM, or pTM for a single chain (ipTM 0).
        interface = iptm if not torch.allclose(iptm, torch.zeros_like(iptm)) else conf["ptm"]
        out["confidence_score"] = (4 * conf["complex_plddt"] + interface) / 5
        if self.config.alpha_pae > 0:
            out.update({key: conf[key] for key in PAE_OUTPUTS})
            if not args.get("write_full_pae", True):
                del out["pae"]
        return out


__all__ = [
    "BOLTZ2_HPARAMS",
    "Boltz2Model",
    "UnsupportedBoltz2Option",
    "check_supported",
]
