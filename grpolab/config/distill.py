"""On-policy distillation: a frozen teacher scores every token the policy samples (docs/distillation.md)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from grpolab.algo.names import DISTILL_LOSSES
from grpolab.config.fields import bad, takes_object


@dataclasses.dataclass(frozen=True)
class DistillSection:
    """The teacher and how its signal enters the loss. Off without --teacher."""

    teacher: str = dataclasses.field(default="", metadata=takes_object("model", "teacher_model"))
    """The teacher: anything --model takes (a Hub id, a directory, a GGUF file, a model object through the Python
    API). Frozen, in the trainer's process and compute dtype; it must share the policy's tokenizer vocabulary. Each
    step it scores the sampled tokens in one forward without gradient (time/teacher_s)."""
    teacher_gguf_file: str = ""
    """--teacher's GGUF file, where its repository or directory holds several (as --gguf-file for --model)."""
    teacher_revision: str = ""
    """--teacher's Hub revision (as --revision for --model)."""
    distill_loss: Literal["", "rkl-reward", "rkl", "fkl", "jsd"] = ""
    """How the teacher's signal trains the policy (grpolab.algo.distill): rkl-reward (the default with --teacher):
    each token's advantage gets --distill-coef x clip(log pi_teacher - log pi_sampler, +-c), the reverse KL as a
    per-token reward (tinker, prime-rl); rkl, fkl, jsd: the reverse KL, forward KL or generalized JSD (with
    --distill-beta) over the whole vocabulary at each sampled position, --distill-coef x their mean added to the
    loss and backpropagated, computed in chunks (TRL's DistillationTrainer)."""
    distill_coef: float = 1.0
    """lambda: the weight of the teacher's signal beside the task reward's advantage."""
    distill_clip: float = 10.0
    """rkl-reward: c, the bound on one token's log pi_teacher - log pi_sampler (nats)."""
    distill_beta: float = 0.5
    """jsd: the mixture's weight on the teacher, m = (1 - beta) p_student + beta p_teacher (TRL's beta: 0 is fkl, 1 is
    rkl)."""
    task_reward: bool = True
    """Whether the task reward's advantage trains the policy beside the teacher. False (--no-task-reward): pure
    distillation, the teacher's signal alone; the rewards are still computed and logged."""

    @property
    def on(self) -> bool:
        """Whether the run distills from a teacher."""
        return bool(self.teacher)

    @property
    def loss(self) -> str:
        """--distill-loss, resolved: rkl-reward when left out."""
        return self.distill_loss or "rkl-reward"

    @property
    def full_vocabulary(self) -> bool:
        """Whether the teacher's whole next-token distribution enters the loss (rkl, fkl, jsd)."""
        return self.on and self.loss != "rkl-reward"

    def validate(self) -> None:
        if not self.teacher:
            given = [f.name for f in dataclasses.fields(self) if f.name != "teacher" and _set(self, f)]
            if given:
                raise bad(given[0], "configures distillation from a teacher: give --teacher MODEL")
            return
        if self.distill_loss not in ("", *DISTILL_LOSSES):
            raise bad("distill_loss", f"must be one of {DISTILL_LOSSES}, got {self.distill_loss!r}")
        if not self.distill_coef > 0:
            raise bad("distill_coef", f"must be > 0, got {self.distill_coef:g}")
        if not self.distill_clip > 0:
            raise bad("distill_clip", f"must be > 0, got {self.distill_clip:g}")
        if not 0 < self.distill_beta < 1:
            raise bad("distill_beta", f"jsd's mixture weight must be in (0, 1), got {self.distill_beta:g}")


def _set(section: DistillSection, f: dataclasses.Field) -> bool:
    """Whether ``section``'s option ``f`` differs from its default."""
    return getattr(section, f.name) != f.default
