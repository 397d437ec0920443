"""What the device computes with: its precision, its peak FLOP/s (the MFU denominator), its memory, and the
ops DeepSpeed builds for it.

A GPU named in the table below is measured against its datasheet's dense peak for the precision in use
(what MFU means in the PaLM paper and in Megatron's and torchtitan's logs); `train.peak_tflops` overrides
it; anything else (a CPU, a GPU the table does not know) against a matmul peak measured at start. On a CPU
that only emulates bf16 (no AVX512-BF16 or AMX: bf16 matmuls there run far below fp32 ones), the hardware
does fp32 arithmetic, so its fp32 peak is the denominator.
"""
import ctypes
import functools
import glob
import os
import resource
import time

import torch
from deepspeed.accelerator import get_accelerator
from torch.nn.attention import SDPBackend
from torch.utils.cpp_extension import get_default_build_root

from common.checks import ConfigError
from training.topology import zero_stage

# Dense (no sparsity) datasheet peaks in TFLOP/s: 16-bit (bf16 and fp16), TF32 and plain fp32 tensor math.
# Keys are matched against torch.cuda.get_device_name(), most specific first ("NVIDIA H100 80GB HBM3" is the
# SXM H100). None: the precision has no tensor-core path there (bf16 on V100 and T4 is emulated).
DATASHEET_TFLOPS = [
    ("H200 NVL", (835, 418, 60)), ("H200", (989, 494, 67)), ("GH200", (989, 494, 67)),
    ("H100 PCIe", (756, 378, 51)), ("H100 NVL", (835, 418, 60)), ("H100", (989, 494, 67)), ("H800", (989, 494, 67)),
    ("A100", (312, 156, 19.5)), ("A800", (312, 156, 19.5)), ("L40S", (362, 183, 91.6)), ("L4", (121, 60, 30.3)),
    ("A10", (125, 62.5, 31.2)), ("V100", (125, None, 15.7)), ("T4", (65, None, 8.1)),
]


def datasheet_tflops(name: str, dtype: torch.dtype, tf32: bool) -> float | None:
    for key, (half, tf32_peak, fp32) in DATASHEET_TFLOPS:
        if key in name:
            if dtype in (torch.bfloat16, torch.float16):
                return half
            return tf32_peak if tf32 and tf32_peak else fp32
    return None


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.3) -> float:
    """The best FLOP/s of back-to-back square matmuls at `dtype`, timed between two synchronizations.
    The size grows from 256 until one matmul takes a few milliseconds (big enough to fill the cores, and
    bounded where a precision is emulated and slow); the best of five rounds leaves out a round slowed by
    other processes on the machine."""
    n = 256
    while True:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        torch.matmul(a, b)  # warm-up: kernels chosen, caches filled
        one = _timed(lambda: torch.matmul(a, b))
        if one > 0.005 or n >= 4096:
            break
        n *= 2
    repeats = max(1, int(seconds / 5 / one))
    best = min(_timed(lambda: [torch.matmul(a, b) for _ in range(repeats)]) for _ in range(5))
    return 2 * n**3 * repeats / best


def _timed(work) -> float:
    get_accelerator().synchronize()
    start = time.perf_counter()
    work()
    get_accelerator().synchronize()
    return time.perf_counter() - start


def peak_flops(device: torch.device, dtype: torch.dtype, override_tflops: float | None = None,
               tf32: bool = False) -> tuple[float, str]:
    """The MFU denominator in FLOP/s per device, and a few words on where it came from (for the log)."""
    tf32 = tf32 and device.type == "cuda"
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "tf32" if tf32 else "fp32")
    if override_tflops:
        return override_tflops * 1e12, "train.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tflops = datasheet_tflops(name, dtype, tf32)
        if tflops:
            return tflops * 1e12, f"{name} datasheet, dense {precision}"
    measured = measure_matmul_flops(device, dtype)
    if dtype != torch.float32 and device.type == "cpu":
        fp32 = measure_matmul_flops(device, torch.float32)
        if fp32 > measured:
            return fp32, (f"measured fp32 matmul peak: {precision} is emulated on this CPU "
                          f"({measured / 1e9:.1f} GFLOP/s)")
    return measured, f"measured {precision} matmul peak"


