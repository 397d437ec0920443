"""What the GPU tier of the tests (tests/test_gpu*.py) measures, inside a child process on the device under test:
the tests' own process hides its GPUs (tests/conftest.py), and DeepSpeed picks its accelerator once per process,
so each probe runs where DS_ACCELERATOR and CUDA_VISIBLE_DEVICES say (cuda, or cpu for the CPU stand-ins).

    python -c "from benchmarks.gpu_probes import main; main()" PROBE OUT [ARGS ...]

    train OUT.json [--syncs] [--loader_sleep] [--spike] -- TRAIN.PY ARGS   train.py, watched (benchmarks/gpu_watch.py)
    weights OUT.pt TRAIN.PY ARGS           the whole model as train.py builds it for those settings, gathered
    memory OUT.json CONFIG DS_CONFIG,... [OVERRIDES]   the memory plan against the measured peak, per ds_config
    matmul OUT.json SIZE                   a bf16 matmul's FLOP/s against the device's datasheet peak
    preflight OUT.json PREFLIGHT.PY ARGS   preflight.py on one process, and the backend its process group had
    documents OUT.json                     FlexAttention's document masking against the dense mask's, bf16
    saves OUT.json TRAIN.PY ARGS           a synchronous save beside a background one
                                           (training/checkpoints/background_save.py)

A probe records what it saw as JSON (or tensors); the tests judge it, so the same probe serves the GPU and the
CPU stand-in of a check.
"""
import dataclasses
import gc
import importlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    probe, out, rest = argv[0], argv[1], argv[2:]
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        one_process_cpu_without_shm_op()
    if probe == "train":
        from benchmarks.gpu_watch import watch_train

        split = rest.index("--")
        write(out, watch_train(rest[:split], rest[split + 1:]))
    elif probe == "weights":
        torch.save(built_weights(rest), out)
    elif probe == "memory":
        write(out, memory_against_plan(rest[0], rest[1].split(","), rest[2:]))
    elif probe == "matmul":
        write(out, matmul_against_datasheet(int(rest[0])))
    elif probe == "preflight":
        write(out, preflight(rest))
    elif probe == "documents":
        write(out, flex_against_dense())
    elif probe == "saves":
        write(out, background_against_synchronous(os.path.dirname(os.path.abspath(out)), rest))
    else:
        raise SystemExit(f"error: unknown probe {probe}")


def one_process_cpu_without_shm_op() -> None:
    """A probe's one process on the CPU (the CPU reference of a GPU check) has nothing to all-reduce with: it goes
    without DeepSpeed's shared-memory all-reduce op, over gloo alone. DeepSpeed's CPU accelerator builds the op at
    its first use on a machine (about 35 s of a GPU box's tier, where the CPU reference is the only CPU run), and on
    a machine without setuptools or a C++ compiler (a torch image with benchmarks/wheelhouse.sh's wheels) it would
    fail at start."""
    # the module itself: the attribute deepspeed.comm.torch is the torch package that deepspeed.comm imports
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def write(path: str, record: dict) -> None:
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def start_one_process(argv: list[str]):
    """train.py's start for ARGS (its checks, the device, the process group) on this process alone: its Run."""
    from training.launch.failure import join_process_group
    from training.startup import check_run

    run = check_run(argv)
    join_process_group()
    return run


def built_weights(argv: list[str]) -> dict:
    """Every parameter of the model as train.py builds it (under ZeRO-3 partitioned as each layer is made,
    then gathered here), on the CPU: what a run starts from, to compare with another layout or device."""
    import deepspeed

    from training.launch.failure import leave_process_group
    from training.parallelize import parallelize
    from training.topology import zero_stage

    run = start_one_process(argv)
    model, _ = parallelize(run.cfg, run.pipe, run.ds)
    params = dict(model.named_parameters())
    zero3 = zero_stage(run.ds) == 3
    with deepspeed.zero.GatheredParameters(list(params.values())) if zero3 else _nothing():
        weights = {name: p.detach().to("cpu", copy=True) for name, p in params.items()}
    leave_process_group()
    return weights


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *_):
        return False


