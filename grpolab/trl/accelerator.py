"""``trainer.accelerator`` of :class:`grpolab.trl.GRPOTrainer`: the part of accelerate's ``Accelerator`` that TRL's
scripts call after training."""

from __future__ import annotations

import os


class Accelerator:
    """What TRL's scripts call on ``trainer.accelerator``, answered from the process's place (torchrun's RANK,
    LOCAL_RANK, WORLD_SIZE) and the trainer. Written here, not accelerate's ``Accelerator``: building one sets up
    accelerate's process state and device, which grpolab does itself (torch.distributed, --device)."""

    def __init__(self, trainer):
        self._trainer = trainer

    @property
    def process_index(self) -> int:
        return int(os.environ.get("RANK", "0"))

    @property
    def local_process_index(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def num_processes(self) -> int:
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def device(self):
        import torch

        return next(self._trainer.model.parameters()).device if self._trainer.run is not None else torch.device("cpu")

    def print(self, *args, **kwargs) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True):
        """The model inside a DistributedDataParallel (or compiled) wrapper; grpolab hands out unwrapped ones."""
        while hasattr(model, "module") or hasattr(model, "_orig_mod"):
            model = getattr(model, "module", None) or model._orig_mod
        return model

    def end_training(self) -> None:
        self._trainer.end()
