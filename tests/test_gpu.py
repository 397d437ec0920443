"""The GPU tier (`python -m pytest -m gpu`, issue 24): every GPU path of the repo measured in minutes, the day a
GPU is at hand; here, the checks that read the runs of train.py the tier trains once each (`Runs`), and in
tests/test_gpu_probes.py those that run a probe of their own. Each measures in a child process on the device under
test (tests/gpu_tier.py); its `cpu` case, where a CPU stand-in exists, runs in the normal suite (the same probe
and the same assertions, with what the CPU is documented to do). Checks with no CPU stand-in are `cuda` only. The
figures of a GPU are benchmarks/record.sh's, which runs this tier first."""
import fcntl
import json
import os
import re
import shutil
import statistics

import pytest
import torch

from gpu_tier import CUDA, DEVICES, child_environment, probe
from harness import BF16, FP32, REPO, STARTED_DEVICES, TINY, metrics, train_losses


def test_a_child_on_the_device_gets_back_the_gpus_the_suite_was_started_with(monkeypatch):
    """In every worker of the suite, as the conftest saved them before hiding them: a whole-suite run on a GPU
    machine measures its GPU tier."""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and STARTED_DEVICES in os.environ
    monkeypatch.setenv(STARTED_DEVICES, json.dumps("1,3"))
    assert child_environment("cuda")["CUDA_VISIBLE_DEVICES"] == "1,3"
    monkeypatch.setenv(STARTED_DEVICES, "null")
    assert "CUDA_VISIBLE_DEVICES" not in child_environment("cuda")
    assert child_environment("cpu")["CUDA_VISIBLE_DEVICES"] == ""


# Runs of 3 log intervals: the first pays the warm-up, the second holds the counted steps (and a memory spike),
# the third a loader that sleeps. The MFU against the device's own peak, which one check reads.
INTERVAL = 8
RUN = [*TINY, f"train.log_interval={INTERVAL}", f"train.max_steps={3 * INTERVAL}", "sample.max_new_tokens=4",
       "train.peak_tflops=null"]
RUNS = {  # name: (probe options, ds_config, overrides); BF16 names bf16 (the shipped "auto" is fp32 on some CPUs)
    "zero1": (["--syncs", "--loader_sleep", "--spike"], "zero1.json", BF16),
    "zero2": (["--syncs"], "zero2.json", BF16),
    # every parameter partitioned and fetched (the default threshold keeps a model this small whole)
    "zero3": (["--syncs"], "zero3.json", [*BF16, "ds.zero_optimization.stage3_param_persistence_threshold=0"]),
    "fp32": ([], "zero1.json", [*FP32, "train.tf32=false"]),
    "auto": ([], "zero0.json", []),  # the shipped "auto", a model too narrow for bf16 weights on a CPU
    "flash": ([], "zero1.json", [*BF16, "train.sdpa_backend=flash"]),
    "compiled": ([], "zero1.json", [*BF16, "train.compile=true"]),
    "compiled_again": ([], "zero1.json", [*BF16, "train.compile=true"]),  # the same inductor cache
}

# Tolerances of docs/performance.md ("Precision on a GPU"): bf16 against fp32 (and compiled bf16 against eager), on
# the loss; fp32 with train.tf32=false on a GPU against the CPU, relative.
BF16_LOSS_TOLERANCE = 0.02
FP32_DEVICE_RTOL = 1e-4


class Run:
    def __init__(self, out_dir, stdout: str, record: dict):
        self.out_dir, self.stdout, self.record = out_dir, stdout, record

    def losses(self) -> list[float]:
        """The logged training losses, then the evaluation losses (the start's and the end's)."""
        evals = [m[k] for m in metrics(self.out_dir) for k in ("train_loss", "val_loss") if k in m]
        return train_losses(self.out_dir) + evals