def memory_against_plan(config: str, ds_configs: list[str], overrides: list[str]) -> dict:
    """For each ds_config, one process's engine built and stepped as train.py does, its peak memory over the
    later steps (from before the model existed) next to training/memory_plan.py's plan for one device: on a GPU
    the allocator's, beside the live tensors' (benchmarks/live_tensors.py), which are the measure on a CPU."""
    from benchmarks import allocator_trace
    from benchmarks.live_tensors import LiveTensors
    from benchmarks.memory import MemoryProbe
    from training.ds_config import load_ds_config
    from training.engines import train_step
    from training.launch.failure import leave_process_group
    from training.memory_plan import plan
    from training.startup import effective_ds_config

    run = start_one_process(["--config", config, "--ds_config", ds_configs[0], *overrides])
    cfg, data, device, memory = run.cfg, run.data, run.device, MemoryProbe(run.device)
    # the model as this data trains it: document masking finds no documents in data without a delimiter
    planned_model = dataclasses.replace(cfg.model, document_masking=getattr(data, "documents", None) is not None)
    results = {}
    for path in ds_configs:
        # the ds.* overrides of the command line apply to each ds_config alike
        ds = load_ds_config(path, [o[3:] for o in overrides if o.startswith("ds.")])
        engine_settings = effective_ds_config(ds, cfg, 1, device)
        predicted = plan(planned_model, ds, 1, cfg.train.mlp_tiles, device.type, cfg.train.compile)
        release(device)
        baseline = memory.current() if device.type == "cuda" else 0
        traced = None
        with LiveTensors() as live:
            engine = build_engine(cfg, engine_settings.pipe, engine_settings.ds)
            for step in (1, 2, 3):
                if step == 2:  # the optimizer states exist from the first step on
                    memory.reset_peak()
                    live.reset_peak()
                    if device.type == "cuda":
                        allocator_trace.start()
                train_step(engine, data.step_batches(cfg.train.seed, step, 0, engine_settings.layout, device))
        if device.type == "cuda":
            measured = memory.peak_since_reset() - baseline
            states = memory.current() - baseline  # what outlives a step: the model states and DeepSpeed's buffers
            try:  # what explains a peak over the live tensors'; the figures above stand without it
                traced = allocator_trace.at_peak(allocator_trace.stop())
            except Exception as e:  # torch's private trace API may change under a new torch
                traced = {"error": f"{type(e).__name__}: {e}"}
        else:
            measured, states = live.peak, live.current
        results[os.path.basename(path)] = {
            "plan": predicted["total"], "plan_states": predicted["states"],
            "plan_activations": predicted["activations"], "measured": measured, "measured_states": states,
            "baseline": baseline, "live_tensors_peak": live.peak,
            "largest_at_peak": [list(row) for row in live.largest_at_peak()], "allocator_at_peak": traced}
        engine.destroy()
        del engine
        release(device)
    leave_process_group()
    return {"device": device_label(device), "config": config, "overrides": overrides, "results": results}


def background_against_synchronous(folder: str, argv: list[str]) -> dict:
    """The engine of train.py ARGS after two steps, saved synchronously and through a BackgroundWriter into
    folder/sync and folder/background: which files differ, and the storage locations each file's pickle names."""
    import zipfile

    from training.checkpoints import checkpoint
    from training.checkpoints.background_save import BackgroundWriter
    from training.engines import train_step
    from training.launch.failure import leave_process_group

    run = start_one_process(argv)
    engine = build_engine(run.cfg, run.pipe, run.ds)
    for step in (1, 2):
        train_step(engine, run.data.step_batches(run.cfg.train.seed, step, 0, run.layout, run.device))
    writers = {"sync": engine.checkpoint_engine, "background": BackgroundWriter(engine._config)}
    tag = checkpoint.tag_for(2)
    for name, writer in writers.items():
        engine.checkpoint_engine = writer
        checkpoint.save(engine, os.path.join(folder, name), 2, {"tag": tag, "step": 2}, 1, {})
        checkpoint.settle(engine)
    tag_dirs = {name: os.path.join(checkpoint.checkpoint_root(os.path.join(folder, name)), tag) for name in writers}
    files = sorted(f for f in os.listdir(tag_dirs["sync"]) if f.endswith(".pt"))
    contents = {name: {f: open(os.path.join(tag_dir, f), "rb").read() for f in files}
                for name, tag_dir in tag_dirs.items()}
    locations = {}
    for f in files:
        with zipfile.ZipFile(os.path.join(tag_dirs["background"], f)) as archive:
            locations[f] = storage_locations(archive.read(next(n for n in archive.namelist()
                                                              if n.endswith("/data.pkl"))))
    leave_process_group()
    return {"device": device_label(run.device), "files": files, "locations": locations,
            "differ": [f for f in files if contents["sync"][f] != contents["background"][f]]}


