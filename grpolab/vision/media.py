"""A row's images as its model takes them, and the model inputs of a batch whose rows carry images.

:class:`Media` is one row's bundle: what the processor made of the row's images (pixel values and the family's
metadata, in the row's own layout, so nothing has to be split per row later), how many placeholder tokens they fill,
and a cache of the vision tower's output. The G rollouts of a group hold the *same* ``Media`` object, so:

- the tower runs once per prompt per step, whether it is the sampler, the old-policy pass or each of the mu updates
  that asks (with the tower frozen its output is a constant of the step; the projector after it trains and runs,
  with its gradient, in every forward: the same gradient as recomputing the tower, which tests/vision/test_vision.py checks);
- the projector runs once per distinct prompt in a forward, its output indexed out to the rows that share it.

:func:`model_inputs` is the one place a batch's rows become a forward's keyword arguments: ids, attention mask and
positions for text (unchanged from the text-only trainer), the merged embeddings and the family's positions for rows
with images.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
from torch import nn

from grpolab.vision.families import Family


@dataclasses.dataclass(eq=False)
class Media:
    """One row's images as its model takes them: one *part* per processor call that made them (the prompt's images;
    in an episode, each environment answer's too), in the order their placeholders stand in the row."""

    family: Family
    parts: tuple[dict[str, torch.Tensor], ...]
    """Each part's image inputs for this row alone (``pixel_values`` and the family's metadata)."""
    spans: tuple[tuple[int, int], ...]
    """Each part's tokens in the row, ``[start, end)`` counted over its real tokens (padding not counted): the image
    tokens inside a span are that part's placeholders; one the policy samples is a plain token."""
    tokens: int
    """Placeholder tokens the images fill."""
    images: int = 1
    """How many images."""
    _towers: dict = dataclasses.field(default_factory=dict, repr=False)
    """(id(model), part) -> the frozen tower's output for that part (see the module docstring)."""

    @classmethod
    def of(cls, family: Family, inputs: dict[str, torch.Tensor], length: int, tokens: int, images: int) -> Media:
        """A bundle of one part: the images of a text of ``length`` tokens that starts the row."""
        return cls(family, (inputs,), ((0, length),), tokens, images)

    def shifted(self, at: int) -> Media:
        """This bundle for text that starts at real token ``at`` of its row, not at 0."""
        spans = tuple((s + at, e + at) for s, e in self.spans)
        return Media(self.family, self.parts, spans, self.tokens, self.images)

    def then(self, other: Media) -> Media:
        """This row's images followed by ``other``'s (an episode's next turn shows a new picture)."""
        parts, spans = self.parts + other.parts, self.spans + other.spans
        return Media(self.family, parts, spans, self.tokens + other.tokens, self.images + other.images)

    def key(self) -> tuple:
        """What the bundle holds, comparable across bundles: two encodings of the same images give equal keys."""
        digest = hashlib.sha256()
        for part in self.parts:
            for name, t in sorted(part.items()):
                digest.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
                digest.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return (self.family.name, self.spans, self.tokens, self.images, digest.hexdigest())

    def to(self, device) -> Media:
        """This bundle with its tensors on ``device`` (itself when they are there: the tower cache is kept)."""
        device = torch.device(device)
        if all(t.device == device for part in self.parts for t in part.values()):
            return self
        parts = tuple({k: v.to(device) for k, v in part.items()} for part in self.parts)
        return Media(self.family, parts, self.spans, self.tokens, self.images)

    def __getstate__(self):  # sent to another process without its cache (which is keyed by this process's models)
        state = dict(self.__dict__)
        state["_towers"] = {}
        return state


class _Reached(Exception):
    """Raised by a pre-hook on the projector to stop the image-feature path there, carrying the projector's input."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value


def tower_output(model: nn.Module, family: Family, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The vision tower's output for one part's images: the projector's input, got by running the model's own
    image-feature path and stopping it at the projector, so each family's selection of layers and patches is its own
    code's."""
    projector = family.projector_module(model)

    def stop(module, args):
        raise _Reached(args[0])

    hook = projector.register_forward_pre_hook(stop)
    try:
        family.image_features(model, inputs)
    except _Reached as reached:
        return reached.value
    finally:
        hook.remove()
    raise RuntimeError(f"{family.name}: the image-feature path never reached {family.projector}")


def image_features(model: nn.Module, media: Media) -> torch.Tensor:
    """``[tokens, d]`` the row's image features, in the order its placeholder tokens take them: the projector on the
    tower's output, the latter cached while no tower parameter trains."""
    family = media.family
    frozen = not any(p.requires_grad for p in family.tower_parameters(model))
    projector = family.projector_module(model)
    out = []
    for k, inputs in enumerate(media.parts):
        key = (id(model), k)
        if frozen and key in media._towers:
            tower = media._towers[key]
        else:
            with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
                tower = tower_output(model, family, inputs)
            if frozen:
                media._towers[key] = tower.detach()
        feats = projector(tower)
        out.append(feats.reshape(-1, feats.shape[-1]))  # [part's tokens, d]
    return torch.cat(out)  # [tokens, d]


