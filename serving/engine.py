"""The served model and the scheduler that runs it, built as `python -m scripts.serve` serves (and as
benchmarks/serving.py times the model's work without HTTP): the weights at the serving dtype (bf16 on a GPU, fp32
on a CPU unless asked), fp32 linear layers packed for oneDNN on a CPU (model/onednn.py), a key/value-cache decoder
of `slots` sequences with the prefix cache, the LoRA adapters any sequence may run through (model/lora_batch.py),
and the function that puts new weights in."""
from dataclasses import dataclass

import torch

from common.checks import ConfigError
from data.documents import documents_seen
from data.meta import drawn_vocabulary
from model.generate import decoder_for, generation_dtype
from model.kv_cache import cache_bytes
from model.lora_batch import BatchAdapters
from model.onednn import PackedLinears, packable
from model.prefix_cache import PrefixCache
from serving.scheduler import Scheduler


@dataclass
class Engine:
    scheduler: Scheduler
    load: object  # load(state dict): new weights, in the served model's form
    prefix_cache: PrefixCache | None  # None where it is off, or the model cannot cache (a WindowDecoder)
    adapters: BatchAdapters
    parameters: int
    dtype: torch.dtype


def start_engine(cfg, model: torch.nn.Module, meta: dict, device: str, dtype: str, slots: int, max_queue: int,
                 prefix_cache_mb: int, thread: bool = True, context: int | None = None) -> Engine:
    """The scheduler on the model, on a thread of its own or (thread False) for the caller to run on the thread that
    built it (serving/scheduler.py says why); `dtype` one of DTYPES; a prefix cache of 0 MB is none; `context`: the
    tokens a sequence may hold (default: the model's block_size), each slot of the key/value cache that many. A cache
    that cannot fit where it would live is refused here (ConfigError), not at the first request that fills it."""
    chosen = generation_dtype(device, dtype)
    context = context or cfg.block_size
    check_cache(cfg, model, slots, context, chosen, device)
    model = model.to(device, chosen).eval()
    parameters = sum(p.numel() for p in model.parameters())
    load = PackedLinears(model).load if packable(model) else model.load_state_dict
    prefix_cache = PrefixCache(prefix_cache_mb * 2**20) if prefix_cache_mb else None
    adapters = BatchAdapters(model)
    decoder = decoder_for(model, context, drawn_vocabulary(cfg.vocab_size, meta), slots,
                          documents_seen(cfg.document_masking, meta), prefix_cache=prefix_cache, adapters=adapters)
    return Engine(Scheduler(decoder, slots, max_queue, thread=thread), load, getattr(decoder, "prefix_cache", None),
                  adapters, parameters, chosen)


def check_cache(cfg, model: torch.nn.Module, slots: int, context: int, dtype: torch.dtype, device: str,
                free: int | None = None) -> None:
    """A ConfigError where the key/value cache of `slots` x `context` tokens needs more than the memory `free` on
    `device` (default: what the system or the GPU has free, less the model's weights on a GPU), naming the context
    that fits."""
    need = cache_bytes(cfg, slots, context, dtype)
    if free is None:
        free = free_memory(device)
        if free is not None and device != "cpu":  # the weights move there first
            free -= sum(p.numel() for p in model.parameters()) * dtype.itemsize
    if free is None or need <= free:
        return
    fits = max(0, free) * context // need
    several, fewer = (f"--slots {slots} x ", ", or fewer --slots") if slots > 1 else ("", "")  # a server's slots
    raise ConfigError(f"the key/value cache of {several}{context:,} tokens (--max_model_len, the model's context "
                      f"unless given) takes {need / 2**30:.1f} GiB at {str(dtype).removeprefix('torch.')}, and "
                      f"{max(0, free) / 2**30:.1f} GiB are free on {device}; fix: pass --max_model_len {fits} or "
                      f"less{fewer}")


def free_memory(device: str) -> int | None:
    """Bytes free on `device`: the GPU's, or the system's available memory for the CPU (None where unknown)."""
    if device != "cpu":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
