"""train.py through the real `deepspeed` launcher: 2 CPU processes over gloo, the real engine."""
import json
import math
import os
import struct

import pytest

from harness import BF16, FP32, REPO, TINY, expected_lr, launch, metrics, train_losses, train_py
from training.config import DEFAULT_CONFIG, load_run_config

pytestmark = pytest.mark.launch  # several train.py processes per test (python -m pytest -m "not launch" skips them)

STEPS = ["train.max_steps=6", "optim.warmup_steps=2"]


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory, char_data):
    """The same fp32 run at dp=2 under ZeRO 0, 1, 2 and 3."""
    runs = {}
    for stage in (0, 1, 2, 3):
        out = tmp_path_factory.mktemp(f"zero{stage}")
        # Threshold 0: ZeRO-3 partitions every parameter, the tied embedding included.
        extra = ["ds.zero_optimization.stage3_param_persistence_threshold=0"] if stage == 3 else []
        proc = launch(2, f"zero{stage}.json", out, char_data, [*STEPS, *FP32, *extra])
        (out / "launch.log").write_text(proc.stdout + proc.stderr)
        runs[stage] = out
    return runs


# Known, harmless messages that every run printed, silenced where they arise (training/noise.py): DeepSpeed's
# scheduler warning at start, torch's deprecation of the name ZeRO-1/2 gather with, the bf16 optimizer's
# memory printout, and a launcher named "none".
KNOWN_NOISE = ["Attempting to get learning rate from scheduler before it has started",
               "`torch.distributed.all_gather_into_tensor` is deprecated", "CPU Virtual Memory", "topology (none)"]


def assert_quiet(output: str) -> None:
    assert [noise for noise in KNOWN_NOISE if noise in output] == []


def test_a_run_prints_none_of_the_known_noise(zero_runs):
    for stage in (0, 1, 2, 3):
        output = (zero_runs[stage] / "launch.log").read_text()
        assert "topology (deepspeed): " in output and "saved step_000006" in output
        assert_quiet(output)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_and_2_match_zero_0_step_for_step(zero_runs, stage):
    reference, losses = train_losses(zero_runs[0]), train_losses(zero_runs[stage])
    assert len(losses) == len(reference) == 6
    assert losses == pytest.approx(reference, abs=1e-5)


def test_fp32_gradient_norm_is_reported_without_zero_too(zero_runs):
    """DeepSpeed reports the pre-clip norm under ZeRO but drops it at ZeRO-0 in fp32 (worked around)."""
    norms = {stage: [m["grad_norm"] for m in metrics(zero_runs[stage]) if "grad_norm" in m] for stage in (0, 1)}
    assert len(norms[0]) == 6 and norms[0] == pytest.approx(norms[1], rel=1e-4)


def counted_as_the_checks_count(out_dir, stage: int) -> tuple[int, dict]:
    """A ZeRO run's parameters, as it printed them, and its ds_config in fp32, as the start-up checks see them."""
    import re

    from training.ds_config import load_ds_config
    printed = re.search(r"model: ([\d,]+) parameters", (out_dir / "launch.log").read_text()).group(1)
    params = int(printed.replace(",", ""))
    return params, load_ds_config(os.path.join(REPO, "ds_configs", f"zero{stage}.json"), ["bf16.enabled=false"])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_checkpoint_is_at_least_what_the_disk_check_counts(zero_runs, stage):
    """training/checkpoints/space.py's size of a checkpoint is a floor (a run it passes may still fill its disk, one
    it refuses cannot fit) and close: the tiny model's files add their own few kB to 30k parameters' states."""
    from training.checkpoints.space import bytes_per_parameter
    params, ds = counted_as_the_checks_count(zero_runs[stage], stage)
    counted = params * bytes_per_parameter(ds)
    written = sum(path.stat().st_size for path in (zero_runs[stage] / "checkpoints" / "step_000006").rglob("*")
                  if path.is_file())
    assert counted <= written <= 1.25 * counted, (counted, written)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_ranks_files_are_at_least_its_share_as_the_host_memory_check_counts(zero_runs, stage):
    """A background save's host copy on a node is what its ranks write (training/checkpoints/space.py node_share):
    each of these two ranks taken as a node of its own, rank 0, the busiest, writes at least its share of the
    counted checkpoint (the weights without ZeRO, or its ZeRO partition) and at most 25% more; rank 1 no more."""
    from training.checkpoints.space import bytes_per_parameter, node_share
    from training.topology import Layout
    params, ds = counted_as_the_checks_count(zero_runs[stage], stage)
    files = list((zero_runs[stage] / "checkpoints" / "step_000006").rglob("*.pt"))
    written = {rank: sum(path.stat().st_size for path in files if f"zero_pp_rank_{rank}_" in path.name
                         or rank == 0 and path.name.startswith("mp_rank_")) for rank in (0, 1)}
    share = params * bytes_per_parameter(ds) * node_share(ds, Layout(2, 1, 1, 1), 1)
    assert share <= written[0] <= 1.25 * share, (share, written)
    assert written[1] <= written[0]


