"""--lora-targets and --lora-dropout: which layers get LoRA adapters, and the dropout on their input."""

from __future__ import annotations

import pytest
import torch
from helpers.models import tiny_llama
from helpers.runs import quiet, small_cfg

from grpolab.common.errors import ConfigError
from grpolab.config.task import PolicySection
from grpolab.models.lora import add_lora, load_lora

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # a Llama layer's


def _adapted(model) -> list[str]:
    """The last name part of every module that holds a LoRA adapter."""
    from peft.tuners.lora import LoraLayer

    return sorted(name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, LoraLayer))


def _lora_dropouts(model) -> list[float]:
    return [m.p for name, m in model.named_modules() if ".lora_dropout." in name and isinstance(m, torch.nn.Dropout)]


@pytest.fixture
def base(char_tokenizer):
    return tiny_llama(char_tokenizer, seed=0, num_layers=2)  # a fresh one: peft wraps it in place


def test_default_adapts_every_linear_layer_without_dropout(base):
    section = PolicySection()
    model = add_lora(base, 4, 8.0, section.lora_dropout, section.lora_modules)
    assert _adapted(model) == sorted(LINEAR * 2)  # the output head is left alone
    assert _lora_dropouts(model) == []  # p = 0: peft puts an Identity


def test_named_targets_and_dropout(base):
    section = PolicySection(lora_rank=4, lora_targets="q_proj, v_proj", lora_dropout=0.1)
    section.validate()
    assert section.lora_modules == ["q_proj", "v_proj"]
    model = add_lora(base, 4, 8.0, section.lora_dropout, section.lora_modules)
    assert _adapted(model) == ["q_proj", "q_proj", "v_proj", "v_proj"]
    assert _lora_dropouts(model) == [0.1] * 4


def test_a_saved_adapter_comes_back_on_its_own_layers(base, char_tokenizer, tmp_path):
    """Resume and ``grpolab merge`` reload an adapter: its layers are those adapter_config.json names."""
    add_lora(base, 4, 8.0, 0.0, ["q_proj", "v_proj"]).save_pretrained(tmp_path / "adapter")
    reloaded = load_lora(tiny_llama(char_tokenizer, seed=0, num_layers=2), tmp_path / "adapter")
    assert _adapted(reloaded) == ["q_proj", "q_proj", "v_proj", "v_proj"]


def test_lora_options_are_validated():
    with pytest.raises(ConfigError, match=r"--lora-dropout: must be in \[0, 1\), got 1"):
        PolicySection(lora_dropout=1.0).validate()
    with pytest.raises(ConfigError, match="--lora-targets: must be 'all-linear' or module names"):
        PolicySection(lora_targets=" , ").validate()


def test_trainer_passes_the_options_to_peft(tmp_path):
    """The dropout stays with --keep-dropout and is turned off (p = 0) without it, like every other dropout."""
    from grpolab.training.recipe import build_trainer

    options = dict(lora_rank=4, lora_targets="q_proj,v_proj", lora_dropout=0.1, steps=1)
    kept = build_trainer(small_cfg(tmp_path / "a", keep_dropout=True, **options), log=quiet).policy.model
    assert sorted(set(_adapted(kept))) == ["q_proj", "v_proj"]
    assert set(_lora_dropouts(kept)) == {0.1}
    off = build_trainer(small_cfg(tmp_path / "b", **options), log=quiet).policy.model
    assert set(_lora_dropouts(off)) == {0.0}
