"""train.py run in this process, watched (the `train` probe of benchmarks/gpu_probes.py): the host synchronizations
of the steps between the first and second log interval and of the second log itself, how the batches reach the
device, a loader made to sleep, the float32 matmul precision the run trains at, a memory spike for the per-interval
peaks, and what torch.compile compiled or found in its cache.

Host synchronizations are counted where they happen, by call site: on CUDA, every operation torch's sync debug
mode warns about (`.item()`, a tensor's truth value, a blocking copy, a stream's synchronize) and the device and
event synchronizations it does not see (cudaDeviceSynchronize, cudaEventSynchronize), each once; on CPU, the
stand-in, the reads of a tensor's value by the host (item, bool, float, ...), which on a GPU would wait for it.
"""
import collections
import functools
import os
import sys
import sysconfig
import threading
import time
import warnings

import torch

from training.observers import Observer

SYNC_WARNING = "called a synchronizing CUDA operation"
TENSOR_READS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy", "cpu")
# The loader sleeps this fraction of the last step's time: a loader that did not overlap the steps would keep the
# loop waiting about as long before each step.
SLEEP_FRACTION = 0.7
SPIKE_BYTES = 2**30
# Frames that are not a call site: torch's and Python's own (packages installed beside Python's library are
# sites), DeepSpeed's device layer and its profiling wrapper, and this file.
TORCH_DIR, STDLIB = os.path.dirname(torch.__file__) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep
NOT_SITES = (os.sep + os.path.join("deepspeed", "accelerator") + os.sep,
             os.sep + os.path.join("deepspeed", "utils", "nvtx.py"), os.path.abspath(__file__))


@functools.lru_cache(maxsize=None)
def is_site(filename: str) -> bool:
    path = os.path.abspath(filename)
    if filename.startswith("<") or path.startswith(TORCH_DIR) or any(part in path for part in NOT_SITES):
        return False
    return "site-packages" in path or "dist-packages" in path or not path.startswith(STDLIB)


def call_site() -> str:
    """'caller > callee' for the innermost two frames of the calling stack that are sites, each as module.function
    (frames are walked, not formatted: a step makes thousands of such calls on CPU)."""
    names, frame = [], sys._getframe(1)
    while frame is not None and len(names) < 2:
        if is_site(frame.f_code.co_filename):
            names.append(f"{os.path.splitext(os.path.basename(frame.f_code.co_filename))[0]}.{frame.f_code.co_name}")
        frame = frame.f_back
    return " > ".join(reversed((names + ["?", "?"])[:2]))


