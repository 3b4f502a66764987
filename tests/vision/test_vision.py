"""Vision-language models: each family's rows with images through grpolab's own forward, sampler and update, on
tiny random models (tests/helpers/vlm.py ``tiny_vlm``): LLaVA, Idefics3 and Qwen2-VL."""

from __future__ import annotations

import base64
import json

import pytest
import torch
from helpers.cli import run_cli
from helpers.paths import REPO
from helpers.vlm import VLM_FAMILIES, picture, save_tiny_vlm, tiny_vlm

from grpolab.common.batch import Batch, left_pad
from grpolab.data.dataset import load_records
from grpolab.data.jsonl import DataError
from grpolab.models.logprobs import completion_logprobs
from grpolab.rollout.sampler import sample_with_stats
from grpolab.vision.families import family_of
from grpolab.vision.media import Media, model_inputs, placeholders
from grpolab.vision.processing import encode, with_image_parts

ASK = [{"role": "user", "content": "Which colour?"}]
RED, BLUE = picture((255, 0, 0), (40, 30)), picture((0, 0, 255), (60, 60))  # two sizes


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def vlm(request):
    """``(family name, model, processor, family adapter)``."""
    model, processor = tiny_vlm(request.param)
    return request.param, model, processor, family_of(model.config)


def _rows(processor, family) -> list[tuple[list[int], Media | None]]:
    """Three prompts: one picture, two pictures of different sizes, none."""
    return [
        encode(processor, family, ASK, [RED]),
        encode(processor, family, ASK, [BLUE, RED]),
        encode(processor, family, ASK, []),
    ]


def _own_forward(model, family, ids: list[int], media: Media | None) -> torch.Tensor:
    """``[L, V]`` the model's own forward on one unpadded row, given the processor's pixels as it takes them."""
    one = torch.tensor([ids])
    kwargs = dict(media.parts[0]) if media is not None else {}
    if family.name == "qwen2-vl" and media is not None:  # Qwen computes its M-RoPE positions from these
        kwargs["mm_token_type_ids"] = (one == family.image_token_id(model.config)).int()
    return model(input_ids=one, **kwargs).logits[0]


@torch.no_grad()
def test_rows_with_images_of_several_sizes_score_as_the_models_own_forward_row_by_row(vlm):
    name, model, processor, family = vlm
    rows = _rows(processor, family)
    ids, mask = left_pad([r[0] for r in rows], processor.tokenizer.pad_token_id)  # [3, P]
    media = [m for _, m in rows]
    assert media[0].tokens > 0 and media[1].tokens > media[0].tokens and media[2] is None
    logits = model(**model_inputs(model, ids, mask, media)).logits  # [3, P, V]
    for i, (row, m) in enumerate(rows):
        want = _own_forward(model, family, row, m)
        assert torch.allclose(logits[i, -len(row) :], want, atol=1e-5), (name, i)


def test_keyed_rollouts_are_the_same_alone_and_in_a_batch_and_the_trainer_scores_them_as_sampled(vlm):
    name, model, processor, family = vlm
    rows = _rows(processor, family)
    prompts, media = [r[0] for r in rows for _ in range(2)], [r[1] for r in rows for _ in range(2)]  # G = 2
    keys = [(3, i) for i in range(6)]
    kw = dict(max_new_tokens=6, temperature=1.0, top_p=1.0, eos_id=-1, pad_id=processor.tokenizer.pad_token_id)
    together = sample_with_stats(model, prompts, keys, media=media, **kw)
    for i in range(6):
        alone = sample_with_stats(model, [prompts[i]], [keys[i]], media=[media[i]], **kw)
        assert torch.equal(together.batch.completion_ids[i], alone.batch.completion_ids[0]), (name, i)
    assert together.batch.media == tuple(media)
    with torch.no_grad():
        scored = completion_logprobs(model, together.batch)
    assert torch.allclose(scored, together.logprobs, atol=1e-5), name


def test_an_image_token_the_policy_samples_is_a_plain_token_not_a_placeholder(vlm):
    name, model, processor, family = vlm
    token = family.image_token_id(model.config)
    ids, media = encode(processor, family, ASK, [RED])
    prompt, prompt_mask = left_pad([ids], processor.tokenizer.pad_token_id)
    completion = torch.tensor([[5, token, 6]])  # the policy drew the image token in its reply
    batch = Batch(prompt, prompt_mask, completion, torch.ones_like(completion), (media,))
    full = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    marked = placeholders(full, torch.ones_like(full), batch.media, token)  # [1, P + 3]
    assert int(marked.sum()) == media.tokens and not marked[:, prompt.shape[1] :].any()
    with torch.no_grad():
        assert torch.isfinite(completion_logprobs(model, batch)).all()  # features still match the placeholders


