"""TRL's ``GRPOConfig`` and ``GRPOTrainer`` (and ``RLOOConfig`` and ``RLOOTrainer``, ``DistillationConfig`` and
``DistillationTrainer``), run by grpolab: a TRL script changes one line,

::

    from grpolab.trl import GRPOConfig, GRPOTrainer   # was: from trl import GRPOConfig, GRPOTrainer

Every field of TRL 1.16's GRPOConfig by TRL's name and default (:mod:`grpolab.trl.fields` says what each becomes),
TRL's constructor, ``train()``, ``state.log_history`` under TRL's metric names, callbacks, ``save_model``,
``evaluate``; RLOO's and on-policy distillation's the same way (:mod:`grpolab.trl.rloo_fields`,
:mod:`grpolab.trl.distillation_fields`). The run directory is grpolab's: ``grpolab
doctor``, ``grpolab report`` and the probes read it.
"""

from grpolab.trl.config import GRPOConfig
from grpolab.trl.distillation_config import DistillationConfig
from grpolab.trl.distillation_trainer import DistillationTrainer
from grpolab.trl.rloo_config import RLOOConfig
from grpolab.trl.rloo_trainer import RLOOTrainer
from grpolab.trl.trainer import GRPOTrainer

__all__ = ["DistillationConfig", "DistillationTrainer", "GRPOConfig", "GRPOTrainer", "RLOOConfig", "RLOOTrainer"]