def storage_locations(data: bytes) -> list[str]:
    """The locations a torch file's pickle names for its storages (its persistent ids: 'storage', type, key,
    location, size), read without building anything: every other object is a stand-in."""
    import io
    import pickle

    class StandIn:
        def __init__(self, *args, **kwargs):
            pass

        def __setstate__(self, state):
            pass

    class Locations(pickle.Unpickler):
        seen = set()

        def find_class(self, module, name):
            return super().find_class(module, name) if module in ("builtins", "collections") else StandIn

        def persistent_load(self, pid):
            self.seen.add(pid[3])
            return StandIn()

    reader = Locations(io.BytesIO(data))
    reader.load()
    return sorted(reader.seen)


def build_engine(cfg, pipe, ds):
    from training.engines import training_engine
    from training.parallelize import parallelize

    model, _ = parallelize(cfg, pipe, ds)
    return training_engine(model, cfg, ds)


def release(device: torch.device) -> None:
    """What the last engine held, given back before the next one is measured."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def device_label(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def matmul_against_datasheet(n: int) -> dict:
    """The best FLOP/s of back-to-back bf16 n x n matmuls (timed between synchronizations, after a warm-up), and the
    datasheet peak that train.py's MFU line would name for this device (None where it has none: a CPU)."""
    from deepspeed.accelerator import get_accelerator

    from training.device import datasheet_tflops

    device = torch.device(get_accelerator().device_name(0))
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        torch.matmul(a, b)
    repeats, best = 10, float("inf")
    for _ in range(5):
        get_accelerator().synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            torch.matmul(a, b)
        get_accelerator().synchronize()
        best = min(best, time.perf_counter() - start)
    name = device_label(device)
    return {"device": name, "n": n, "tflops": 2 * n**3 * repeats / best / 1e12,
            "datasheet_tflops": datasheet_tflops(name, torch.bfloat16, tf32=True) if device.type == "cuda" else None}


def preflight(argv: list[str]) -> dict:
    """preflight.py on this process alone, as `python preflight.py ARGS` runs it; the backend of the process group
    it made is read as it is destroyed, so a one-rank NCCL group is seen to have started and ended."""
    import preflight as tool

    seen = {"backend": None, "destroyed": False}
    destroy = torch.distributed.destroy_process_group

    def destroy_and_note(*args, **kwargs):
        seen["backend"] = str(torch.distributed.get_backend())
        destroy(*args, **kwargs)
        seen["destroyed"] = True

    torch.distributed.destroy_process_group = destroy_and_note
    try:
        tool.main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    sys.stdout.flush()
    return {**seen, "exit": code}


def flex_against_dense() -> dict:
    """Document-masked attention in bf16 through the kernel the device gets (model/documents.py) and through the
    dense mask, on windows packed with documents of random lengths (grouped-query heads): the largest difference
    of the outputs and, on CUDA (FlexAttention has no CPU backward), of the input gradients, each next to the
    largest magnitude it is taken against."""
    import torch.nn.functional as F

    from model.documents import dense_document_mask, document_kernel, flex_document_attention

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    B, H, KV, T, D = (4, 8, 2, 1024, 64) if device.type == "cuda" else (2, 4, 2, 256, 32)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, T // 4, (B, T), generator=generator)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row])[:T] for row in lengths.tolist()]).to(device)
    backward = device.type == "cuda"
    q, k, v = (torch.randn(B, h, T, D, generator=generator).to(device, torch.bfloat16).requires_grad_(backward)
               for h in (H, KV, KV))
    results = {"kernel": document_kernel(device.type, 0.0), "documents": int((positions == 0).sum())}
    outputs = {}
    for name, attend in (("flex", lambda: flex_document_attention(q, k, v, positions)),
                         ("dense", lambda: F.scaled_dot_product_attention(
                             q, k, v, attn_mask=dense_document_mask(positions), enable_gqa=True))):
        with torch.set_grad_enabled(backward):
            out = attend()
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v)) if backward else ()
        outputs[name] = (out.detach().float(), [g.float() for g in grads])
    (flex, flex_grads), (dense, dense_grads) = outputs["flex"], outputs["dense"]
    results["output"] = {"max_diff": (flex - dense).abs().max().item(), "max_abs": dense.abs().max().item()}
    results["grads"] = [{"max_diff": (a - b).abs().max().item(), "max_abs": b.abs().max().item()}
                        for a, b in zip(flex_grads, dense_grads)]
    return results