# mallopt's parameters (glibc's malloc.h), and the largest mmap threshold glibc takes on a 64-bit machine
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 * 2**20


def keep_freed_host_memory(device: torch.device) -> bool:
    """On a CPU, have glibc's malloc keep the memory a step's tensors free for the next step's, as a GPU's caching
    allocator does: by default it hands blocks from 128 KB up back to the kernel (munmap, and trimming the heap's
    top), so every step faults its activations' pages in again, 1.3-1.9 million minor faults in the 66 baby-GPT
    steps of benchmarks/throughput.py in bf16, 230 thousand with this (docs/performance.md, "Freed memory kept").
    Blocks over 32 MiB still go back. False on another device, or where the C library is not glibc."""
    if device.type != "cpu":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def amx_cpu(device: torch.device) -> bool:
    """Is the device a CPU with AMX tiles (bf16 matmuls about six times fp32's)?"""
    return device.type == "cpu" and getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()


def amd_avx512_cpu(device: torch.device) -> bool:
    """Is the device an AMD CPU with AVX-512? MKL, which computes torch's fp32 matmuls on a CPU, runs its AVX2
    kernels there, and oneDNN its AVX-512 ones: on a 2-core Zen 5 EPYC oneDNN's are 1.7-2.2x as fast at the
    quickstart's shapes and compute in exact fp32 (docs/performance.md, "Precision on a CPU")."""
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and torch.backends.cpu.get_cpu_capability().startswith("AVX512") and _cpu_vendor() == "AuthenticAMD")


@functools.cache
def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def native_bf16(device: torch.device) -> bool:
    """Does the device compute in bf16 (not emulate it through fp32, many times slower)? torch, and so
    DeepSpeed, calls bf16 supported on a V100 or T4 and on any x86 CPU."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or amx_cpu(device)
    return get_accelerator().is_bf16_supported()


# On a CPU bf16 pays for its conversions (bf16 weights and activations beside fp32 master weights, norms and
# softmax) only once the matmuls are wide enough. Measured (docs/performance.md): the 128-wide quickstart trains
# faster in fp32, its 2,000 steps in 98.8 s against 118.5 s in bf16 on a 2-core AMD EPYC with AVX512-BF16; its
# 256-wide variant 1.28x and the 384-wide baby GPT 1.6x (AMD) and 2x (AMX) the tokens/s of fp32 in bf16.
CPU_BF16_MIN_WIDTH = 256


def bf16_matmuls_in_fp32(ds: dict, device: torch.device, width: int) -> bool:
    """Does bf16 "auto" keep a model too narrow for bf16 weights in fp32, but round its matmuls' inputs to bf16?
    On a CPU with AMX: oneDNN's bf16 mode for fp32 matmuls (torch.set_float32_matmul_precision("medium")),
    accumulating in fp32 as TF32 does on a GPU; the quickstart's steps run 1.2x faster than in full fp32 and
    reach the same loss (docs/performance.md). oneDNN rounds to bf16 only on AMX."""
    return (ds.get("bf16", {}).get("enabled") == "auto" and width < CPU_BF16_MIN_WIDTH and native_bf16(device)
            and amx_cpu(device))


def onednn_matmuls(ds: dict, device: torch.device, width: int) -> bool:
    """Do the run's fp32 matmuls go through oneDNN (its bf16 mode, torch's float32 matmul precision "medium")?
    With AMX for bf16_matmuls_in_fp32's models, rounded to bf16; on an AMD CPU with AVX-512 whatever the
    precision, since there the mode computes in exact fp32, in kernels faster than MKL's."""
    return bf16_matmuls_in_fp32(ds, device, width) or amd_avx512_cpu(device)


