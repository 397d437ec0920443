"""Shared fixtures: the real Shakespeare text and its prepared dataset, the run and the input files that the
tools' tables damage, and the headless browser the chat page's tests drive. How tests start runs of train.py and
read them is tests/harness.py."""
import gzip
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from harness import FP32, REPO, STARTED_DEVICES, TINY, run, train_py
from moe_runs import moe_runs  # noqa: F401 (a fixture, shared by two modules)
from refusals import EXPORT, TAG


def pytest_configure(config):
    # The suite pins itself to the CPU, on a GPU machine too (its subprocesses inherit this): its equalities
    # (1e-5, bitwise) are those of CPU kernels over gloo. GPU checks are benchmarks/record.sh's. What it was started
    # with is kept for the GPU tier's children, in the environment that xdist's workers inherit from this process.
    os.environ.setdefault(STARTED_DEVICES, json.dumps(os.environ.get("CUDA_VISIBLE_DEVICES")))
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["DS_ACCELERATOR"] = "cpu"
    # An xdist worker's share of the cores, for torch here and in what it starts: workers that each take every
    # core spin against each other's threads.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // workers)))


def pytest_collection_modifyitems(config, items):
    # The files that start processes first: xdist hands out files in this order (pyproject.toml), and one of them
    # handed out last, minutes long, would leave the other workers idle until it ends.
    starts = {item.path for item in items if item.get_closest_marker("launch")}
    items.sort(key=lambda item: item.path not in starts)


def pytest_xdist_auto_num_workers(config) -> int:
    """The workers of `-n auto` (pyproject.toml): one a core, at most one per 4 GiB of memory (the heaviest test,
    the memory plan's 124M run, used 3.2 GiB); none for a run of one file, whose tests one worker would run anyway
    (`--dist loadfile` keeps a module's tests, and its fixtures, in one process)."""
    files = {arg.split("::")[0] for arg in config.args}
    if len(files) == 1 and os.path.isfile(files.pop()):
        return 0
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    workers = min(len(os.sched_getaffinity(0)), memory // (4 << 30))
    return workers if workers > 1 else 0


@pytest.fixture(scope="session")
def shakespeare_path() -> str:
    """$SHAKESPEARE_TXT, else the shared copy beside the repo (CI), else the quickstart's download."""
    path = os.environ.get("SHAKESPEARE_TXT") or next(
        (p for p in (os.path.join(REPO, "..", "shared", "data", "tinyshakespeare.txt"),
                     os.path.join(REPO, "data", "shakespeare_char", "input.txt")) if os.path.isfile(p)), "")
    if not os.path.isfile(path):
        pytest.fail("tinyshakespeare not found: set SHAKESPEARE_TXT to its path, or run "
                    "`python -m data.prepare` once to download it")
    return path


@pytest.fixture(scope="session")
def char_data(tmp_path_factory, shakespeare_path) -> str:
    out = str(tmp_path_factory.mktemp("shakespeare_char"))
    run([sys.executable, "-m", "data.prepare", "--tokenizer", "char", "--input", shakespeare_path, "--out_dir", out])
    return out


@pytest.fixture(scope="session")
def speech_data(tmp_path_factory, shakespeare_path) -> str:
    """tinyshakespeare's speeches as separate documents: characters, each speech ended by an end-of-text."""
    out = str(tmp_path_factory.mktemp("speeches"))
    run([sys.executable, "-m", "data.prepare", "--tokenizer", "char", "--split_blank_lines", "--input",
         shakespeare_path, "--out_dir", out])
    return out


@pytest.fixture(scope="session")
def shakespeare_task(tmp_path_factory, shakespeare_path) -> str:
    """The Shakespeare continuation task (python -m data.continuation_task): HellaSwag's JSONL format."""
    out = tmp_path_factory.mktemp("tasks") / "shakespeare.jsonl"
    run([sys.executable, "-m", "data.continuation_task", "--input", shakespeare_path, "--output", str(out)])
    return str(out)


@pytest.fixture(scope="session")
def checkpointed_run(tmp_path_factory, char_data):
    """Two steps of one process (ZeRO-0), a checkpoint after each, and the export of the first."""
    import scripts.export  # imports torch: after pytest_configure has hidden the GPUs

    out = tmp_path_factory.mktemp("tools_run")
    train_py([f"data.dir={char_data}", f"train.out_dir={out}", *TINY, *FP32, "train.max_steps=2",
              "train.save_interval=1", "ds.train_micro_batch_size_per_gpu=2", "sample.max_new_tokens=1"],
             env={"OMP_NUM_THREADS": "1"})
    scripts.export.main(["--out_dir", str(out), "--tag", "step_000001"])
    return out


@pytest.fixture
def paths(checkpointed_run, tmp_path, char_data) -> dict:
    """A fresh copy of `checkpointed_run` to damage, and the names the tables use (tests/refusals.py)."""
    copy = tmp_path / "run"
    shutil.copytree(checkpointed_run, copy)
    return {"tmp": tmp_path, "run": copy, "root": copy / "checkpoints", "tag": copy / TAG, "export": copy / EXPORT,
            "data": char_data}


@pytest.fixture(scope="session")
def inputs(tmp_path_factory) -> Path:
    """Input files for data.prepare that are not what their names say, and a good one."""
    import zstandard  # here, not at the top: the GPU tier collects where only the training dependencies are

    folder = tmp_path_factory.mktemp("bad_inputs")
    records = b"".join(json.dumps({"text": f"document {i} " * 20}).encode() + b"\n" for i in range(2000))
    (folder / "text.txt").write_text("some text\n\nmore text\n")
    (folder / "not_gzip.jsonl.gz").write_bytes(records)
    (folder / "cut.jsonl.gz").write_bytes(gzip.compress(records)[:500])
    (folder / "not_zstd.jsonl.zst").write_bytes(records)
    (folder / "cut.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(records)[:500])
    (folder / "not_parquet.parquet").write_bytes(records)
    (folder / "empty.jsonl").write_bytes(b"")
    (folder / "tokenizer_folder").mkdir()
    return folder


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Debian's headless Chromium driven through its ChromeDriver (Selenium), with no network beyond loopback. Its
    temporary folders in the test's own (Chromium leaves its singleton socket's folder in TMPDIR when it quits)."""
    missing = [name for name, path in [("chromium", "/usr/bin/chromium"), ("chromedriver", "/usr/bin/chromedriver")]
               if not shutil.which(path)]
    try:
        from selenium import webdriver
    except ImportError:
        missing.append("selenium (pip install '.[dev]')")
    if missing:  # CI installs them (.ci/run): there a missing one is a broken machine, not a reason to skip
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(
            f"the chat page test needs {', '.join(missing)}; .ci/run installs chromium and chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"):
        options.add_argument(flag)
    service = webdriver.ChromeService("/usr/bin/chromedriver",
                                      env={**os.environ, "TMPDIR": str(tmp_path_factory.mktemp("chromium"))})
    driver = webdriver.Chrome(options=options, service=service)
    yield driver
    driver.quit()