def test_a_frozen_tower_runs_once_per_prompt_and_its_cache_gives_the_recomputed_gradient(vlm):
    name, model, processor, family = vlm
    model = model.train()
    family.freeze_tower(model)
    calls = []
    hook = family.tower_module(model).register_forward_pre_hook(
        lambda *a: calls.append(1)
    )  # Qwen's tower holds its projector

    def batch_of(rows) -> Batch:
        prompts, media = [r[0] for r in rows for _ in range(3)], [r[1] for r in rows for _ in range(3)]  # G = 3
        ids, mask = left_pad(prompts, processor.tokenizer.pad_token_id)
        completion = torch.tensor([[7, 8, 9, 10]] * len(prompts))
        return Batch(ids, mask, completion, torch.ones_like(completion), tuple(media))

    def gradient(batch: Batch) -> dict[str, torch.Tensor]:
        model.zero_grad()
        completion_logprobs(model, batch).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    try:
        cached = batch_of(_rows(processor, family)[:2])
        first = gradient(cached)  # fills the cache: one tower pass per prompt (the shared bundle of its 3 rows)
        assert len(calls) == 2
        again = gradient(cached)  # the old-policy pass, then each of mu updates: no tower pass
        assert len(calls) == 2
        fresh = gradient(batch_of(_rows(processor, family)[:2]))  # new bundles: the tower runs again
        assert len(calls) == 4
    finally:
        hook.remove()
    tower = {id(p) for p in family.tower_parameters(model)}
    assert not any(id(p) in tower for n, p in model.named_parameters() if n in first)
    assert any("projector" in n or "connector" in n or "merger" in n for n in first), "the projector trains"
    for n in first:
        assert torch.equal(first[n], again[n]) and torch.equal(first[n], fresh[n]), n


def test_images_join_the_first_user_message_as_trl_puts_them_unless_the_prompt_has_image_parts():
    system = {"role": "system", "content": "Be brief."}
    parts = with_image_parts([system, *ASK], 2)
    assert parts[0]["content"] == [{"type": "text", "text": "Be brief."}]
    assert parts[1]["content"] == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which colour?"}]
    placed = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Is"}, {"type": "image"}, {"type": "text", "text": "red?"}],
        }
    ]
    assert with_image_parts(placed, 1) == placed


def test_images_come_as_paths_bytes_or_pil_and_a_relative_path_reads_from_the_data_files_folder(tmp_path):
    (tmp_path / "pics").mkdir()
    RED.save(tmp_path / "pics" / "red.png")
    png = (tmp_path / "pics" / "red.png").read_bytes()
    rows = [
        {"prompt": ASK, "image": "pics/red.png"},
        {"prompt": ASK, "image": {"bytes": base64.b64encode(png).decode(), "path": None}},  # JSON: base64
        {"prompt": ASK, "images": ["pics/red.png", {"bytes": None, "path": str(tmp_path / "pics" / "red.png")}]},
        {
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which?"}]}],
            "image": "pics/red.png",
        },
    ]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = load_records(tmp_path / "data.jsonl")
    assert records[0]["image"] == str((tmp_path / "pics" / "red.png").resolve())
    assert records[3]["prompt"][0]["content"][0] == {"type": "image"}
    from grpolab.data.images import row_images

    for r in records:
        assert all(im.size == (40, 30) and im.getpixel((0, 0)) == (255, 0, 0) for im in row_images(r))
    assert len(row_images(records[2])) == 2
    import datasets

    table = datasets.Dataset.from_dict(
        {"prompt": ["Which colour?"] * 2, "image": [RED, str(tmp_path / "pics" / "red.png")]}
    )
    table.cast_column("image", datasets.Image()).to_parquet(tmp_path / "data.parquet")  # {"bytes", "path"} in Parquet
    for r in load_records(tmp_path / "data.parquet"):
        assert [im.getpixel((0, 0)) for im in row_images(r)] == [(255, 0, 0)]


