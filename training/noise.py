"""Known, harmless messages of DeepSpeed and torch that every run printed, silenced one by one where they arise,
so that a warning in a run's output is one worth reading. Each names its source; no category is silenced."""
import logging
import warnings


def silence_known_noise() -> None:
    # DeepSpeed's WarmupCosineLR.get_lr (runtime/lr_schedules.py) warns when asked before its first step: the
    # engine asks while it is built, and training/optim.py start_schedule steps it right after.
    logging.getLogger("DeepSpeed").addFilter(
        _DropMessage("Attempting to get learning rate from scheduler before it has started"))
    # DeepSpeed's ZeRO-1/2 gathers partitions with torch.distributed.all_gather_into_tensor, which torch
    # deprecates by name only; every rank printed it at its first step.
    warnings.filterwarnings("ignore", message=r"`torch.distributed.all_gather_into_tensor` is deprecated",
                            category=FutureWarning)
    # DeepSpeed's bf16 optimizer (runtime/bf16_optimizer.py, the GPU default's) prints memory usage in 15 lines
    # while it is built, with force=True: no setting turns it off. The memory a run uses is in its progress lines.
    from deepspeed.runtime import bf16_optimizer
    bf16_optimizer.see_memory_usage = lambda message, force=False: None


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()
