"""The device's precision and peak (training/device.py): datasheet peaks by GPU name, the measured CPU peak,
bf16 "auto", and bf16 refused where a GPU only emulates it."""
import os
import platform
import subprocess
import sys
import time

import pytest
import torch

from common.checks import ConfigError
from harness import train_py
from refusals import assert_refused_at_start
from training import device as dev


@pytest.mark.parametrize("name,dtype,tf32,tflops", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, True, 989),  # the SXM H100's name
    ("NVIDIA H100 PCIe", torch.bfloat16, True, 756),
    ("NVIDIA H100 NVL", torch.float16, True, 835),
    ("NVIDIA H200", torch.bfloat16, True, 989),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, True, 312),
    ("NVIDIA A100-SXM4-80GB", torch.float32, True, 156),  # TF32 tensor cores
    ("NVIDIA A100-SXM4-80GB", torch.float32, False, 19.5),
    ("Tesla V100-SXM2-32GB", torch.float32, True, 15.7),  # no TF32 there
    ("NVIDIA GeForce GTX 1080", torch.float32, True, None),  # unknown: measured instead
])
def test_datasheet_peaks_by_device_name(name, dtype, tf32, tflops):
    assert dev.datasheet_tflops(name, dtype, tf32) == tflops


def test_the_override_and_the_measured_peak_say_where_they_come_from():
    cpu = torch.device("cpu")
    assert dev.peak_flops(cpu, torch.float32, override_tflops=2.5) == (2.5e12, "train.peak_tflops")
    start = time.perf_counter()
    flops, source = dev.peak_flops(cpu, torch.float32)
    assert time.perf_counter() - start < 5 and source == "measured fp32 matmul peak"
    assert 1e9 < flops < 1e14  # a CPU core does between a GFLOP/s and a hundred TFLOP/s


def test_an_emulated_bf16_cpu_is_measured_against_its_fp32_peak(monkeypatch):
    """Where bf16 matmuls run below fp32 ones the hardware does fp32 arithmetic: that peak is the denominator."""
    rates = {torch.bfloat16: 1.4e9, torch.float32: 90e9}
    monkeypatch.setattr(dev, "measure_matmul_flops", lambda device, dtype, seconds=0.3: rates[dtype])
    flops, source = dev.peak_flops(torch.device("cpu"), torch.bfloat16)
    assert flops == 90e9 and source == "measured fp32 matmul peak: bf16 is emulated on this CPU (1.4 GFLOP/s)"
    rates[torch.bfloat16] = 400e9  # AVX512-BF16 or AMX: bf16 is the peak
    assert dev.peak_flops(torch.device("cpu"), torch.bfloat16) == (400e9, "measured bf16 matmul peak")


@pytest.mark.parametrize("native", [True, False])
def test_bf16_auto_follows_the_device_and_is_written_into_the_effective_ds_config(monkeypatch, native):
    from training.config import DEFAULT_CONFIG, load_run_config
    from training.startup import effective_ds_config
    monkeypatch.setattr(dev, "native_bf16", lambda device: native)
    ds = {"bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": 1}
    dtype, note = dev.compute_dtype(ds, torch.device("cpu"), dev.CPU_BF16_MIN_WIDTH)
    assert dtype == (torch.bfloat16 if native else torch.float32)
    assert note == (None if native else "bf16 auto: fp32, since this cpu has no bf16 arithmetic (set "
                                        "ds.bf16.enabled=true to force it)")
    cfg = load_run_config(DEFAULT_CONFIG, [f"model.n_embd={dev.CPU_BF16_MIN_WIDTH}"])
    engine = effective_ds_config(ds, cfg, 1, torch.device("cpu"))
    assert engine.ds["bf16"]["enabled"] is native and engine.dtype == dtype and engine.precision_note == note
    assert ds["bf16"]["enabled"] == "auto"  # the loaded ds_config is left as it is


def test_bf16_auto_is_fp32_for_a_model_too_narrow_to_gain_on_a_cpu(monkeypatch):
    """The quickstart's 128-wide model trains faster in fp32 on CPUs that compute bf16 (docs/performance.md); a
    GPU that computes bf16 gets it whatever the width."""
    from training.config import DEFAULT_CONFIG, load_run_config
    from training.startup import effective_ds_config
    monkeypatch.setattr(dev, "native_bf16", lambda device: True)
    monkeypatch.setattr(dev, "amx_cpu", lambda device: False)
    monkeypatch.setattr(dev, "amd_avx512_cpu", lambda device: False)
    ds = {"bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": 1}
    narrow = dev.CPU_BF16_MIN_WIDTH - 1
    assert dev.compute_dtype(ds, torch.device("cpu"), narrow) == (
        torch.float32, f"bf16 auto: fp32, faster on a CPU for a model {narrow} wide (bf16 from model.n_embd=256 on; "
                       f"set ds.bf16.enabled=true or false to force either)")
    assert not dev.bf16_matmuls_in_fp32(ds, torch.device("cpu"), narrow)  # AVX512-BF16 alone
    assert dev.compute_dtype({**ds, "zero_optimization": {"stage": 1}}, torch.device("cuda", 0), narrow) == (
        torch.bfloat16, None)
    assert dev.compute_dtype({"bf16": {"enabled": True}}, torch.device("cpu"), narrow) == (torch.bfloat16, None)
    engine = effective_ds_config(ds, load_run_config(DEFAULT_CONFIG, []), 1, torch.device("cpu"))  # the quickstart
    assert engine.ds["bf16"]["enabled"] is False and engine.dtype == torch.float32 and not engine.onednn_matmuls


