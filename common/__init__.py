"""What data/, model/ and training/ all use: the bad-input error type and its checks (common/checks.py), and a
filter of DeepSpeed's log that must be in place before DeepSpeed is imported, which is why it lives here: every
command imports this package before DeepSpeed."""
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