def test_an_unreadable_image_stops_the_run_before_any_step_in_one_line_naming_the_row_and_column(tmp_path):
    rows = [
        {"prompt": ASK, "image": "missing.png", "answer": "red"},
        {"prompt": ASK, "image": {"bytes": "bm90IGEgcG5n"}},
    ]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"data.jsonl:1, column 'image': cannot read the image"):
        load_records(tmp_path / "data.jsonl")
    model = save_tiny_vlm("llava", tmp_path / "model")
    res = run_cli(["train", "--model", model, "--data", "data.jsonl", "--reward-fn", "reward_fixtures:names_the_colour",
                   "--steps", "1", "--out", "run"], tmp_path)  # fmt: skip
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "data.jsonl:1, column 'image'" in lines[0] and "Traceback" not in res.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_environment_that_returns_a_picture_shows_it_in_the_next_turn_masked_like_its_text(tmp_path):
    from env_fixtures import ShowsAPicture
    from helpers.runs import quiet

    import grpolab
    from grpolab.env.protocol import EpisodeLimits
    from grpolab.models.policy import load_policy
    from grpolab.rollout.engine import EngineSpec, HFEngine, SamplingSettings
    from grpolab.rollout.episodes import EpisodeRunner, episode_rows

    save_tiny_vlm("llava", tmp_path / "model")
    policy = load_policy(str(tmp_path / "model"))
    engine = HFEngine(policy.model, EngineSpec(policy.eos_id, policy.pad_id))
    runner = EpisodeRunner(engine, policy, ShowsAPicture, limits=EpisodeLimits(max_turns=2))
    records = [{"prompt": "", "answer": c} for c in ("red", "blue")]
    episodes = runner.play(records, [(0, 0), (0, 1)], SamplingSettings(max_new_tokens=5, temperature=1.0))
    rows = episode_rows(episodes, policy.pad_id)
    token = policy.family.image_token_id(policy.model.config)
    assert all(e.turns == 2 for e in episodes) and rows.batch.media is not None
    for n, m in enumerate(rows.batch.media):
        seg = episodes[n].segments[0]
        start = len(seg.prompt) + seg.turn.count(0)  # the environment's tokens follow the first reply
        assert m.images == 1 and m.spans == ((start, start + seg.turn[start - len(seg.prompt) :].count(-1)),)
        shown = (rows.batch.completion_ids[n] == token) & rows.batch.completion_mask[n].bool()
        assert int(shown.sum()) == m.tokens > 0  # the picture's placeholders sit among the environment's tokens
        assert not rows.action[n][shown].any()  # ... which never enter the loss
    with torch.no_grad():
        scored = completion_logprobs(policy.model, rows.batch)  # the trainer sees the picture the sampler saw
    assert torch.allclose(scored * rows.action, rows.logprobs * rows.action, atol=1e-5)
    run = grpolab.train(str(tmp_path / "model"), records * 2, "reward_fixtures:always_one", env=ShowsAPicture,
                        out=str(tmp_path / "run"), steps=2, group_size=2, prompts_per_step=2, max_turns=2,
                        max_new_tokens=5, eval_fraction=0, log=quiet)  # fmt: skip
    assert [r["step"] for r in run.metrics][-1] == 2


def test_the_shared_prefix_encodes_each_prompt_with_its_pictures_once_and_gives_the_padded_gradient(vlm):
    name, model, processor, family = vlm
    rows = _rows(processor, family)
    prompts, media = [r[0] for r in rows for _ in range(2)], [r[1] for r in rows for _ in range(2)]  # G = 2
    ids, mask = left_pad(prompts, processor.tokenizer.pad_token_id)
    completion = torch.tensor([[7, 8, 9, 10], [11, 12, 0, 0]] * 3)
    batch = Batch(ids, mask, completion, (completion > 0).long(), tuple(media))
    params = [p for p in model.parameters() if p.requires_grad]
    got = {}
    for shared in (False, True):
        logp = completion_logprobs(model, batch, shared_prefix=shared)  # [6, 4]
        got[shared] = (logp.detach(), torch.autograd.grad(logp.sum(), params, allow_unused=True))
    assert torch.allclose(got[True][0], got[False][0], atol=1e-5), name
    for a, b in zip(got[True][1], got[False][1]):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, atol=1e-6)), name


def test_a_groups_rollouts_share_one_prompt_encoding_and_one_bundle_of_pictures(tmp_path):
    from grpolab.models.policy import load_policy
    from grpolab.rollout.engine import EngineSpec, HFEngine, SamplingSettings
    from grpolab.rollout.episodes import EpisodeRunner, episode_rows

    save_tiny_vlm("qwen2-vl", tmp_path / "model")
    policy = load_policy(str(tmp_path / "model"))
    runner = EpisodeRunner(HFEngine(policy.model, EngineSpec(policy.eos_id, policy.pad_id)), policy)
    red, blue = {"prompt": ASK, "image": RED}, {"prompt": ASK, "image": BLUE}
    calls = []
    hook = policy.family.tower_module(policy.model).register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        episodes = runner.play([red] * 3 + [blue] * 3, [(0, g) for g in range(6)], SamplingSettings(4, 1.0))
    finally:
        hook.remove()
    media = episode_rows(episodes, policy.pad_id).batch.media
    assert media[0] is media[1] is media[2] and media[3] is media[4] is media[5] and media[0] is not media[3]
    assert len(calls) == 2  # the tower ran once per picture, for the 6 rollouts


def test_two_encodings_of_the_same_pictures_have_one_key_and_other_pictures_another(vlm):
    """What a draw ahead of the generator process is matched by (its own encoding of the step's records)."""
    name, model, processor, family = vlm
    (_, a), (_, b), (_, c) = (encode(processor, family, ASK, images) for images in ([RED], [RED], [BLUE]))
    assert a is not b and a.key() == b.key() and a.key() != c.key()


def test_family_of_is_the_one_answer_to_is_this_a_vision_language_model(vlm):
    """A model or its config: its family for a vision-language model, None for a text one, one line for a
    vision-language type grpolab has no adapter for; a processor loads by the family's own name for it."""
    from transformers import AutoConfig

    name, model, _, family = vlm
    assert family_of(model) is family and family.name == name and family.processor in ("auto", "qwen")
    text = AutoConfig.from_pretrained(REPO / "grpolab" / "assets" / "arith-sft")
    assert family_of(text) is None
    stranger = type("Config", (), {"model_type": "not-a-vlm-family", "vision_config": object()})()
    with pytest.raises(ValueError, match="no adapter for the vision-language model type 'not-a-vlm-family'"):
        family_of(stranger)
