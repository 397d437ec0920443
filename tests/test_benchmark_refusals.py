"""Each benchmark refuses bad input at start (a setting, a path, a file, its environment) with one line and exit 2,
no traceback and nothing written; a tool it runs that refuses ends it the same way."""
import os
import runpy
import subprocess
import sys

import pytest

from harness import REPO, benchmark

BAD_INPUTS = [
    ("throughput.py", ["--config", "nope.yaml"], "run config nope.yaml does not exist"),
    ("throughput.py", ["--ds_config", "nope.json"], "ds_config nope.json does not exist"),
    ("throughput.py", ["data.dir=/nonexistent"], "no prepared dataset in /nonexistent"),
    ("throughput.py", ["--json", "{file}/out.json"], "--json file {file}/out.json cannot be created: {file} is a file"),
    ("throughput.py", ["--steps", "0"], "--steps=0: must be >= 1; fix: set --steps to 1 or more"),
    ("throughput.py", ["--chunk", "0"], "--chunk=0: must be >= 1"),
    ("throughput.py", ["--warmup", "-1"], "--warmup=-1: must be >= 0"),
    ("llama.py", ["throughput", "--steps", "0"], "--steps=0: must be >= 1"),
    ("llama.py", ["throughput", "--out_dir", "{repo}/configs"], "--out_dir {repo}/configs already exists and would "
                                                                 "be overwritten"),
    ("llama.py", ["quality", "--out_dir", "{tmp}/q", "data.dir=/nonexistent"], "no prepared dataset in /nonexistent"),
    ("llama.py", ["throughput", "--out_dir", "{tmp}/t", "model.n_kv_head=4"], "model.n_kv_head=4: must divide "
                                                                              "model.n_head=6"),
    ("documents.py", ["cost", "--steps", "0"], "--steps=0: must be >= 1"),
    ("documents.py", ["cost", "--contexts", "256", "0"], "--contexts=0: must be >= 1"),
    ("documents.py", ["quality", "--text", "/nonexistent.txt"], "--text /nonexistent.txt does not exist"),
    ("documents.py", ["cost", "--work_dir", "{file}"], "--work_dir {file} is a file, not a folder"),
    ("documents.py", ["cost", "--work_dir", "{tmp}/w", "model.n_kv_head=4"], "model.n_kv_head=4: must divide "
                                                                              "model.n_head=6"),
    ("finetune.py", ["--steps", "0"], "--steps=0: must be >= 1"),
    ("finetune.py", ["--test", "0"], "--test=0: must be >= 1"),
    ("finetune.py", ["--work_dir", "{file}"], "--work_dir {file} is a file, not a folder"),
    ("preference.py", ["--init_from", "{tmp}", "--sft_steps", "0"], "--sft_steps=0: must be >= 1"),
    ("preference.py", ["--init_from", "{tmp}"], "--init_from {tmp} holds no export (config.json); fix: export the "
                                                "quickstart Llama"),
    ("reward_model.py", ["--init_from", "{tmp}", "--steps", "0"], "--steps=0: must be >= 1"),
    ("reward_model.py", ["--init_from", "{tmp}"], "--init_from {tmp} holds no export (config.json); fix: export the "
                                                  "quickstart Llama"),
    ("rl.py", ["--init_from", "{tmp}", "--sft_steps", "0"], "--sft_steps=0: must be >= 1"),
    ("rl.py", ["--init_from", "{tmp}"], "--init_from {tmp} holds no export (config.json); fix: export the quickstart "
                                        "Llama"),
    ("memory.py", ["--nprocs", "0"], "--nprocs=0: must be >= 1"),
    ("memory.py", ["--steps", "0"], "--steps=0: must be >= 1"),
    ("memory.py", ["--json", "{file}/m.json"], "--json file {file}/m.json cannot be created"),
    ("memory.py", ["--config", "nope.yaml"], "run config {repo}/nope.yaml does not exist"),
    ("memory.py", ["--config", "configs/quickstart.yaml", "data.dir={data}", "ds.gradient_accumulation_steps=2"],
     "ds_configs/zero0.json gives 2 micro-batches per step at --nprocs 2: the memory benchmark measures one"),
    ("data.py", ["--small_mb", "0.5"], "--small_mb=0.5: must be >= 1"),
    ("data.py", ["--small_mb", "2", "--large_mb", "1"], "--large_mb=1.0: must be >= 2.0"),
    ("data.py", ["--bpe_size", "256"], "--bpe_size=256: must be >= 257"),
    ("data.py", ["--work_dir", "{file}"], "--work_dir {file} is a file, not a folder"),
    ("data.py", ["--json", "{file}/d.json"], "--json file {file}/d.json cannot be created"),
    ("pipeline.py", ["--stages", "1"], "--stages=1: must be >= 2"),
    ("pipeline.py", ["--micro_batches", "2", "0"], "--micro_batches=0: must be >= 1"),
    ("pipeline.py", ["--micro_batch", "0"], "--micro_batch=0: must be >= 1"),
    ("pipeline.py", ["--steps", "1"], "--steps=1: must be >= 2"),
    ("pipeline.py", ["--config", "nope.yaml"], "run config {repo}/nope.yaml does not exist"),
    ("pipeline.py", ["data.dir=/nonexistent"], "no prepared dataset in /nonexistent"),
    ("pipeline.py", ["--work_dir", "{file}", "data.dir={data}"], "--work_dir {file} is a file, not a folder"),
    ("sequence_parallel.py", ["--steps", "1"], "--steps=1: must be >= 2"),
    ("sequence_parallel.py", ["--micro_batch", "3"], "--micro_batch=3: must be even"),
    ("sequence_parallel.py", ["model.n_kv_head=3", "data.dir={data}"], "tensor x sequence-parallel degree 1 x 2 "
                                                                      "does not divide the key/value heads "
                                                                      "(model.n_kv_head) = 3"),
    ("tensor_parallel.py", ["--steps", "1"], "--steps=1: must be >= 2"),
    ("tensor_parallel.py", ["--micro_batch", "3"], "--micro_batch=3: must be even"),
    ("tensor_parallel.py", ["--link_gb_s", "0"], "--link_gb_s=0.0: must be > 0"),
    ("tensor_parallel.py", ["--config", "nope.yaml"], "run config {repo}/nope.yaml does not exist"),
    ("tensor_parallel.py", ["data.dir=/nonexistent"], "no prepared dataset in /nonexistent"),
    ("tensor_parallel.py", ["--work_dir", "{file}", "data.dir={data}"], "--work_dir {file} is a file, not a folder"),
    ("quality.py", ["--ds_config", "nope.json"], "ds_config {repo}/nope.json does not exist"),
    ("moe.py", ["--steps", "0"], "--steps=0: must be >= 1"),
    ("moe.py", ["--out_dir", "{tmp}/m", "data.dir={data}", "model.experts_per_token=9"],
     "model.experts_per_token=9: must be at most model.n_experts=4"),
    ("quality.py", ["--out_dir", "{repo}/configs"], "--out_dir {repo}/configs already exists"),
    ("quality.py", ["--out_dir", "{tmp}/q", "data.dir=/nonexistent"], "no prepared dataset in /nonexistent"),
    ("structured_outputs.py", ["--clients", "0"], "--clients=0: must be >= 1"),
    ("structured_outputs.py", ["--text", "/nonexistent.txt"], "the text (--text) /nonexistent.txt does not exist"),
    ("lora_serving.py", ["--rank", "0"], "--rank=0: must be >= 1"),
    ("lora_serving.py", ["--presets", "quickstart", "--prompt", "40", "--new", "30"], "--prompt 40 + --new 30 > "
                                                                                    "quickstart's context of 64"),
    ("serving.py", ["--clients", "0"], "--clients=0: must be >= 1"),
    ("serving.py", ["--rounds", "0"], "--rounds=0: must be >= 1"),
    ("serving.py", ["--dtypes", "fp32,fp8"], "--dtypes fp32,fp8: each must be one of fp32, bf16"),
    ("serving.py", ["--vllm", "/nonexistent/python"], "--vllm /nonexistent/python does not exist"),
    ("serving.py", ["--vllm", sys.executable], f"--vllm {sys.executable}: no vLLM there to serve with"),
    ("serving.py", ["--presets", "quickstart", "--prompt", "40", "--new", "30"], "--prompt 40 + --new 30 > "
                                                                                  "quickstart's context of 64"),
    ("serving.py", ["--text", "/nonexistent.txt"], "the text (--text) /nonexistent.txt does not exist"),
    ("checkpoint_stall.py", ["--presets", "nope"], "--presets nope: configs/nope.yaml does not exist"),
    ("checkpoint_stall.py", ["--saves", "0"], "--saves=0: must be >= 1"),
    ("checkpoint_stall.py", ["--work_dir", "{file}"], "--work_dir {file} is a file, not a folder"),
    ("quickstart_race.py", ["--repeats", "0"], "--repeats=0: must be >= 1"),
    ("sweep.py", ["--config", "configs/quickstart.yaml", "--global_batch", "12", "data.dir={data}", "--micro", "5"],
     "--micro 5 does not divide --global_batch 12: pick divisors"),
    ("sweep.py", ["--config", "configs/quickstart.yaml", "--global_batch", "12", "--steps", "5", "data.dir={data}"],
     "--steps 5: needs two logged intervals of --log_interval 5; fix: raise --steps"),
    ("sweep.py", ["--config", "configs/quickstart.yaml", "--global_batch", "12", "data.dir={data}", "--levers",
                  "env:MAX AUTOTUNE=1"], "--levers env:MAX AUTOTUNE=1: an environment lever is env:NAME=VALUE; fix: "
                                         "e.g. env:TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1"),
    ("cpu_attention.py", ["--shapes", "12x6x256"], "--shapes 12x6x256: must be batch x heads x context x head_dim"),
    ("cpu_attention.py", ["--rounds", "0"], "--rounds=0: must be >= 1"),
    ("cpu_attention.py", ["--json", "{file}/a.json"], "--json file {file}/a.json cannot be created"),
    ("record.sh", ["nope"], "preset configs/nope.yaml does not exist"),
    ("wheelhouse.sh", ["{file}"], "wheel folder {file} is a file, not a folder"),
    ("wheelhouse.sh", ["{tmp}/wheels", "312"], "PYTHON_VERSION 312 is not of the form 3.N"),
]


