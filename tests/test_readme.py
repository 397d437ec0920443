"""The README's tables against the code and files they describe, read at test time: the memory plan
recomputed with training/memory_plan.py, and the shipped ds_configs. No processes."""
import glob
import json
import os
import re

import pytest
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from training.config import REPO_ROOT, load_ds_config, load_run_config
from training.memory_plan import GB, plan

DS_CONFIGS = os.path.join(REPO_ROOT, "ds_configs")


def readme_table(header_start: str) -> list[dict]:
    """The rows of the README table whose header line starts with `header_start`, as {column: cell}."""
    with open(os.path.join(REPO_ROOT, "README.md")) as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]
    header = cells(lines[start])
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, cells(line))))
    assert rows, f"the README table '{header_start}' has no rows"
    return rows


def gb(cell: str) -> tuple[str, ...]:
    """The GB figures of a cell as written ("2.3 GB (+27 GB CPU)" -> ("2.3", "27"))."""
    figures = tuple(re.findall(r"([\d.]+) GB", cell))
    assert figures, f"no GB figure in {cell!r}"
    return figures


def as_written(value_bytes: float, written: str) -> str:
    """A value in GB with as many decimals as the README figure it is compared with."""
    decimals = len(written.split(".")[1]) if "." in written else 0
    return f"{value_bytes / GB:.{decimals}f}"


MEMORY_ROWS = readme_table("| preset | ds_config | GPUs | model states")


@pytest.mark.parametrize("row", MEMORY_ROWS, ids=lambda r: f"{r['preset']}-{r['ds_config']}-{r['GPUs']}")
def test_memory_plan_reproduces_the_readme_table(row):
    """Each row, recomputed for each ds_config it names ("zero0 / zero1 / zero2"); a layout in parentheses
    ("pipe2 (dp 4 x pp 2)") must be the one the plan derives."""
    cfg = load_run_config(os.path.join(REPO_ROOT, "configs", f"{row['preset']}.yaml"), []).model
    names, _, layout = row["ds_config"].partition(" (")
    for name in names.split(" / "):
        p = plan(cfg, load_ds_config(os.path.join(DS_CONFIGS, f"{name.strip()}.json"), []), int(row["GPUs"]))
        if layout:
            assert layout.rstrip(")") in p["layout"], (name, p["layout"])
        states, *cpu = gb(row["model states / GPU"])
        (activations,), (total,) = gb(row["activations / GPU"]), gb(row["total / GPU"])
        computed = (as_written(p["states"], states), *[as_written(p["cpu"], c) for c in cpu],
                    as_written(p["activations"], activations), as_written(p["total"], total))
        assert computed == (states, *cpu, activations, total), name
        assert bool(cpu) == bool(p["cpu"]), name  # host memory shown exactly where the plan offloads


DS_ROWS = readme_table("| file | ZeRO | precision |")


def test_the_ds_config_table_lists_every_shipped_file():
    listed = sorted(re.fullmatch(r"`(.+)`", row["file"]).group(1) for row in DS_ROWS)
    assert listed == sorted(os.path.basename(p) for p in glob.glob(os.path.join(DS_CONFIGS, "*.json")))


@pytest.mark.parametrize("row", DS_ROWS, ids=lambda r: r["file"].strip("`"))
def test_shipped_ds_config_matches_the_readme_table(row):
    """ZeRO stage, offload and pipeline stages from the ZeRO column, precision from its column, and the
    notes' promises (16-bit weights gathered on save, DeepSpeedCPUAdam)."""
    name = row["file"].strip("`")
    with open(os.path.join(DS_CONFIGS, name)) as f:
        ds = json.load(f)
    load_ds_config(os.path.join(DS_CONFIGS, name), [])  # and DeepSpeed's parser accepts it
    zero = ds.get("zero_optimization", {})
    assert zero.get("stage", 0) == int(re.match(r"(\d)", row["ZeRO"]).group(1)), name
    offloads = "offload" in row["ZeRO"] or "on the CPU" in row["ZeRO"]
    assert (zero.get("offload_optimizer", {}).get("device", "none") == "cpu") == offloads, name
    stages = re.search(r"(\d+) pipeline stages", row["ZeRO"])
    assert ds.get("pipeline", {}).get("stages", 1) == (int(stages.group(1)) if stages else 1), name
    tp = re.search(r"tensor-parallel degree (\d+)", row["ZeRO"])
    assert ds.get("tensor_model_parallel_size", 1) == (int(tp.group(1)) if tp else 1), name
    precision = row["precision"].split()[0]
    assert precision in ("bf16", "fp16", "fp32"), row["precision"]
    bf16 = ("auto" if "auto" in row["precision"] else True) if precision == "bf16" else False
    assert ds.get("bf16", {}).get("enabled", False) == bf16, name
    assert ds.get("fp16", {}).get("enabled", False) == (precision == "fp16"), name
    if "dynamic loss scaling" in row["precision"]:
        assert ds["fp16"].get("loss_scale", 0) == 0, name  # 0 is DeepSpeed's dynamic scaling
    if "gathered on save" in row["notes"]:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True, name
    if "DeepSpeedCPUAdam" in row["notes"]:
        assert offloads, name  # the optimizer class itself: tests/test_engine.py::test_optimizer_class
    if "gradients accumulated in fp32" in row["notes"]:
        assert ds["data_types"]["grad_accum_dtype"] == "fp32", name
    if bf16:
        assert ds["communication_data_type"] == "fp32", name  # the README's sentence on bf16 reduction
    sizes = ("reduce_bucket_size", "prefetch_bucket_size", "max_live_parameters", "max_reuse_distance", "sub_group_size")
    parsed = DeepSpeedZeroConfig(**zero)
    if "GPU-sized" in row["notes"]:
        assert [getattr(parsed, k) for k in sizes] == [getattr(DeepSpeedZeroConfig(), k) for k in sizes], name
    if "10M-element buckets, sub-groups and live parameters, no reuse" in row["notes"]:
        assert [getattr(parsed, k) for k in sizes] == [10**7, 10**7, 10**7, 0, 10**7], name


def test_shipped_batch_and_clipping_as_the_readme_says():
    """"The ZeRO configs use micro batch M per process and gradient accumulation A; the pipeline configs
    micro batch P and 2 x stages micro-batches per step ... All clip gradients at C." """
    with open(os.path.join(REPO_ROOT, "README.md")) as f:
        text = " ".join(f.read().split())
    said = re.search(r"The ZeRO configs use micro batch (\d+) per process and gradient accumulation (\d+); the "
                     r"pipeline configs micro batch (\d+) and (\d+) x stages micro-batches per step.*?All clip "
                     r"gradients at ([\d.]+)\.", text)
    assert said, "the README's sentence about the shipped batch sizes changed: update this test with it"
    micro, accum, pipe_micro, per_stage, clip = int(said[1]), int(said[2]), int(said[3]), int(said[4]), float(said[5])
    for path in glob.glob(os.path.join(DS_CONFIGS, "*.json")):
        with open(path) as f:
            ds = json.load(f)
        stages = ds.get("pipeline", {}).get("stages", 1)
        if stages > 1:
            expected = (pipe_micro, per_stage * stages)
        else:
            expected = (micro, accum)
        assert (ds["train_micro_batch_size_per_gpu"], ds.get("gradient_accumulation_steps", 1)) == expected, path
        assert ds["gradient_clipping"] == clip, path