def test_zero_3_trains(zero_runs):
    losses = train_losses(zero_runs[3])
    assert len(losses) == 6
    assert losses[-1] < losses[0] - 0.05
    assert losses[0] == pytest.approx(train_losses(zero_runs[0])[0], abs=1e-5)  # same init, same data


def test_metrics_jsonl_records_every_measure(zero_runs, char_data):
    records = metrics(zero_runs[2])
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "lr", "grad_norm", "peak_mem_gb", "reserved_gb"):
        assert all(isinstance(r[key], float) and math.isfinite(r[key]) for r in steps), key
    for key in ("tokens_per_s", "mfu"):  # every step but the first, which is warm-up (see assert_in_range)
        assert all(isinstance(r[key], float) and math.isfinite(r[key]) for r in steps[1:]), key
    assert_in_range(steps)
    optim = load_run_config(DEFAULT_CONFIG, [f"data.dir={char_data}"]).optim  # the preset's rates; warmup 2 of 6
    expected = [expected_lr(k, optim.lr, optim.min_lr, 2, 6) for k in range(1, 7)]
    assert [r["lr"] for r in steps] == pytest.approx(expected)
    assert steps[0]["lr"] == pytest.approx(optim.lr / 2) and steps[-1]["lr"] == pytest.approx(optim.min_lr)
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 6]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]


def assert_in_range(steps: list[dict]) -> None:
    """What each measure can be: a loss near ln(65) at the start, a pre-clip gradient norm above zero, a
    utilisation strictly between 0 and 1 (the MFU peak is a matmul timed on this machine). The first step
    after a start pays for warm-up and is not timed: an interval holding only it records no speed."""
    assert 2.0 < steps[0]["loss"] < 6.0
    assert all(r["grad_norm"] > 0 and r["peak_mem_gb"] > 0 and r["reserved_gb"] >= r["peak_mem_gb"] for r in steps)
    assert "tokens_per_s" not in steps[0] and "mfu" not in steps[0]
    assert all(r["tokens_per_s"] > 0 for r in steps[1:])
    assert all(0 < r["mfu"] < 1 for r in steps[1:]), [r["mfu"] for r in steps[1:]]