class Runs:
    """Each run of RUNS once per device, on demand, for every check that reads it: once in the whole tier, also over
    several xdist workers (benchmarks/record.sh's), whose basetemps share a parent folder. A worker takes a run's lock,
    trains it unless a finished report is there, and reads it from there."""

    def __init__(self, tmp_path_factory, data_dir: str):
        base = tmp_path_factory.getbasetemp()
        self.root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "runs"
        self.root.mkdir(exist_ok=True)
        self.data_dir, self.done = data_dir, {}

    def train(self, device: str, name: str) -> Run:
        if (device, name) not in self.done:
            out = self.root / f"{device}_{name}"
            report, stdout = out / "probe.json", out / "stdout.txt"
            with open(self.root / f"{device}_{name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not report.exists():
                    shutil.rmtree(out, ignore_errors=True)  # a failed try's: train.py would resume its checkpoint
                    out.mkdir()
                    self.probe(device, name, out, report, stdout)
            self.done[device, name] = Run(out, stdout.read_text(), json.loads(report.read_text()))
        return self.done[device, name]

    def probe(self, device: str, name: str, out, report, stdout) -> None:
        options, ds_config, overrides = RUNS[name]
        cache = {"TORCHINDUCTOR_CACHE_DIR": str(self.root / f"inductor_{device}")}  # the compiled runs share it
        proc = probe(device, "train", report.with_suffix(".tmp"), *options, "--", "--ds_config",
                     f"ds_configs/{ds_config}", f"data.dir={self.data_dir}", f"train.out_dir={out}", *RUN,
                     *overrides, env=cache)
        stdout.write_text(proc.stdout)
        report.with_suffix(".tmp").rename(report)  # last: its presence says the run is whole


@pytest.fixture(scope="module")
def runs(tmp_path_factory, char_data) -> Runs:
    return Runs(tmp_path_factory, char_data)


# Host synchronizations per training step between two log intervals, by call site 'caller > callee' (module.function;
# '*': any caller), as docs/performance.md "Host synchronizations in a GPU step" lists them; PER_FETCH: once per
# parameter fetch. The GPU-only sites are DeepSpeed's stream and device synchronizations, which the CPU
# accelerator skips, and its scalars made on the host and copied to the device, which on a CPU copy nothing.
PER_FETCH = "per fetch"
SYNCS = {
    "zero1": {},  # DeepSpeed's bf16 optimizer, its step made on the device (training/steps.py)
    "zero2": {"stage_1_and_2._check_overflow > stage_1_and_2.has_overflow": 1,
              "stage_1_and_2.step > utils.is_invalid_grad_norm": 1,
              "stage_1_and_2.unscale_and_clip_grads > utils.is_invalid_grad_norm": 2},
    "zero3": {"stage3.step > utils.is_invalid_grad_norm": 1},
}
GPU_ONLY_SYNCS = {
    "zero1": {},
    "zero2": {"* > stage_1_and_2.independent_gradient_partition_epilogue": 1,
              "stage_1_and_2.get_grad_norm_direct > utils.mask_nan_or_inf_with_val_inplace": 4},
    "zero3": {"* > stage3.independent_gradient_partition_epilogue": 1, "* > partition_parameters.wait": PER_FETCH,
              "stage3._get_norm_groups > stage3.get_grad_norm_direct": 2},
}
LOG_SYNCS = {"train.log_progress > divergence.read": 1, "train.train_steps > train.log_progress": 1}


def per_step(seen: dict, expected: dict) -> dict:
    """Counts of a window of INTERVAL steps per step, a '*' site of `expected` summing every caller."""
    merged = {}
    for site, count in seen.items():
        wildcard = "* > " + site.split(" > ")[1]
        key = wildcard if wildcard in expected and site not in expected else site
        merged[key] = merged.get(key, 0) + count / INTERVAL
    return merged


def fetched_modules() -> int:
    """Modules of the run's model that own parameters: ZeRO-3 fetches each at most once for the forward and once
    for the backward pass of a step."""
    from model import build_model
    from training.config import DEFAULT_CONFIG, load_run_config

    cfg = load_run_config(DEFAULT_CONFIG, [o for o in RUN if o.startswith("model.")] + ["model.vocab_size=65"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    return sum(1 for m in model.modules() if any(True for _ in m.parameters(recurse=False)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["zero1", "zero2", "zero3"])
def test_a_steps_host_synchronizations_are_the_documented_ones(runs, device, layout):
    syncs = runs.train(device, layout).record["syncs"]
    expected = {**SYNCS[layout], **(GPU_ONLY_SYNCS[layout] if device == "cuda" else {})}
    counted = per_step(syncs.get("steps", {}), expected)
    fetches = {site: counted.pop(site, 0) for site, count in expected.items() if count == PER_FETCH}
    assert counted == {site: count for site, count in expected.items() if count != PER_FETCH}
    for site, count in fetches.items():
        assert 1 <= count <= 2 * fetched_modules(), site
    assert syncs["log"] == LOG_SYNCS  # the log interval: the loss read back, the gradient norm


def test_the_checked_synchronizations_are_the_documented_ones():
    with open(os.path.join(REPO, "docs", "performance.md")) as f:
        section = f.read().split("### Host synchronizations in a GPU step")[1].split("\n### ")[0]
    sites = {site for table in (*SYNCS.values(), *GPU_ONLY_SYNCS.values(), LOG_SYNCS) for site in table}
    assert [site for site in sites if f"`{site}`" not in section] == []


@pytest.mark.parametrize("device", [CUDA])
def test_batches_arrive_pinned_and_are_copied_without_blocking(runs, device):
    """One copy a step, on the loader's thread; the steps' synchronizations above hold none of the loader's."""
    run = runs.train(device, "zero1")
    assert run.record["copies"] == {"pinned=True non_blocking=True": 3 * INTERVAL}


@pytest.mark.timed
@pytest.mark.parametrize("device", DEVICES)
def test_a_step_does_not_wait_for_a_loader_that_sleeps_most_of_a_step(runs, device):
    """The loader sleeps 0.7 of the last step's time before each batch of the third interval: made on its thread
    while the step before computes, the batch is there when the loop asks for it. On both devices the order: each
    sleeping batch is made on the loader's thread, begun before the step before it ended (in the median: a loaded
    2-core CPU may leave the thread without a core for a whole millisecond step now and then). On a GPU also the
    time: a wait is counted from one step's end to the next one's start, and what the sleeping adds to the second
    interval's waits is the loader's; a batch made on the loop's thread adds a whole sleep, half of one is the
    line. A CPU that other tests load stretches the loop's own work between steps to the milliseconds of a tiny
    model's step (half a sleep was passed there, 0.53 of one): its order is its check."""
    record = runs.train(device, "zero1").record
    sleeps = {int(step): seconds for step, seconds in record["loader_sleeps"].items()}
    assert sorted(sleeps) == list(range(2 * INTERVAL + 2, 3 * INTERVAL + 1))
    made = record["batches_made"]
    assert sorted(map(int, made)) == sorted(sleeps)
    assert all(batch["thread"].startswith("batches") for batch in made.values()), made
    assert statistics.median(batch["ahead"] for batch in made.values()) > 0, made
    if device == "cuda":
        waits = [record["batch_waits"][str(step)] for step in sleeps]
        before = [record["batch_waits"][str(step)] for step in range(INTERVAL + 2, 2 * INTERVAL + 1)]
        added = statistics.median(waits) - statistics.median(before)
        assert added < 0.5 * statistics.median(sleeps.values()), (waits, before, sleeps)


MFU_LINE = re.compile(r"MFU against ([0-9.e+]+) TFLOP/s per device \((.*)\)\n")


@pytest.mark.parametrize("device", DEVICES)
def test_the_mfu_line_names_the_devices_peak(runs, device):
    """On a GPU its datasheet's dense bf16 peak (training/device.py); on a CPU the peak measured at start."""
    from training.device import datasheet_tflops

    run = runs.train(device, "zero1")
    tflops, source = MFU_LINE.search(run.stdout).groups()
    if device == "cuda":
        name = run.record["device_name"]
        datasheet = datasheet_tflops(name, torch.bfloat16, tf32=True)
        assert datasheet, f"{name} is not in training/device.py's DATASHEET_TFLOPS: add its dense peaks"
        assert (source, tflops) == (f"{name} datasheet, dense bf16", f"{datasheet:.3g}")
    else:
        assert re.fullmatch(r"measured (bf16|fp32) matmul peak.*", source) and float(tflops) > 0


@pytest.mark.parametrize("device", DEVICES)
def test_train_tf32_sets_the_float32_matmul_precision(runs, device):
    """On a GPU train.tf32 (on by default) makes float32 matmuls TF32, 10 mantissa bits: about 1e-4 and more off
    float64 where full float32 is about 1e-7; a CPU computes float32 matmuls in full whatever it says."""
    on, off = (runs.train(device, name).record["precision"] for name in ("zero1", "fp32"))
    if device == "cuda":
        assert (on["float32_matmul_precision"], on["cudnn_allow_tf32"]) == ("high", True)
        assert (off["float32_matmul_precision"], off["cudnn_allow_tf32"]) == ("highest", False)
        assert on["matmul_rel_error"] > 1e-4 > 1e-5 > off["matmul_rel_error"], (on, off)
    else:  # "medium" where oneDNN computes exact fp32 faster than MKL (training/device.py, amd_avx512_cpu)
        from training.device import amd_avx512_cpu
        expected = "medium" if amd_avx512_cpu(torch.device("cpu")) else "highest"
        assert on["float32_matmul_precision"] == off["float32_matmul_precision"] == expected
        assert on["matmul_rel_error"] < 1e-5 and off["matmul_rel_error"] < 1e-5


@pytest.mark.launch
def test_bf16_auto_gives_a_narrow_model_bf16_matmuls_under_fp32_weights_on_a_cpu_with_amx(runs):
    """On a CPU with AMX, bf16 "auto" keeps a model too narrow for bf16 weights in fp32 and rounds its matmuls'
    inputs to bf16 (oneDNN's fp32 math mode); elsewhere, and whenever a precision is named, full fp32: on an AMD
    CPU with AVX-512 through oneDNN's mode too, which there must compute in exact fp32."""
    from training.device import amd_avx512_cpu
    auto, fp32 = (runs.train("cpu", name) for name in ("auto", "fp32"))
    amx, amd = torch.cpu._is_amx_tile_supported(), amd_avx512_cpu(torch.device("cpu"))
    assert ("bf16 auto: fp32 with bf16 matmuls (AMX), faster on a CPU for a model 32 wide" in auto.stdout) == amx
    assert auto.record["precision"]["mkldnn_fp32_precision"] == ("bf16" if amx or amd else "ieee")
    assert (auto.record["precision"]["matmul_rel_error"] > 1e-4) == amx
    assert fp32.record["precision"]["mkldnn_fp32_precision"] == ("bf16" if amd else "ieee")
    assert fp32.record["precision"]["matmul_rel_error"] < 1e-5


@pytest.mark.parametrize("device", [CUDA])
def test_fp32_without_tf32_trains_the_cpus_losses(runs, device):
    """No CPU stand-in: it compares the GPU with the CPU."""
    gpu, cpu = runs.train(device, "fp32").losses(), runs.train("cpu", "fp32").losses()
    assert len(gpu) == 7 and gpu == pytest.approx(cpu, rel=FP32_DEVICE_RTOL)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_losses_stay_within_the_bf16_tolerance_of_fp32(runs, device):
    bf16, fp32 = runs.train(device, "zero1").losses(), runs.train(device, "fp32").losses()
    assert len(bf16) == 7 and bf16 == pytest.approx(fp32, abs=BF16_LOSS_TOLERANCE)
    assert bf16 != fp32  # two precisions, not one run twice


KERNEL_LINE = re.compile(r"attention: torch's (\w+) kernel \(train.sdpa_backend=(\w+)\)")


@pytest.mark.parametrize("device", DEVICES)
def test_train_sdpa_backend_puts_its_attention_kernel_first(runs, device):
    """On a GPU the start names the kernel torch picks for the model's attention: the one train.sdpa_backend asks
    for, which trains the losses of torch's own choice to bf16's tolerance. On a CPU, whose attention is
    model/cpu_attention.py's, the setting changes nothing: no such line, the same losses to the bit."""
    chosen, auto = runs.train(device, "flash"), runs.train(device, "zero1")
    if device == "cuda":
        assert KERNEL_LINE.search(chosen.stdout).groups() == ("flash", "flash")
        assert KERNEL_LINE.search(auto.stdout).group(2) == "auto"
        assert chosen.losses() == pytest.approx(auto.losses(), abs=BF16_LOSS_TOLERANCE)
    else:
        assert not KERNEL_LINE.search(chosen.stdout + auto.stdout)
        assert chosen.losses() == auto.losses()


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_blocks_train_the_eager_losses(runs, device):
    compiled, eager = runs.train(device, "compiled"), runs.train(device, "zero1")
    assert "compiling 2 blocks (torch.compile)" in compiled.stdout
    assert compiled.record["compiled"]["stats"]["unique_graphs"] >= 1
    assert compiled.losses() == pytest.approx(eager.losses(), abs=BF16_LOSS_TOLERANCE)


@pytest.mark.parametrize("device", DEVICES)
def test_compiling_is_not_charged_to_throughput(runs, device):
    """The first step compiles (seconds); the first logged interval's tokens/s is that of the steps after it: its
    time is theirs (each step's, and the loop's wait before it), not the compiling step's."""
    record = runs.train(device, "compiled").record
    steps = {int(step): seconds for step, seconds in record["step_seconds"].items()}
    later = range(2, INTERVAL + 1)
    assert steps[1] > 5 * statistics.median(steps[s] for s in later)  # it compiled
    run = runs.train(device, "compiled")
    tokens_per_step = int(re.search(r"([0-9,]+) tokens/step", run.stdout).group(1).replace(",", ""))
    first = metrics(run.out_dir)[1]  # after the step-0 evaluation
    assert first["step"] == INTERVAL
    timed = tokens_per_step * (INTERVAL - 1) / first["tokens_per_s"]
    # The wait before step 2 holds the first step's epilogue (the divergence watch's first kernels), which the
    # meter leaves out with the warm-up: the steps alone bound the timed interval from below.
    stepped = sum(steps[s] for s in later)
    walled = stepped + sum(record["batch_waits"][str(s)] for s in later)
    assert 0.9 * stepped <= timed < 1.5 * walled + 0.02 and timed < steps[1] / 2, (timed, stepped, walled, steps[1])


@pytest.mark.parametrize("device", DEVICES)
def test_a_second_run_reuses_the_compiled_graphs(runs, device):
    first = runs.train(device, "compiled").record["compiled"]
    again = runs.train(device, "compiled_again").record["compiled"]
    assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1  # a fresh cache: the first run compiled
    assert again["inductor"].get("fxgraph_cache_hit", 0) >= 1 and again["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert again["aot_autograd"].get("autograd_cache_hit", 0) >= 1


@pytest.mark.parametrize("device", DEVICES)
def test_metrics_hold_reserved_memory_and_each_intervals_peak(runs, device):
    """On a GPU each log interval's peak is its own (the peaks are reset): the spike of the second is gone from the
    third's; on a CPU both are the process's peak resident memory, which has no reset."""
    run = runs.train(device, "zero1")
    logs = [m for m in metrics(run.out_dir) if "loss" in m]
    peaks, reserved = [m["peak_mem_gb"] for m in logs], [m["reserved_gb"] for m in logs]
    assert len(logs) == 3 and min(peaks) > 0
    if device == "cuda":
        assert all(r >= p for r, p in zip(reserved, peaks))
        assert peaks[1] >= run.record["spike_gb"] and peaks[2] < peaks[1] - 0.9 * run.record["spike_gb"], peaks
    else:
        assert reserved == peaks and peaks == sorted(peaks)