def test_bf16_auto_gives_a_narrow_model_bf16_matmuls_under_fp32_weights_on_amx(monkeypatch):
    """On a CPU with AMX the quickstart's 128-wide model keeps fp32 weights and computes its matmuls in bf16
    (docs/performance.md); a model wide enough gets bf16 weights, and a precision named in the ds_config is kept."""
    from training.config import DEFAULT_CONFIG, load_run_config
    from training.startup import effective_ds_config
    monkeypatch.setattr(dev, "native_bf16", lambda device: True)
    monkeypatch.setattr(dev, "amx_cpu", lambda device: device.type == "cpu")
    auto, cpu, narrow = {"bf16": {"enabled": "auto"}}, torch.device("cpu"), dev.CPU_BF16_MIN_WIDTH - 1
    assert dev.compute_dtype(auto, cpu, narrow) == (
        torch.float32, f"bf16 auto: fp32 with bf16 matmuls (AMX), faster on a CPU for a model {narrow} wide (bf16 "
                       f"from model.n_embd=256 on; set ds.bf16.enabled=true or false to force either)")
    assert dev.bf16_matmuls_in_fp32(auto, cpu, narrow)
    assert not dev.bf16_matmuls_in_fp32(auto, cpu, dev.CPU_BF16_MIN_WIDTH)  # bf16 weights
    assert not dev.bf16_matmuls_in_fp32({"bf16": {"enabled": False}}, cpu, narrow)
    assert not dev.bf16_matmuls_in_fp32(auto, torch.device("cuda", 0), narrow)
    engine = effective_ds_config({**auto, "train_micro_batch_size_per_gpu": 1}, load_run_config(DEFAULT_CONFIG, []),
                                 1, cpu)  # the quickstart
    assert engine.ds["bf16"]["enabled"] is False and engine.dtype == torch.float32 and engine.onednn_matmuls


def test_an_amd_cpu_with_avx512_takes_its_fp32_matmuls_through_onednn_whatever_the_precision(monkeypatch):
    """oneDNN's AVX-512 kernels, exact fp32 without AMX, against MKL's AVX2 ones on AMD (docs/performance.md)."""
    from training.config import DEFAULT_CONFIG, load_run_config
    from training.startup import effective_ds_config
    monkeypatch.setattr(dev, "native_bf16", lambda device: True)
    monkeypatch.setattr(dev, "amx_cpu", lambda device: False)
    monkeypatch.setattr(dev, "amd_avx512_cpu", lambda device: device.type == "cpu")
    auto, cpu, narrow = {"bf16": {"enabled": "auto"}}, torch.device("cpu"), dev.CPU_BF16_MIN_WIDTH - 1
    assert dev.compute_dtype(auto, cpu, narrow)[1].startswith("bf16 auto: fp32 with oneDNN's AVX-512 matmuls, faster")
    assert not dev.bf16_matmuls_in_fp32(auto, cpu, narrow)
    for ds, width in ((auto, narrow), (auto, dev.CPU_BF16_MIN_WIDTH), ({"bf16": {"enabled": False}}, narrow)):
        assert dev.onednn_matmuls(ds, cpu, width)
    assert not dev.onednn_matmuls(auto, torch.device("cuda", 0), narrow)
    engine = effective_ds_config({**auto, "train_micro_batch_size_per_gpu": 1}, load_run_config(DEFAULT_CONFIG, []),
                                 1, cpu)  # the quickstart
    assert engine.dtype == torch.float32 and engine.onednn_matmuls


@pytest.mark.parametrize("asked", ["auto", "cudnn", "math"])
def test_train_sdpa_backend_goes_first_in_torchs_attention_order_on_a_gpu(monkeypatch, asked):
    """set_kernels's GPU branch through torch's own priority order (a process-wide setting, restored here): the
    kernel asked for first, the others in torch's order; `auto` leaves the order as torch has it. What it returns
    is torch's pick after the change; only that pick, which needs CUDA tensors, is read from the order here (the
    GPU tier runs it for real)."""
    from types import SimpleNamespace
    monkeypatch.setattr(dev, "sdpa_backend", lambda device, *shape: next(
        name for name, b in dev.SDPA_BACKENDS.items() if int(b) == torch._C._get_sdp_priority_order()[0]))
    before, precision = torch._C._get_sdp_priority_order(), torch.get_float32_matmul_precision()
    try:
        model = SimpleNamespace(n_head=4, kv_heads=2, head_width=32, block_size=64)
        chosen = dev.set_kernels(torch.device("cuda", 0), SimpleNamespace(tf32=True, sdpa_backend=asked), False,
                                 torch.bfloat16, model)
        order = torch._C._get_sdp_priority_order()
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch._C._set_sdp_priority_order(before)
        torch.set_float32_matmul_precision(precision)
    first = before[0] if asked == "auto" else int(dev.SDPA_BACKENDS[asked])
    assert order == [first, *(b for b in before if b != first)]
    assert chosen == next(name for name, b in dev.SDPA_BACKENDS.items() if int(b) == first)