def test_shipped_zero3_config_trains_unchanged_in_bf16(tmp_path, char_data):
    """ds_configs/zero3.json as shipped (its buckets and sub-groups), in bf16, dp=2 through the launcher."""
    launch(2, "zero3.json", tmp_path, char_data, [*BF16, "train.max_steps=8", "optim.warmup_steps=2", "optim.lr=3e-3"])
    with open(os.path.join(REPO, "ds_configs", "zero3.json")) as f:
        shipped = json.load(f)
    with open(tmp_path / "ds_config.json") as f:
        effective = json.load(f)
    derived = {"train_batch_size", "optimizer", "scheduler"}  # what train.py adds
    assert shipped["bf16"]["enabled"] == "auto" and effective["bf16"]["enabled"] is True
    assert {k: v for k, v in effective.items() if k not in derived | {"bf16"}} == \
        {k: v for k, v in shipped.items() if k != "bf16"}
    steps = [r for r in metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert_in_range(steps)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3


def test_bf16_with_fp32_gradient_reduction_stays_within_bf16_noise_of_a_bf16_reduction(tmp_path, char_data):
    """zero1.json in bf16 reduces and accumulates gradients in fp32 (accumulation 2 here); the same run
    reducing and accumulating in bf16 trains to losses within bf16's noise of it, and not bitwise the same."""
    losses = {}
    bf16_everywhere = ["ds.communication_data_type=bf16", "ds.data_types.grad_accum_dtype=bf16"]
    for name, extra in (("fp32", []), ("bf16", bf16_everywhere)):
        proc = launch(2, "zero1.json", tmp_path / name, char_data,
                      [*STEPS, *BF16, "ds.gradient_accumulation_steps=2", "ds.train_micro_batch_size_per_gpu=2",
                       *extra])
        losses[name] = train_losses(tmp_path / name)
        assert_quiet(proc.stdout + proc.stderr)  # the bf16 optimizer's memory printout among them
    assert len(losses["fp32"]) == 6 and losses["fp32"] == pytest.approx(losses["bf16"], abs=0.03)
    assert losses["fp32"] != losses["bf16"]
    assert losses["fp32"][-1] < losses["fp32"][0] - 0.1


def test_effective_config_is_saved(zero_runs):
    with open(os.path.join(zero_runs[1], "ds_config.json")) as f:
        ds = json.load(f)
    assert ds["train_batch_size"] == 24 and ds["train_micro_batch_size_per_gpu"] == 12
    assert ds["zero_optimization"]["stage"] == 1 and ds["bf16"]["enabled"] is False
    assert ds["optimizer"]["type"] == "AdamW" and ds["scheduler"]["type"] == "WarmupCosineLR"
    with open(os.path.join(zero_runs[1], "config.yaml")) as f:
        assert "n_embd: 32" in f.read()


def test_grad_accumulation_4x1_matches_1x4(tmp_path, char_data):
    losses = {}
    for micro, accum in ((4, 1), (1, 4)):
        out = tmp_path / f"m{micro}a{accum}"
        launch(2, "zero1.json", out, char_data, [*STEPS, *FP32, f"ds.train_micro_batch_size_per_gpu={micro}",
                                                 f"ds.gradient_accumulation_steps={accum}"])
        losses[micro, accum] = train_losses(out)
    assert len(losses[4, 1]) == 6
    assert losses[1, 4] == pytest.approx(losses[4, 1], abs=1e-5)


def test_single_process_without_launcher_trains_and_samples(tmp_path, char_data):
    """`python train.py` (no launcher, precision as shipped): loss falls and a sample is printed."""
    proc = train_py(["--ds_config", "ds_configs/zero0.json", f"train.out_dir={tmp_path}",
                     f"data.dir={char_data}", *TINY, "train.max_steps=30", "optim.lr=3e-3", "optim.warmup_steps=5",
                     "sample.max_new_tokens=40"])
    losses = train_losses(tmp_path)
    assert len(losses) == 30 and losses[-1] < losses[0] - 0.5
    sample = proc.stdout.split("--- sample ---\n")[1].split("\n----")[0]
    assert len(sample) == 41  # the one-character prompt plus 40 generated characters
    assert "topology (one process, no launcher): " in proc.stdout
    assert_quiet(proc.stdout + proc.stderr)


def test_compiled_model_trains_like_the_eager_one(tmp_path, char_data):
    """train.compile=true compiles each block and the loss (inductor, C++ on CPU; its cache proves a graph was built):
    same fp32 losses and samples (evaluation and sampling run eager)."""
    losses, samples = {}, {}
    for compiled in (False, True):
        out, cache = tmp_path / f"compile_{compiled}", tmp_path / f"inductor_{compiled}"
        proc = train_py(["--ds_config", "ds_configs/zero0.json", f"train.out_dir={out}", f"data.dir={char_data}",
                         *TINY, *FP32, "train.max_steps=4", "optim.warmup_steps=1",
                         f"train.compile={str(compiled).lower()}", "sample.max_new_tokens=4"],
                        env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
        losses[compiled], samples[compiled] = train_losses(out), proc.stdout.split("--- sample ---")[1]
        assert ("compiling 2 blocks (torch.compile)" in proc.stdout) == compiled
        assert (cache.exists() and any(cache.rglob("*.py"))) == compiled  # inductor wrote the compiled code
    assert len(losses[True]) == 4 and losses[True] == pytest.approx(losses[False], abs=1e-4)
    assert losses[True][-1] != losses[True][0]  # it trained
    assert samples[True] == samples[False]


def test_zero_2_with_cpu_offload_matches_zero_2(zero_runs, tmp_path, char_data):
    """Optimizer states on the CPU (DeepSpeedCPUAdam, JIT-built on first use) change nothing numerically."""
    launch(2, "zero2_offload.json", tmp_path, char_data, [*STEPS, *FP32])
    assert train_losses(tmp_path) == pytest.approx(train_losses(zero_runs[2]), abs=1e-5)


def wandb_records(path) -> list:
    """The records of a wandb 0.31 offline run file, read with wandb's own protobuf schema. The file is a
    LevelDB-style log (wandb-core writes it; the Python package has no reader): a 7-byte ':W&B' header,
    then 32 KiB blocks of chunks, each a 7-byte header (crc32c, length, type: 1 full, 2 first, 3 middle,
    4 last) and its bytes."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    records, chunks, pos = [], [], 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(b"".join(chunks))
            records.append(record)
            chunks = []
    return records


def test_wandb_offline_records_one_run_from_rank_0(tmp_path, char_data):
    """DeepSpeed's wandb monitor, rank 0 only: the offline run holds every step's loss and lr as
    metrics.jsonl has them, and the run config and ds_config that train.py adds."""
    wandb_dir = tmp_path / "wandb_home"
    wandb_dir.mkdir()
    out = tmp_path / "run"
    launch(2, "zero1.json", out, char_data,
           ["train.max_steps=2", "ds.wandb.enabled=true", "ds.wandb.project=megalite-test"],
           env={"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir)})
    runs = list((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1  # rank 1 never touched wandb
    history = list(runs[0].glob("run-*.wandb"))
    assert len(history) == 1
    logged, config = {}, {}
    for record in wandb_records(history[0]):
        if record.WhichOneof("record_type") == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            if "train/step" in row:  # x: samples seen, as DeepSpeed's own events (Train/Samples/lr) have it
                assert row["_step"] == 24 * row["train/step"]
                for key, value in row.items():
                    logged.setdefault(key, {})[row["train/step"]] = value
        elif record.WhichOneof("record_type") == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    steps = [r for r in metrics(out) if "loss" in r]
    assert logged["train/loss"] == {r["step"]: pytest.approx(r["loss"], rel=1e-6) for r in steps}
    assert logged["train/lr"] == {r["step"]: pytest.approx(r["lr"], rel=1e-6) for r in steps}
    assert logged["train/val_loss"] == {r["step"]: pytest.approx(r["val_loss"], rel=1e-6)
                                        for r in metrics(out) if "val_loss" in r}
    assert sorted(logged["Train/Samples/lr"]) == [1, 2]  # DeepSpeed's own events share the rows
    assert config["run"]["model"]["n_embd"] == 32 and config["run"]["train"]["max_steps"] == 2
    assert config["ds_config"]["zero_optimization"]["stage"] == 1 and config["ds_config"]["wandb"]["enabled"]