# train.sdpa_backend: the kernel torch's scaled_dot_product_attention tries first on a GPU ("auto": torch's order)
SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def set_kernels(device: torch.device, train, onednn: bool, dtype: torch.dtype, model) -> str | None:
    """The kernels torch picks for a run. The float32 matmul precision: on a GPU TF32 (train.tf32) or full fp32,
    on a CPU "medium" (oneDNN's bf16 mode) where onednn_matmuls says so. On a GPU the attention kernel
    scaled_dot_product_attention tries first (train.sdpa_backend; the others follow in torch's order, for the
    shapes it cannot compute): returns the kernel it picks for the attention of `model` (its config) in `dtype`
    (sdpa_backend). A CPU runs model/cpu_attention.py's kernels: None."""
    if device.type != "cuda":
        torch.set_float32_matmul_precision("medium" if onednn else "highest")
        return None
    torch.set_float32_matmul_precision("high" if train.tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = train.tf32
    shape = (dtype, model.n_head, model.kv_heads, model.head_width, model.block_size)
    chosen = sdpa_backend(device, *shape)  # also settles torch's own order, which its first call sets
    if train.sdpa_backend != "auto":
        first = int(SDPA_BACKENDS[train.sdpa_backend])
        # For the whole run what torch's sdpa_kernel(set_priority=True) sets inside a with block
        torch._C._set_sdp_priority_order([first, *(b for b in torch._C._get_sdp_priority_order() if b != first)])
        chosen = sdpa_backend(device, *shape)
    return chosen


def sdpa_backend(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                 time: int) -> str:
    """The kernel scaled_dot_product_attention runs for a causal attention that trains (its inputs require
    gradients) at these shapes, one window: its name in SDPA_BACKENDS."""
    q = torch.zeros(1, heads, time, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.zeros(1, kv_heads, time, head_dim, device=device, dtype=dtype, requires_grad=True)
    choice = torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=kv_heads != heads)
    return next((name for name, backend in SDPA_BACKENDS.items() if int(backend) == choice), f"number {choice}")


def seed_step(seed: int, device: torch.device) -> None:
    """torch.manual_seed for the generators a training step draws from: the CPU's, and the GPUs' on a GPU.
    torch.manual_seed also seeds every other backend, and for each one not initialized (CUDA in a CPU run, XPU,
    MTIA) records the caller's formatted stack for a later replay: 0.2-0.4 ms of host time a step."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)


def compute_dtype(ds: dict, device: torch.device, width: int) -> tuple[torch.dtype, str | None]:
    """The compute dtype the ds_config asks for on this device for a model `width` wide (model.n_embd), and a
    warning to print, if any. `"bf16": {"enabled": "auto"}` (the shipped configs) means bf16 where the device
    computes it natively and it is the faster (on a CPU, from CPU_BF16_MIN_WIDTH on), else fp32
    (training/startup.py writes the choice into the ds_config DeepSpeed gets). bf16 asked for by name is refused
    on a GPU that emulates it and allowed, with a warning, on such a CPU (correct, only slow: the tests check
    bf16 everywhere)."""
    note = None
    bf16 = ds.get("bf16", {}).get("enabled", False)
    if bf16 == "auto":
        bf16 = native_bf16(device)
        if not bf16:
            note = (f"bf16 auto: fp32, since this {device.type} has no bf16 arithmetic (set ds.bf16.enabled=true to "
                    f"force it)")
        elif device.type == "cpu" and width < CPU_BF16_MIN_WIDTH:
            bf16 = False
            matmuls = (" with bf16 matmuls (AMX)" if bf16_matmuls_in_fp32(ds, device, width) else
                       " with oneDNN's AVX-512 matmuls" if amd_avx512_cpu(device) else "")
            note = (f"bf16 auto: fp32{matmuls}, faster on a CPU for a model {width} wide (bf16 from model.n_embd="
                    f"{CPU_BF16_MIN_WIDTH} on; set ds.bf16.enabled=true or false to force either)")
    fp16 = ds.get("fp16", {}).get("enabled", False)
    accelerator = get_accelerator()
    if bf16 and fp16:
        raise ConfigError("the ds_config enables both bf16 and fp16: enable one")
    # DeepSpeed's CPU accelerator calls fp16 supported on a CPU with AVX512-FP16, where mkldnn emulates fp16
    # matmuls at a fraction of bf16's speed: fp16 is for GPUs without bf16, so a CPU is refused whatever it
    # reports.
    if fp16 and (device.type == "cpu" or not accelerator.is_fp16_supported()):
        raise ConfigError(f"fp16 is not supported on {accelerator.device_name()}: use a bf16 ds_config "
                          f"(e.g. ds_configs/zero2.json) or set ds.fp16.enabled=false")
    if bf16 and not native_bf16(device):
        if device.type != "cpu":
            raise ConfigError(f"bf16 is emulated on this {device.type} device ({accelerator.device_name()}), many "
                              f"times slower: use ds_configs/zero2_fp16.json, or set ds.bf16.enabled=false")
        note = ("WARNING: this CPU has no bf16 arithmetic (AVX512-BF16 or AMX): bf16 trains many times slower "
                "than fp32 here; set ds.bf16.enabled=auto or false")
    plain_zero0 = zero_stage(ds) == 0 and "pipeline" not in ds
    if bf16 and plain_zero0 and device.type == "cuda":  # see DEFAULT_DS_CONFIG in training/config.py
        note = ("WARNING: bf16 with ZeRO-0 steps through DeepSpeed's unfused optimizer, one host synchronization "
                "per gradient tensor: use ds_configs/zero1.json (the default on a GPU), same memory at dp=1")
    return (torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32), note


def memory_capacity(device: torch.device, ranks_here: int) -> tuple[int, str]:
    """The bytes one rank may have, and what they are: a GPU's whole memory; on a CPU this machine's (or its
    container's, where a cgroup limits it) shared by the `ranks_here` ranks on it."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"{torch.cuda.get_device_name(device)}'s memory"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        total = min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        pass
    shared = f", shared by its {ranks_here} ranks" if ranks_here > 1 else ""
    return total // ranks_here, f"this machine's memory{shared}"


def peak_memory_gb(device: torch.device) -> tuple[float, float]:
    """Peak allocated and peak reserved (what the caching allocator holds, what an out-of-memory error
    counts) accelerator memory since the last call, which resets the peaks: each log interval reports its
    own. On CPU the process's peak resident memory, twice: it has no reset."""
    if device.type == "cuda":
        allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        return allocated / 2**30, reserved / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux
    return rss, rss


# Older than any build of an op. Work around torch's JIT builder, which DeepSpeed uses for its ops (on a CPU: the
# shared-memory all-reduce every run starts, the CPU Adam of offload): it takes a build folder's lock file and
# waits, without end or word, for any lock that is there, so one left by a process killed mid-build stops every
# later run at "joining the process group".
STALE_LOCK_SECONDS = 600


def check_op_build_locks() -> None:
    """Refuse to start on a build lock left behind (ConfigError naming it and the fix)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")  # torch's own variable: then one folder per op under it
    pattern = os.path.join(root, "*", "lock") if root else os.path.join(get_default_build_root(), "*", "*", "lock")
    for lock in sorted(glob.glob(pattern)):
        minutes = (time.time() - os.path.getmtime(lock)) / 60
        if minutes > STALE_LOCK_SECONDS / 60:
            raise ConfigError(f"{lock} is {minutes:.0f} minutes old: a process killed while torch built one of "
                              f"DeepSpeed's ops left it, and every run would wait on it forever; fix: delete it "
                              f"(rm {lock}), and the next run builds the op again")