@pytest.mark.parametrize("script, args, message", BAD_INPUTS,
                         ids=[f"{row[0]}:{' '.join(row[1])[-30:]}" for row in BAD_INPUTS])
def test_bad_input_is_refused_at_start(script, args, message, char_data, tmp_path, monkeypatch, capsys):
    """The Python benchmarks run in this process (their imports are paid once): as `python benchmarks/X.py`
    would, through the `__main__` block; any exception but the SystemExit fails the test with its traceback."""
    names = {"file": os.path.join(REPO, "README.md"), "data": char_data, "tmp": str(tmp_path), "repo": REPO}
    args, message = [a.format(**names) for a in args], message.format(**names)
    if script.endswith(".sh"):
        proc = benchmark(script, *args)
        code, stderr = proc.returncode, proc.stderr
    else:
        monkeypatch.setattr(sys, "argv", [script, *args])
        monkeypatch.setattr(sys, "path", list(sys.path))  # each script puts the repo on it again
        with pytest.raises(SystemExit) as ended:
            runpy.run_path(os.path.join(REPO, "benchmarks", script), run_name="__main__")
        code, stderr = ended.value.code, capsys.readouterr().err
    assert code == 2, stderr
    assert f"error: {message}" in stderr
    assert "Traceback" not in stderr
    assert not os.listdir(tmp_path)  # refused before anything is written


@pytest.mark.parametrize("script, env, message", [
    ("data.py", {"SHAKESPEARE_TXT": "/nonexistent.txt"}, "the text /nonexistent.txt does not exist"),
    ("record.sh", {"DS_CONFIG": "ds_configs/pipe2.json"}, "DS_CONFIG=ds_configs/pipe2.json: the memory benchmark "
                                                          "measures ds_configs/<name>.json for the names in"),
])
def test_bad_environment_is_refused_at_start(script, env, message):
    proc = benchmark(script, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"error: {message}" in proc.stderr and "Traceback" not in proc.stderr


def test_a_tool_that_refuses_its_input_ends_the_benchmark_the_same_way():
    """What the checks at start cannot see, train.py or the launcher refuses (exit 2, its line on stderr): the
    benchmark ends with that exit code and no traceback of its own; any other failure stays one."""
    from benchmarks.report import run_tool
    with pytest.raises(SystemExit) as ended:
        run_tool([sys.executable, "-c", "import sys; sys.exit(2)"])
    assert ended.value.code == 2
    with pytest.raises(subprocess.CalledProcessError):
        run_tool([sys.executable, "-c", "import sys; sys.exit(1)"])
