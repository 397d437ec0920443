"""The documentation against the code and files it describes, read at test time: the tables of README.md and
docs/*.md (the memory plan recomputed with training/memory_plan.py, the shipped ds_configs), and every relative
link and #anchor resolving. No processes."""
import glob
import json
import os
import re

import pytest
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from training.config import REPO_ROOT, load_run_config
from training.ds_config import load_ds_config
from training.memory_plan import GB, plan

DS_CONFIGS = os.path.join(REPO_ROOT, "ds_configs")


DOCS = [os.path.join(REPO_ROOT, "README.md")] + sorted(glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")))


def read_lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def doc_table(header_start: str) -> list[dict]:
    """The rows of the one table in README.md or docs/*.md whose header line starts with `header_start`, as
    {column: cell}."""
    found = [(path, lines, i) for path in DOCS for lines in [read_lines(path)]
             for i, line in enumerate(lines) if line.startswith(header_start)]
    assert len(found) == 1, (f"the table '{header_start}' is in {len(found)} places in README.md and docs/*.md: "
                             f"{[os.path.relpath(p, REPO_ROOT) for p, _, _ in found]}; it must be in one")
    path, lines, start = found[0]

    def cells(line):
        return [c.strip() for c in line.strip().strip("|").split("|")]

    header = cells(lines[start])
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, cells(line))))
    assert rows, f"the table '{header_start}' in {os.path.relpath(path, REPO_ROOT)} has no rows"
    return rows


def gb(cell: str) -> tuple[str, ...]:
    """The GB figures of a cell as written ("2.3 GB (+27 GB CPU)" -> ("2.3", "27"))."""
    figures = tuple(re.findall(r"([\d.]+) GB", cell))
    assert figures, f"no GB figure in {cell!r}"
    return figures


def as_written(value_bytes: float, written: str) -> str:
    """A value in GB with as many decimals as the documented figure it is compared with."""
    decimals = len(written.split(".")[1]) if "." in written else 0
    return f"{value_bytes / GB:.{decimals}f}"


MEMORY_ROWS = doc_table("| preset | ds_config | GPUs | model states")


@pytest.mark.parametrize("row", MEMORY_ROWS, ids=lambda r: f"{r['preset']}-{r['ds_config']}-{r['GPUs']}")
def test_memory_plan_reproduces_the_documented_table(row):
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


DS_ROWS = doc_table("| file | ZeRO | precision |")


def test_the_ds_config_table_lists_every_shipped_file():
    listed = sorted(re.fullmatch(r"`(.+)`", row["file"]).group(1) for row in DS_ROWS)
    assert listed == sorted(os.path.basename(p) for p in glob.glob(os.path.join(DS_CONFIGS, "*.json")))


@pytest.mark.parametrize("row", DS_ROWS, ids=lambda r: r["file"].strip("`"))
def test_shipped_ds_config_matches_the_documented_table(row):
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
    sp = re.search(r"sequence-parallel degree (\d+)", row["ZeRO"])
    assert ds.get("sequence_parallel_size", 1) == (int(sp.group(1)) if sp else 1), name
    precision = row["precision"].split()[0]
    assert precision in ("bf16", "fp16", "fp32"), row["precision"]
    bf16 = ("auto" if "auto" in row["precision"] else True) if precision == "bf16" else False
    assert ds.get("bf16", {}).get("enabled", False) == bf16, name
    assert ds.get("fp16", {}).get("enabled", False) == (precision == "fp16"), name
    if "dynamic loss scaling" in row["precision"]:
        assert ds["fp16"].get("loss_scale", 0) == 0, name  # 0 is DeepSpeed's dynamic scaling
    own_batch = re.search(r"micro-batch (\d+), (\d+) a step", row["notes"])  # a preset's own (llama3_*)
    if own_batch:
        assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == \
            (int(own_batch[1]), int(own_batch[2])), name
    if "gathered on save" in row["notes"]:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True, name
    if "DeepSpeedCPUAdam" in row["notes"]:
        assert offloads, name  # the optimizer class itself: tests/test_engine.py::test_optimizer_class
    if "gradients accumulated in fp32" in row["notes"]:
        assert ds["data_types"]["grad_accum_dtype"] == "fp32", name
    if bf16:
        assert ds["communication_data_type"] == "fp32", name  # the docs' sentence on bf16 reduction
    sizes = ("reduce_bucket_size", "prefetch_bucket_size", "max_live_parameters", "max_reuse_distance",
             "sub_group_size")
    parsed = DeepSpeedZeroConfig(**zero)
    if "GPU-sized" in row["notes"]:
        assert [getattr(parsed, k) for k in sizes] == [getattr(DeepSpeedZeroConfig(), k) for k in sizes], name
    if "10M-element buckets, sub-groups and live parameters, no reuse" in row["notes"]:
        assert [getattr(parsed, k) for k in sizes] == [10**7, 10**7, 10**7, 0, 10**7], name


