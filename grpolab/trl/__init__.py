"""TRL's ``GRPOConfig`` and ``GRPOTrainer``, run by grpolab: a TRL script changes one line,

::

    from grpolab.trl import GRPOConfig, GRPOTrainer   # was: from trl import GRPOConfig, GRPOTrainer

Every field of TRL 1.16's GRPOConfig by TRL's name and default (:mod:`grpolab.trl.fields` says what each becomes),
TRL's constructor, ``train()``, ``state.log_history`` under TRL's metric names, callbacks, ``save_model``,
``evaluate``. The run directory is grpolab's: ``grpolab doctor``, ``grpolab report`` and the probes read it.
"""

from grpolab.trl.config import GRPOConfig
from grpolab.trl.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
