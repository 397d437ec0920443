"""The served model and the scheduler that runs it, built as `python -m scripts.serve` serves (and as
benchmarks/serving.py times the model's work without HTTP): the weights at the serving dtype (bf16 on a GPU, fp32
on a CPU unless asked), fp32 linear layers packed for oneDNN on a CPU (model/onednn.py), a key/value-cache decoder
of `slots` sequences with the prefix cache, the LoRA adapters any sequence may run through (model/lora_batch.py),
and the function that puts new weights in."""
from dataclasses import dataclass

import torch

from data.documents import documents_seen
from model.generate import decoder_for
from model.lora_batch import BatchAdapters
from model.onednn import PackedLinears, packable
from model.prefix_cache import PrefixCache
from serving.scheduler import Scheduler

DTYPES = ("auto", "fp32", "bf16")


@dataclass
class Engine:
    scheduler: Scheduler
    load: object  # load(state dict): new weights, in the served model's form
    prefix_cache: PrefixCache | None  # None where it is off, or the model cannot cache (a WindowDecoder)
    adapters: BatchAdapters
    parameters: int
    dtype: torch.dtype


def start_engine(cfg, model: torch.nn.Module, meta: dict, device: str, dtype: str, slots: int, max_queue: int,
                 prefix_cache_mb: int, thread: bool = True) -> Engine:
    """The scheduler on the model, on a thread of its own or (thread False) for the caller to run on the thread that
    built it (serving/scheduler.py says why); `dtype` one of DTYPES; a prefix cache of 0 MB is none."""
    chosen = torch.bfloat16 if dtype == "bf16" or (dtype == "auto" and device != "cpu") else torch.float32
    model = model.to(device, chosen).eval()
    parameters = sum(p.numel() for p in model.parameters())
    load = PackedLinears(model).load if packable(model) else model.load_state_dict
    prefix_cache = PrefixCache(prefix_cache_mb * 2**20) if prefix_cache_mb else None
    adapters = BatchAdapters(model)
    decoder = decoder_for(model, cfg.block_size, cfg.vocab_size, slots, documents_seen(cfg.document_masking, meta),
                          prefix_cache=prefix_cache, adapters=adapters)
    return Engine(Scheduler(decoder, slots, max_queue, thread=thread), load, getattr(decoder, "prefix_cache", None),
                  adapters, parameters, chosen)
