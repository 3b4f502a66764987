"""One adapter per vision-language family: what differs between architectures, and nothing else.

Every family here answers the same four questions:

- which module *projects* the vision tower's output into the language model's width (it trains with the language
  model; the tower before it is frozen by default), and which module is the tower;
- which of the processor's outputs its ``get_image_features`` takes (pixel values, grid sizes, masks);
- which token stands for an image in the ids (the placeholder the features replace);
- how positions run over a sequence that holds images: one position per token for LLaVA and Idefics3, Qwen's
  three-dimensional M-RoPE (time, height, width) for Qwen2-VL and Qwen2.5-VL.

The families tested are LLaVA, Idefics3 (SmolVLM's architecture), Qwen2-VL and Qwen2.5-VL, each on a tiny random
configuration built in the tests (tests/helpers/vlm.py).
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _module(model: nn.Module, path: str) -> nn.Module:
    """The submodule at dotted ``path`` of the transformers model under any wrapper."""
    return base_model(model).get_submodule(path)


@dataclasses.dataclass(frozen=True)
class Family:
    """A vision-language architecture as grpolab drives it."""

    name: str
    model_types: tuple[str, ...]
    """The ``config.model_type`` values of the family."""
    tower: str
    """The vision tower's module path (frozen by default)."""
    projector: str
    """The module that maps the tower's output to the language model's width (trained with the language model)."""
    image_inputs: tuple[str, ...]
    """The processor outputs that ``get_image_features`` takes, in a row's own layout."""
    processor: str = "auto"
    """Its processor: ``auto`` (transformers' AutoProcessor) or ``qwen`` (grpolab's torchvision-free
    :class:`grpolab.vision.processing.QwenProcessor`)."""

    def image_token_id(self, config) -> int:
        """The id of the image placeholder token, the token the image features replace in the ids.

        Args:
            config (transformers.PretrainedConfig): the model's config (``image_token_id``, or the older
                ``image_token_index``).

        Returns:
            int: the placeholder's token id.
        """
        return int(getattr(config, "image_token_id", None) or config.image_token_index)

    def tower_module(self, model: nn.Module) -> nn.Module:
        """The vision tower, the module at :attr:`tower`.

        Args:
            model (nn.Module): the transformers model, or a peft wrapper around it.

        Returns:
            nn.Module: the tower (e.g. LLaVA's ``CLIPVisionModel``; Qwen's holds the projector inside it).
        """
        return _module(model, self.tower)

    def projector_module(self, model: nn.Module) -> nn.Module:
        """The projector, the module at :attr:`projector` that maps the tower's output to the language model's width.

        Args:
            model (nn.Module): the transformers model, or a peft wrapper around it.

        Returns:
            nn.Module: the projector (LLaVA's ``multi_modal_projector``, Idefics3's ``connector``, Qwen's ``merger``).
        """
        return _module(model, self.projector)

    def tower_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """The tower's own parameters (the projector's excluded where it sits inside the tower, as Qwen's merger).

        Args:
            model (nn.Module): the transformers model, or a peft wrapper around it.

        Returns:
            list[nn.Parameter]: the tower's parameters, in its ``parameters()`` order, none of the projector's.
        """
        inside = {id(p) for p in self.projector_module(model).parameters()}
        return [p for p in self.tower_module(model).parameters() if id(p) not in inside]

    def freeze_tower(self, model: nn.Module) -> int:
        """Stop the tower's parameters training (prime-rl's default: the language model and the projector train);
        returns how many parameters it holds.

        Args:
            model (nn.Module): the transformers model, or a peft wrapper around it; its tower's parameters are set to
                ``requires_grad=False`` in place.

        Returns:
            int: the number of scalars in the frozen parameters (the sum of their ``numel()``).
        """
        params = self.tower_parameters(model)
        for p in params:
            p.requires_grad_(False)
        return sum(p.numel() for p in params)

    def lora_targets(self, model: nn.Module, targets: str | list[str]) -> list[str]:
        """peft's ``target_modules`` for LoRA on the language model only: the full names of its linear layers
        (``targets`` 'all-linear', or those whose last name is in ``targets``). Left to match names, peft would put
        adapters on the vision tower's projections too (CLIP's and SigLIP's are also ``q_proj``, ``v_proj``).

        Args:
            model (nn.Module): the transformers model, or a peft wrapper around it.
            targets (str | list[str]): ``"all-linear"``, or the last names of the linear layers to adapt
                (``["q_proj", "v_proj"]``: ``--lora-targets`` as :attr:`grpolab.config.task.PolicySection.lora_modules`
                gives it).

        Returns:
            list[str]: full module names under the base model (``model.language_model.layers.0.self_attn.q_proj``),
                the language model's layers only.
        """
        base = base_model(model)
        decoder = base.get_decoder()
        prefix = next(name for name, m in base.named_modules() if m is decoder)
        return [
            f"{prefix}.{name}"
            for name, m in decoder.named_modules()
            if isinstance(m, nn.Linear) and (targets == "all-linear" or name.rsplit(".", 1)[-1] in targets)
        ]

    def language_scope(self, model: nn.Module) -> str:
        """A regex on parameter names (under any wrapper's prefix) that picks the language model and its head: what
        the gradient probes measure on a vision-language model. The projector runs once per prompt on features its
        G rollouts share, so its per-rollout gradients are not separable by the probes' per-row rules.

        Args:
            model (nn.Module): the transformers model, or a peft wrapper around it.

        Returns:
            str: a regex that matches the names under the decoder and the head (LLaVA's: those under
                ``model.language_model.`` and ``lm_head.``, wherever a wrapper's prefix puts them).
        """
        base = base_model(model)
        decoder, head = base.get_decoder(), base.get_output_embeddings()
        names = [name for name, m in base.named_modules() if m is decoder or m is head]
        return "|".join(rf"(^|\.){re.escape(n)}\." for n in names)

    def image_features(self, model: nn.Module, inputs: dict) -> None:
        """Run the model's own image-feature path on one row's ``inputs`` (the caller stops it at the projector).

        Args:
            model (nn.Module): the transformers model, or a peft wrapper around it.
            inputs (dict[str, torch.Tensor]): one part's image inputs (:attr:`grpolab.vision.media.Media.parts`):
                ``pixel_values`` and the family's metadata; only those :attr:`image_inputs` names are passed.

        Returns:
            None: the features are taken at the projector's input by the caller
                (:func:`grpolab.vision.media.tower_output`), which raises out of the path there.
        """
        base_model(model).model.get_image_features(**{k: inputs[k] for k in self.image_inputs if k in inputs})

    def positions(self, model, ids: torch.Tensor, mask: torch.Tensor, image: torch.Tensor, media) -> torch.Tensor:
        """Position ids ``[N, L]`` of left-padded rows: real tokens count from 0 (images are tokens like any).

        Args:
            model (nn.Module): the model (unused here; Qwen's M-RoPE asks it).
            ids (torch.Tensor): [N, L] left-padded token ids (unused here).
            mask (torch.Tensor): [N, L] 1 on real tokens, 0 on padding.
            image (torch.Tensor): [N, L] bool, True at the image placeholders (unused here).
            media (Sequence[Media | None]): [N] each row's images (unused here).

        Returns:
            torch.Tensor: [N, L] position ids (long), 0 on the left padding.
        """
        return (mask.cumsum(-1) - 1).clamp(min=0)


