"""The run's data, as the training loop reads it: open_data picks the batches of text (data/token_data.py), of a
conversation dataset (data/conversations.py), of preference pairs (data/pairs.py) or of prompts
(data/prompt_data.py); prefetched makes a step's batches while the device works."""
import json
import os
from concurrent.futures import ThreadPoolExecutor

from data.conversations import ChatData
from data.pairs import PairData
from data.prompt_data import PromptData
from data.token_data import TokenData, dataset_kind


def open_data(data_dir: str, tokenizer: str | None, block_size: int, sources=(), document_masking: bool = False,
              pack: bool = True) -> TokenData:
    """The run's data: documents of text (TokenData), conversations (ChatData), preference pairs (PairData) or
    prompts for online RL (PromptData)."""
    kind = "text" if sources else _kind(data_dir)
    if kind == "conversations":
        return ChatData(data_dir, tokenizer, block_size, document_masking, pack)
    if kind == "preference":
        return PairData(data_dir, tokenizer, block_size)
    if kind == "prompts":
        return PromptData(data_dir, tokenizer, block_size)
    return TokenData(data_dir, tokenizer, block_size, sources, document_masking)


def _kind(data_dir: str) -> str:
    """What data_dir's meta.json says it holds; any bad state of it is for the Dataset's checks to name."""
    try:
        with open(os.path.join(data_dir, "meta.json"), "rb") as f:
            meta = json.loads(f.read())
    except (OSError, ValueError, TypeError):
        return "text"
    return dataset_kind(meta) if isinstance(meta, dict) else "text"


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
