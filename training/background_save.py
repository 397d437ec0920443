"""Checkpoint saves that cost the training loop only a copy into host memory.

DeepSpeed's engine writes every file of a checkpoint (model states, ZeRO shards, pipeline layers, experts)
through its checkpoint engine's `save(state_dict, path)`. `BackgroundWriter` is such an engine: it serializes
each state into memory with the synchronous engine's own `torch.save` call, GPU tensors copied to the host on
the way, and hands the bytes to a thread that writes them while training goes on. training/checkpoint.py
completes the checkpoint (run state, manifest, `latest`) once every rank's files are down, so a kill during
the write leaves the previous checkpoint the one to resume.

The bytes are a synchronous save's: torch.save names the archive inside its zip after the file it is given
(into a buffer it writes "archive/..." instead), so it is given a link of the file's own name to an anonymous
memory file (memfd), which the thread then copies to the checkpoint's folder.

DeepSpeed's own decoupled writer (ds_config `checkpoint.writer.decoupled`) is not used, for three reasons
found in 0.19.8: without a Megatron-style mpu its choice of writing ranks fails (it reads a `dp_rank` its
parallel info does not have) and it needs the CROSS_RANK/CROSS_SIZE variables only its own launcher sets;
and it hands the live tensors to its writer process through shared memory, so it must wait for the write
before the next optimizer step, which it does in `engine.step()`: a pipeline's `train_batch` never calls
that, and its update would race the write.
"""
import os
import queue
import tempfile
import threading

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine


class BackgroundWriter(TorchCheckpointEngine):
    """A DeepSpeed checkpoint engine whose files are written by a thread. `unfinished` holds what
    training/checkpoint.py needs to complete the checkpoint being written (None when there is none)."""

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
        memory = os.memfd_create(os.path.basename(path))
        with tempfile.TemporaryDirectory(prefix="checkpoint_") as links:
            link = os.path.join(links, os.path.basename(path))
            os.symlink(f"/proc/self/fd/{memory}", link)
            torch.save(state_dict, link, _use_new_zipfile_serialization=self.zipfile_serialization)
        self._files.put((path, memory))

    def _write(self):
        while True:
            path, memory = self._files.get()
            try:
                if self._error is None:
                    write_file(memory, path)
            except Exception as e:  # kept for the loop's thread, which raises it at the next settle
                self._error = e
            finally:
                os.close(memory)
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


def write_file(memory: int, path: str) -> None:
    """The memory file's bytes into `path`, copied by the kernel (the GIL is free meanwhile)."""
    with open(path, "wb") as f:
        size, done = os.fstat(memory).st_size, 0
        while done < size:
            done += os.sendfile(f.fileno(), memory, done, size - done)