@dataclasses.dataclass(frozen=True)
class QwenFamily(Family):
    """Qwen2-VL and Qwen2.5-VL: pixels as a flat ``[patches, C * t * p * p]`` matrix with each image's grid
    ``(t, h, w)``, ``h * w / merge^2`` placeholder tokens per image, and M-RoPE positions."""

    def positions(self, model, ids: torch.Tensor, mask: torch.Tensor, image: torch.Tensor, media) -> torch.Tensor:
        """``[3, N, L]`` M-RoPE positions (time, height, width) from the model's own ``get_rope_index``: an image's
        tokens take its grid's coordinates and the text after it continues from the largest. A token after the last
        image has the same position in all three, so decoding continues each row as text
        (:func:`grpolab.vision.media.decode_positions`).

        Args:
            model (nn.Module): the Qwen2-VL or Qwen2.5-VL model, or a peft wrapper around it.
            ids (torch.Tensor): [N, L] left-padded token ids.
            mask (torch.Tensor): [N, L] 1 on real tokens, 0 on padding.
            image (torch.Tensor): [N, L] bool, True at the image placeholders.
            media (Sequence[Media | None]): [N] each row's images (:class:`grpolab.vision.media.Media`, or None);
                each part's ``image_grid_thw`` [images, 3] gives its images' grids.

        Returns:
            torch.Tensor: [3, N, L] position ids (time, height, width).
        """
        grids = [part["image_grid_thw"] for m in media if m is not None for part in m.parts]
        position, _ = base_model(model).model.get_rope_index(
            ids, mm_token_type_ids=image.int(), image_grid_thw=torch.cat(grids) if grids else None, attention_mask=mask
        )
        return position  # [3, N, L]


FAMILIES = (
    Family("llava", ("llava",), "model.vision_tower", "model.multi_modal_projector", ("pixel_values", "image_sizes")),
    Family("idefics3", ("idefics3", "smolvlm"), "model.vision_model", "model.connector",
           ("pixel_values", "pixel_attention_mask")),
    QwenFamily("qwen2-vl", ("qwen2_vl", "qwen2_5_vl"), "model.visual", "model.visual.merger",
               ("pixel_values", "image_grid_thw"), processor="qwen"),
)  # fmt: skip


def family_of(model_or_config) -> Family | None:
    """The one answer to "is this a vision-language model?": the family of a model (or its transformers config), None
    for a text model (its config has no vision part), a clear error for a vision-language type grpolab has no adapter
    for.

    Args:
        model_or_config (nn.Module | transformers.PretrainedConfig): a model (under any wrapper with a ``config``) or
            its config.

    Returns:
        Family | None: the family whose :attr:`Family.model_types` holds ``config.model_type``; None when the config
            has no ``vision_config``.

    Raises:
        ValueError: a vision-language ``model_type`` no family here adapts (the message lists the known ones).
    """
    config = getattr(model_or_config, "config", model_or_config)
    if getattr(config, "vision_config", None) is None:
        return None
    for family in FAMILIES:
        if config.model_type in family.model_types:
            return family
    known = ", ".join(t for f in FAMILIES for t in f.model_types)
    raise ValueError(
        f"grpolab has no adapter for the vision-language model type {config.model_type!r} (known: {known})"
    )