def test_the_cpu_vendor_is_read_from_proc_cpuinfo():
    vendor = dev._cpu_vendor()
    assert vendor in ("GenuineIntel", "AuthenticAMD", "") and dev.amd_avx512_cpu(torch.device("cpu")) == (
        vendor == "AuthenticAMD" and torch.backends.cpu.get_cpu_capability().startswith("AVX512"))


def test_bf16_by_name_is_refused_on_a_gpu_that_emulates_it_and_warned_on_a_cpu(monkeypatch):
    monkeypatch.setattr(dev, "native_bf16", lambda device: False)
    with pytest.raises(ConfigError, match="bf16 is emulated on this cuda device .* use ds_configs/zero2_fp16.json"):
        dev.compute_dtype({"bf16": {"enabled": True}}, torch.device("cuda", 0), 128)
    dtype, note = dev.compute_dtype({"bf16": {"enabled": True}}, torch.device("cpu"), 128)
    assert dtype == torch.bfloat16 and note.startswith("WARNING: this CPU has no bf16 arithmetic")


@pytest.mark.parametrize("reported", [True, False], ids=["avx512-fp16", "no-fp16"])
def test_fp16_is_refused_on_any_cpu_whatever_the_accelerator_reports(monkeypatch, reported):
    """DeepSpeed's CPU accelerator reports fp16 supported on a CPU with AVX512-FP16 (mkldnn emulates it, far
    below bf16's speed there): the refusal the docs promise holds on every CPU."""
    monkeypatch.setattr(type(dev.get_accelerator()), "is_fp16_supported", lambda self: reported)
    with pytest.raises(ConfigError, match=r"^fp16 is not supported on cpu: use a bf16 ds_config \(e.g. "
                                          r"ds_configs/zero2.json\) or set ds.fp16.enabled=false$"):
        dev.compute_dtype({"fp16": {"enabled": True}}, torch.device("cpu"), 128)


def test_a_stale_op_build_lock_stops_a_run_at_start_and_a_fresh_one_is_left_to_its_build(tmp_path, monkeypatch,
                                                                                         char_data):
    """A lock of torch's JIT builder left by a process killed mid-build of one of DeepSpeed's ops: every run would
    wait on it forever without a word. One younger than any build belongs to a build under way. (Only the calls
    here and the refused run see the lock: the tests' rank server, started with this environment, would wait.)"""
    lock = tmp_path / "extensions" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    an_hour_ago = time.time() - 3600
    message = (f"{lock} is 60 minutes old: a process killed while torch built one of DeepSpeed's ops left it, and "
               f"every run would wait on it forever; fix: delete it (rm {lock}), and the next run builds the op again")
    with monkeypatch.context() as patched:
        patched.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
        dev.check_op_build_locks()
        os.utime(lock, (an_hour_ago, an_hour_ago))
        with pytest.raises(ConfigError) as refused:
            dev.check_op_build_locks()
    assert str(refused.value) == message
    proc = train_py([f"data.dir={char_data}", f"train.out_dir={tmp_path}/out"], check=False, timeout=120,
                    env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")})
    assert_refused_at_start(proc, f"error: {message}")
    assert lock.exists()  # the user's to delete


FAULTS_SCRIPT = """
import ctypes, resource, sys, torch
from training.device import M_MMAP_THRESHOLD, keep_freed_host_memory
if sys.argv[1] == "keep":
    assert keep_freed_host_memory(torch.device("cpu"))
else:  # glibc's starting threshold, held: the heap's layout decides whether its own raised one trims
    assert ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024)
def step():  # four 8 MiB activations, freed together as a step's are
    return [torch.empty(2**21).fill_(1.0) for _ in range(4)]
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's settings are glibc's")
def test_freed_host_memory_is_kept_for_the_next_step_not_faulted_in_again():
    """At glibc's starting threshold (128 KiB) each 8 MiB tensor is mapped afresh and unmapped when freed, so each
    step faults its 8,192 pages in again; kept, the next step reuses them. (Left alone, glibc raises that threshold
    as blocks are freed and then trims the heap's top, or not, as the heap's layout happens to allow: 10,182 or
    81,574 faults from one run to the next.)"""
    faults = {how: int(subprocess.run([sys.executable, "-c", FAULTS_SCRIPT, how], capture_output=True, text=True,
                                      check=True, cwd=os.path.dirname(os.path.dirname(__file__))).stdout)
              for how in ("returned", "keep")}
    assert faults["returned"] > 10 * 8192 * 0.9  # each step's pages faulted in again
    assert faults["keep"] < 2 * 2048  # under two tensors' worth in all ten steps
