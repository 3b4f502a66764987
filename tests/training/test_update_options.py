"""What the update reads of the run's options and the keys it logs (grpolab.training.update_options)."""

from __future__ import annotations

import copy

import torch
from helpers.models import model_and_batch
from transformers import get_scheduler

from grpolab.common.distributed import SINGLE
from grpolab.config.train import TrainConfig
from grpolab.training.forward import TrainModule
from grpolab.training.update import Updater
from grpolab.training.update_options import UpdateSections


def test_a_step_without_an_update_logs_the_same_keys_as_one_with_it():
    model, batch = model_and_batch()
    cfg = TrainConfig(max_grad_norm=0.5, top_p=0.9, loss_type="cispo", cispo_cap=3.0, mu=2)
    sections = UpdateSections.of(cfg)
    assert (sections.optimizer.max_grad_norm, sections.generation.top_p, sections.terms.cispo_cap) == (0.5, 0.9, 3.0)
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    upd = Updater(sections, TrainModule(m, 1.0), opt, get_scheduler("constant", opt), SINGLE, eos_id=2)
    assert upd.options["params"].cispo_cap == 3.0 and upd.max_grad_norm == 0.5 and upd.rules.top_p == 0.9
    ran = upd(batch, torch.tensor([1.0, -1.0, 0.5, -0.5, 0.2, -0.2]))
    skipped = upd.skip()
    assert set(skipped) <= set(ran) and skipped["loss/total"] is None and ran["loss/total"] is not None
    assert skipped["charts/lr"] == ran["charts/lr"] == 0.01
