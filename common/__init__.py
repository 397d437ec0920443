"""What data/, model/ and training/ all use: the bad-input error type and its checks (common/checks.py), and a
filter of DeepSpeed's log that must be in place before DeepSpeed is imported, which is why it lives here: every
command imports this package before DeepSpeed; and how a command starts (freeze_imports)."""
import gc
import logging


class DropMessage(logging.Filter):
    """Drops a logger's records whose message holds `text`."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


# DeepSpeed chooses its accelerator when it is imported and, finding no GPU, logs "Setting accelerator to CPU. If you
# have GPU or other accelerator, we were unable to detect it." in every command on a CPU machine, before any of this
# repo's code runs after the import; train.py's start-up lines name the device it trains on. The logger is standard
# logging's "DeepSpeed", which this filter waits on.
logging.getLogger("DeepSpeed").addFilter(DropMessage("Setting accelerator to CPU."))


def freeze_imports() -> None:
    """What the imports made, left out of the garbage collector's full passes, each of which would otherwise walk
    torch's and DeepSpeed's million-odd objects again: a 2-step `python train.py` ran in 5.6 s instead of 6.7
    (median of 7, dev/LOG.md). Called as a command starts, after its imports; not by a main() that tests call again
    and again in one process, where an earlier run's garbage would be kept for good."""
    gc.freeze()