def placeholders(ids: torch.Tensor, mask: torch.Tensor, media, image_token: int) -> torch.Tensor:
    """``[N, L]`` True at each row's image placeholders: the image tokens inside its bundle's spans (an image token
    the policy samples is a plain token) of left-padded rows ``ids``, ``mask``."""
    real = mask.cumsum(-1) - 1  # [N, L] each token's place among the row's real tokens
    inside = torch.zeros_like(mask, dtype=torch.bool)
    for n, m in enumerate(media):
        for start, end in m.spans if m is not None else ():
            inside[n] |= (real[n] >= start) & (real[n] < end)
    return (ids == image_token) & inside & mask.bool()


def model_inputs(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, media=None) -> dict[str, torch.Tensor]:
    """The forward's keyword arguments for left-padded rows ``ids``, ``mask`` ``[N, L]``.

    Text rows (``media`` None, or no row with images): ids, mask and positions that count real tokens only, so left
    padding does not shift them. Rows with images: ``inputs_embeds``, the token embeddings with each row's
    placeholders replaced by its image features, and the family's positions.

    Args:
        model (nn.Module): the policy's transformers model (for rows with images a vision-language one, under any peft
            wrapper: its input embeddings, tower and projector are run here).
        ids (torch.Tensor): [N, L] left-padded token ids: L = P + T for prompts with their completions
            (:func:`grpolab.models.logprobs.completion_logprobs`), L = P for a prefill of distinct prompts.
        mask (torch.Tensor): [N, L] 1 on real tokens, 0 on padding (the prompts' on the left, the completions' on
            the right).
        media (Sequence[Media | None] | None): [N] each row's images (a group's rows hold the same :class:`Media`,
            whose features are computed once), None for a row without; None for a batch of text rows.

    Returns:
        dict[str, torch.Tensor]: text rows: ``input_ids`` [N, L] (``ids``), ``attention_mask`` [N, L] (``mask``)
            and ``position_ids`` [N, L]. Rows with images: ``inputs_embeds`` [N, L, d] (d: the language model's
            width) in place of ``input_ids``, ``attention_mask`` [N, L], and ``position_ids`` from
            :meth:`Family.positions`: [N, L], or [3, N, L] for Qwen's M-RoPE.

    Raises:
        ValueError: the image features are not as many as the image placeholders in ``ids`` (the processor and the
            model disagree on the tokens per image).
    """
    if media is None or all(m is None for m in media):
        return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    family = next(m.family for m in media if m is not None)
    image = placeholders(ids, mask, media, family.image_token_id(model.config))  # [N, L]
    embeds = model.get_input_embeddings()(ids)  # [N, L, d]
    features, done = [], {}
    for m in media:
        if m is not None:
            if id(m) not in done:  # a group's rows share their prompt's bundle: projected once
                done[id(m)] = image_features(model, m)
            features.append(done[id(m)])
    features = torch.cat(features).to(embeds.dtype)  # [sum of tokens, d] in row order
    if features.shape[0] != int(image.sum()):
        raise ValueError(
            f"{family.name}: {features.shape[0]} image features for {int(image.sum())} image tokens in the ids; "
            "the processor and the model disagree on the tokens per image"
        )
    embeds = embeds.masked_scatter(image[..., None], features)
    position = family.positions(model, ids, mask, image, media)
    return {"inputs_embeds": embeds, "attention_mask": mask, "position_ids": position}


def decode_positions(position: torch.Tensor) -> torch.Tensor:
    """``[N, L]`` one position per token from a forward's ``position_ids`` (``[N, L]``, or ``[3, N, L]`` M-RoPE, whose
    three agree on text): what the decode loop continues from, one text token at a time."""
    return position if position.ndim == 2 else position.amax(0)


def text_only(media, who: str = "generator processes") -> None:
    """Refuse rows with images where ``who`` does not draw them (one line: what draws them instead)."""
    if media is not None and any(m is not None for m in media):
        raise NotImplementedError(
            f"{who} take text prompts only; prompts with images are drawn by grpolab's own sampler "
            "(--rollout-engine hf, without --generators)"
        )


def in_prompts(media, prompt_mask: torch.Tensor) -> bool:
    """Whether every row's images sit in its prompt (``prompt_mask`` ``[N, P]``): not in an episode's later turns,
    which the shared-prefix forward would pass as text."""
    lengths = prompt_mask.sum(1).tolist()  # [N] real prompt tokens
    return all(m is None or all(end <= n for _, end in m.spans) for m, n in zip(media, lengths))
