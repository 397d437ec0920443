"""The run's data, as the training loop reads it: open_data picks the batches of text (data/token_data.py) or of
a conversation dataset (data/conversations.py); prefetched makes a step's batches while the device works."""
import json
import os
from concurrent.futures import ThreadPoolExecutor

from data.conversations import ChatData
from data.token_data import TokenData


def open_data(data_dir: str, tokenizer: str | None, block_size: int, sources=(), document_masking: bool = False,
              pack: bool = True) -> TokenData:
    """The run's data: documents of text (TokenData), or a conversation dataset (data/conversations.py)."""
    if not sources and _holds_conversations(data_dir):
        return ChatData(data_dir, tokenizer, block_size, document_masking, pack)
    return TokenData(data_dir, tokenizer, block_size, sources, document_masking)


def _holds_conversations(data_dir: str) -> bool:
    """Does data_dir's meta.json say conversations? Any other state of it is for the Dataset's checks to name."""
    try:
        with open(os.path.join(data_dir, "meta.json"), "rb") as f:
            return "chat" in json.loads(f.read())
    except (OSError, ValueError, TypeError):
        return False


def prefetched(make, steps):
    """make(step) for each of `steps` in order, the next one made on a background thread while the caller
    works on the current one (reading, pinning and copying a step's batches overlaps the device's work)."""
    steps = iter(steps)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="batches") as pool:
        step = next(steps, None)
        upcoming = pool.submit(make, step) if step is not None else None
        while upcoming is not None:
            current = upcoming.result()
            step = next(steps, None)
            upcoming = pool.submit(make, step) if step is not None else None
            yield current
