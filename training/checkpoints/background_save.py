"""Checkpoint saves that cost the training loop only a copy into host memory.

DeepSpeed's engine writes every file of a checkpoint (model states, ZeRO shards, pipeline layers, experts)
through its checkpoint engine's `save(state_dict, path)`. `BackgroundWriter` is such an engine: it copies each
state into host memory and hands the copy to a thread that writes it with the synchronous engine's own
`torch.save` call while training goes on. training/checkpoints/checkpoint.py completes the checkpoint (run state,
manifest, `latest`) once every rank's files are down, so a kill during the write leaves the previous
checkpoint the one to resume.

The files are byte for byte a synchronous save's. `host_copy` copies each storage once and rebuilds every
tensor over its storage's copy as it was (views, requires_grad, a Parameter's type and attributes), since
torch.save writes each storage once and the tensors over it. A copy of a GPU tensor would be written with the
location "cpu": torch.save asks its registered taggers for a storage's location, so one registered here
(torch.serialization.register_package, ahead of the built-in ones) answers for those copies with what the
built-in tagger says of an empty storage on the original device: a new string each call, as for the original,
since the pickle memoizes a location it has seen by object identity.

DeepSpeed's own decoupled writer (ds_config `checkpoint.writer.decoupled`) is not used, for three reasons
found in 0.19.8: without a Megatron-style mpu its choice of writing ranks fails (it reads a `dp_rank` its
parallel info does not have) and it needs the CROSS_RANK/CROSS_SIZE variables only its own launcher sets;
and it hands the live tensors to its writer process through shared memory, so it must wait for the write
before the next optimizer step, which it does in `engine.step()`: a pipeline's `train_batch` never calls
that, and its update would race the write.
"""
import copy
import functools
import queue
import threading

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

# For each host copy of a device storage, by the copy's storage identity until it is written: an empty storage
# on the device it came from (no device memory), which the built-in taggers name.
COPIED_FROM: dict[int, torch.UntypedStorage] = {}


def copied_location(storage) -> str | None:
    origin = COPIED_FROM.get(storage._cdata)
    return None if origin is None else torch.serialization.location_tag(origin)


torch.serialization.register_package(0, copied_location, lambda storage, location: None)  # loading is torch's own


class BackgroundWriter(TorchCheckpointEngine):
    """A DeepSpeed checkpoint engine whose files are written by a thread. `unfinished` holds what
    training/checkpoints/checkpoint.py needs to complete the checkpoint being written (None when there is none)."""

    def __init__(self, config_params):
        super().__init__(config_params)
        self.name = "BackgroundWriter"
        self.unfinished = None
        self._files = queue.Queue()
        self._error = None
        # Ranks agree that all files are down over gloo: a CPU flag, no device synchronization in the loop.
        self._group = None if torch.distributed.get_backend() == "gloo" else torch.distributed.new_group(
            backend="gloo")
        threading.Thread(target=self._write, name="checkpoint writer", daemon=True).start()

    def save(self, state_dict, path: str):
        memo = {}
        state = host_copy(state_dict, memo)
        self._files.put(functools.partial(write_state, state, path, self.zipfile_serialization,
                                          [memo[key]._cdata for key in memo if isinstance(key, tuple)]))

    def _write(self):
        while True:
            write = self._files.get()
            try:
                if self._error is None:
                    write()
            except Exception as e:  # kept for the loop's thread, which raises it at the next settle
                self._error = e
            finally:
                self._files.task_done()

    def written_everywhere(self) -> bool:
        """Collective: whether every rank's files are down (without waiting for them)."""
        done = torch.tensor([self._files.unfinished_tasks == 0], dtype=torch.int32)
        torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MIN, group=self._group)
        return bool(done.item())

    def wait(self) -> None:
        """Until this rank's files are down; a write that failed raises here, on the loop's thread."""
        self._files.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise OSError(f"writing a checkpoint file failed: {type(error).__name__}: {error}") from error


def host_copy(obj, memo: dict):
    """obj with every tensor in its containers (dicts, lists, tuples) rebuilt over copies of their storages.
    `memo` keeps what pickling sees: one copy per object (id) and per storage (torch's storage identity, the key
    torch.save dedupes by). Anything else is shared: DeepSpeed's states hold numbers, strings and small
    settings objects besides tensors."""
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        key = ("storage", storage._cdata)
        if key not in memo:
            memo[key] = storage.clone() if storage.device.type == "cpu" else pinned_copy(storage)
        copied = torch.empty(0, dtype=obj.dtype).set_(memo[key], obj.storage_offset(), obj.size(), obj.stride())
        if isinstance(obj, torch.nn.Parameter):
            copied = torch.nn.Parameter(copied, requires_grad=obj.requires_grad)
            copied.__dict__.update(host_copy(obj.__dict__, memo))
        copied.requires_grad_(obj.requires_grad)
    elif isinstance(obj, dict):
        copied = copy.copy(obj)  # its own type (an OrderedDict's, a defaultdict's factory)
        for key, value in obj.items():
            copied[key] = host_copy(value, memo)
    elif isinstance(obj, (list, tuple)):
        copied = type(obj)(host_copy(value, memo) for value in obj)
    else:
        return obj
    memo[id(obj)] = copied
    return copied


def pinned_copy(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """A device storage copied into page-locked host memory, which a GPU copies to at its full rate (into pageable
    memory an H100 moved GPT-2 124M's 1.6 GB states at about 1 GB/s); torch's host allocator keeps the pages for
    the next save once this copy is written and dropped."""
    copy = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)
    copy.copy_(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage))
    COPIED_FROM[copy.untyped_storage()._cdata] = torch.UntypedStorage(0, device=storage.device)
    return copy.untyped_storage()


def write_state(state, path: str, zipfile_serialization: bool, storages: list[int]) -> None:
    """A host copy of a state into `path`, as TorchCheckpointEngine.save writes it; `storages`: its copies'
    identities, whose devices are forgotten once it is written."""
    try:
        torch.save(state, path, _use_new_zipfile_serialization=zipfile_serialization)
    finally:
        for storage in storages:
            COPIED_FROM.pop(storage, None)