def test_shipped_batch_and_clipping_as_the_docs_say():
    """"The ZeRO configs use micro batch M per process and gradient accumulation A; the pipeline configs
    micro batch P and 2 x stages micro-batches per step ... All clip gradients at C." (in README.md or
    docs/*.md, once); the Llama 3.1 presets' own are checked against their rows."""
    sentence = (r"The ZeRO configs use micro batch (\d+) per process and gradient accumulation (\d+); the "
                r"pipeline configs micro batch (\d+) and (\d+) x stages micro-batches per step.*?All clip "
                r"gradients at ([\d.]+)\.")
    found = [said for path in DOCS for said in [re.search(sentence, " ".join(" ".join(read_lines(path)).split()))]
             if said]
    assert len(found) == 1, ("the sentence about the shipped batch sizes is in README.md and docs/*.md "
                             f"{len(found)} times (changed? update this test with it)")
    said = found[0]
    micro, accum, pipe_micro, per_stage, clip = int(said[1]), int(said[2]), int(said[3]), int(said[4]), float(said[5])
    for path in glob.glob(os.path.join(DS_CONFIGS, "*.json")):
        with open(path) as f:
            ds = json.load(f)
        assert ds["gradient_clipping"] == clip, path
        if os.path.basename(path).startswith("llama3_"):
            continue  # sized for their presets: the table's notes, test_shipped_ds_config_matches_the_documented_table
        stages = ds.get("pipeline", {}).get("stages", 1)
        expected = (pipe_micro, per_stage * stages) if stages > 1 else (micro, accum)
        assert (ds["train_micro_batch_size_per_gpu"], ds.get("gradient_accumulation_steps", 1)) == expected, path


def heading_anchors(lines: list[str]) -> set[str]:
    """The #anchors GitHub gives the headings of a markdown file (fenced code blocks left out): inline markup
    dropped, lowercased, punctuation removed, spaces as hyphens, a repeated one suffixed -1, -2, ..."""
    anchors, fenced = set(), False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        heading = re.match(r"#{1,6} (.+)", line)
        if heading and not fenced:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)).replace("`", "").strip().lower()
            slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
            anchor, n = slug, 0
            while anchor in anchors:
                n += 1
                anchor = f"{slug}-{n}"
            anchors.add(anchor)
    return anchors


def relative_links(lines: list[str]) -> list[tuple[int, str]]:
    """(line number, target) of every markdown link and image outside code (fenced blocks, `spans`) that
    points into the repository: no scheme, no mailto."""
    links, fenced = [], False
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):
                links.append((number, target))
    return links


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: os.path.relpath(p, REPO_ROOT))
def test_every_relative_link_resolves(doc):
    """Each relative link names a file or folder that exists, and each #anchor a heading of its target."""
    broken = []
    for number, target in relative_links(read_lines(doc)):
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
        where = f"{os.path.relpath(doc, REPO_ROOT)}:{number}: {target}"
        if not os.path.exists(full):
            broken.append(f"{where}: no such file")
        elif anchor and anchor not in heading_anchors(read_lines(full) if full.endswith(".md") else []):
            broken.append(f"{where}: no heading with that anchor")
    assert not broken, "\n".join(broken)


def test_heading_anchors_are_the_ones_github_makes():
    assert heading_anchors(["# Shipped ds_configs", "## The Llama's throughput beside the GPT's", "```",
                            "# not a heading", "```", "### PBS / PBS Pro (e.g. ALCF's Polaris)",
                            "## Results", "## Results", "## `train.init_from` and [links](x.md)"]) == {
        "shipped-ds_configs", "the-llamas-throughput-beside-the-gpts", "pbs--pbs-pro-eg-alcfs-polaris",
        "results", "results-1", "traininit_from-and-links"}


def test_the_code_map_names_every_source_file():
    """docs/code.md says where each job lives: every Python file of the library, the commands and the benchmarks
    (the tests have their map in docs/testing.md) is named there, by its path or, in a folder's line, its name."""
    import subprocess
    code_map = open(os.path.join(REPO_ROOT, "docs", "code.md")).read()
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO_ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    sources = [p for p in tracked if not p.startswith("tests/") and os.path.basename(p) != "__init__.py"]
    assert len(sources) > 100, sources
    assert [p for p in sources if p not in code_map and os.path.basename(p) not in code_map] == []


def test_the_testing_doc_names_every_test_file():
    testing = open(os.path.join(REPO_ROOT, "docs", "testing.md")).read()
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO_ROOT, "tests", "test_*.py")))
    assert len(files) > 70, files
    assert [f for f in files if f not in testing] == []