class Syncs:
    """Host synchronizations by call site, into the bucket that is open (none: not counted)."""

    def __init__(self, cuda: bool):
        self.cuda, self.bucket, self.local = cuda, None, threading.local()
        self.counts = collections.defaultdict(collections.Counter)
        if cuda:
            warnings.filterwarnings("always", message=SYNC_WARNING)  # every occurrence, not once per line
            shown = warnings.showwarning

            def showwarning(message, category, *args, **kwargs):
                if SYNC_WARNING in str(message):
                    self.note()
                else:
                    shown(message, category, *args, **kwargs)

            warnings.showwarning = showwarning
            explicit = [(torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"),
                        (torch.cuda.Event, "synchronize")]
        else:
            explicit = [(torch.Tensor, name) for name in TENSOR_READS]
        for owner, name in explicit:
            self._count_calls(owner, name)

    def open(self, bucket: str | None) -> None:
        self.bucket = bucket
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn" if bucket else "default")

    def note(self) -> None:
        if self.bucket and not getattr(self.local, "inside", False):
            self.counts[self.bucket][call_site()] += 1

    def _count_calls(self, owner, name: str) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            if not self.bucket or getattr(self.local, "inside", False):
                return original(*args, **kwargs)
            self.note()
            self.local.inside = True  # what the call warns about, or reads, is this one synchronization
            try:
                return original(*args, **kwargs)
            finally:
                self.local.inside = False

        setattr(owner, name, counted)


def precision_state(device: torch.device) -> dict:
    """The float32 matmul settings in force, and the relative error of a 1024 x 1024 float32 matmul on the
    device against float64: about 1e-7 in full float32, about 1e-4 and more in TF32 (10 mantissa bits), about
    1e-3 with bf16 inputs (8 bits: oneDNN's bf16 mode on a CPU)."""
    state = {"float32_matmul_precision": torch.get_float32_matmul_precision(),
             "mkldnn_fp32_precision": torch.backends.mkldnn.matmul.fp32_precision}
    if device.type == "cuda":
        state.update(cuda_matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                     cudnn_allow_tf32=torch.backends.cudnn.allow_tf32)
    generator = torch.Generator().manual_seed(0)  # not the run's generators: its random draws stay its own
    a, b = (torch.randn(1024, 1024, generator=generator) for _ in range(2))
    exact = a.double() @ b.double()
    computed = (a.to(device) @ b.to(device)).to("cpu", torch.float64)
    state["matmul_rel_error"] = float((computed - exact).norm() / exact.norm())
    return state


class Watch(Observer):
    """What the options ask to see of one run: --syncs (and on CUDA the batches' copies), --loader_sleep, --spike;
    each step's time and the wait before it, the precision and the compile counters always. It observes the loop
    (training/observers.py); only the loader's batches are patched, for --loader_sleep."""

    def __init__(self, options: list[str]):
        self.options = set(options)
        unknown = self.options - {"--syncs", "--loader_sleep", "--spike"}
        if unknown:
            raise SystemExit(f"error: unknown train probe options {sorted(unknown)}")
        self.logs, self.record = 0, {}
        self.steps = {}  # step: (start, end) of its forward, backward and update, on the loop's clock
        self.step_started = None
        self.sleep_from, self.slept, self.last_step_seconds = None, {}, 0.0
        self.made = {}  # step: (the thread that made its batches, when it began), for the sleeping ones
        self.copies = collections.Counter()
        self.syncs = None

    def install(self, cuda: bool) -> None:
        from data.token_data import TokenData

        if "--syncs" in self.options:
            self.syncs = Syncs(cuda)
        if cuda and "--syncs" in self.options:
            self._note_batch_copies()
        step_batches = TokenData.step_batches

        def sleepy_step_batches(data, seed, step, *args, **kwargs):
            if self.sleep_from is not None and step >= self.sleep_from:
                # made while the step before `step` runs: the last one done is the one before that
                self.made[step] = (threading.current_thread().name, time.perf_counter())
                self.slept[step] = SLEEP_FRACTION * self.last_step_seconds
                time.sleep(self.slept[step])
            return step_batches(data, seed, step, *args, **kwargs)

        TokenData.step_batches = sleepy_step_batches

    def before_step(self, step: int, driver, micro_batches: list) -> None:
        self.step_started = time.perf_counter()

    def after_step(self, step: int, driver, loss) -> None:
        end = time.perf_counter()
        self.steps[len(self.steps) + 1] = (self.step_started, end)
        self.last_step_seconds = end - self.step_started

    def before_log(self, run, step: int) -> None:
        self.logs += 1
        if self.syncs and self.logs == 2:
            self.syncs.open("log")  # the log interval's own synchronizations, apart from the steps'

    def after_log(self, run, step: int) -> None:
        if self.syncs:
            self.syncs.open(None)
        if self.logs == 1:  # after the log read its interval's time, which this must not lengthen
            name = torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else run.device.type
            self.record.update(interval=step, device_name=name, precision=precision_state(run.device))
        if self.logs == 1 and "--spike" in self.options:
            # A transient allocation between the first and second log: the second interval's peak holds it, the
            # third's, after the reset, must not.
            torch.empty(SPIKE_BYTES, dtype=torch.uint8, device=run.device)
            self.record["spike_gb"] = SPIKE_BYTES / 2**30
        if self.logs == 1 and self.syncs:
            self.syncs.open("steps")
        if self.logs == 2 and "--loader_sleep" in self.options:
            # From here the loader sleeps most of a step before each batch. The batch of the next step is made
            # already, so the sleeping starts with the one after.
            self.sleep_from = step + 2

    def _note_batch_copies(self) -> None:
        """Each copy of a batch to the GPU on the loader's thread: whether its source was pinned and the copy
        asked not to block."""
        to = torch.Tensor.to

        def noted(tensor, *args, **kwargs):
            moved = to(tensor, *args, **kwargs)
            if threading.current_thread().name.startswith("batches") and moved.device.type == "cuda" \
                    and tensor.device.type == "cpu":
                blocking = not (kwargs.get("non_blocking") or any(a is True for a in args))
                self.copies[f"pinned={tensor.is_pinned()} non_blocking={not blocking}"] += 1
            return moved

        torch.Tensor.to = noted

    def result(self) -> dict:
        from torch._dynamo.utils import counters

        self.record.update(logs=self.logs, step_seconds={s: end - start for s, (start, end) in self.steps.items()},
                           # the loop's wait for a step's batch: from the end of the step before to its start
                           batch_waits={s: start - self.steps[s - 1][1] for s, (start, _) in self.steps.items()
                                        if s - 1 in self.steps},
                           loader_sleeps=self.slept, copies=dict(self.copies),
                           # how long before the end of the step before it a sleeping batch began to be made
                           batches_made={s: {"thread": thread, "ahead": self.steps[s - 1][1] - began}
                                         for s, (thread, began) in self.made.items() if s - 1 in self.steps},
                           compiled={k: dict(counters[k]) for k in ("stats", "aot_autograd", "inductor")})
        if self.syncs:
            self.record["syncs"] = {bucket: dict(c) for bucket, c in self.syncs.counts.items()}
        return self.record


def watch_train(options: list[str], argv: list[str]) -> dict:
    """train.py's ARGS in this process, watched as the options say; what was seen."""
    from deepspeed.accelerator import get_accelerator

    import train

    watch = Watch(options)
    watch.install(get_accelerator().device_name() == "cuda")
    train.main(argv, observers=[watch])
    return watch.result()
