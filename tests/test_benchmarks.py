"""The benchmarks: the memory theory is the ZeRO paper's arithmetic, and the throughput comparison trains the
same model on the same data with the same optimizer in the DeepSpeed engine and in the plain loop. Every
benchmark starts (--help), and the cheap ones run once at a tiny size (their refusals of bad input:
tests/test_benchmark_refusals.py)."""
import glob
import json
import os
import subprocess
import sys

import pytest

from benchmarks.memory import theory_bytes
from benchmarks.tensor_parallel import theory as tensor_parallel_theory
from harness import REPO, TINY, benchmark, run
from training.config import load_run_config

# Every benchmark with a main: nothing else runs them, so an import that moves away breaks one unseen.
SCRIPTS = ["checkpoint_stall.py", "cpu_attention.py", "data.py", "documents.py", "finetune.py", "generation.py",
           "llama.py", "lora_serving.py", "memory.py", "moe.py", "pipeline.py", "preference.py", "quality.py",
           "quickstart_race.py", "reward_model.py", "rl.py", "sequence_parallel.py", "serving.py",
           "structured_outputs.py", "sweep.py",
           "tensor_parallel.py", "throughput.py", "record.sh", "wheelhouse.sh"]

PSI, RANKS, SUB_GROUP = 1_000_000, 2, 100_000


@pytest.mark.parametrize("name, total, step_fp32_grads", [
    ("zero0", (2 + 2 + 12) * PSI, 4 * PSI),
    ("zero1", (2 + 2) * PSI + 12 * PSI / RANKS, 4 * PSI / RANKS),
    ("zero2", 2 * PSI + (2 + 12) * PSI / RANKS, 4 * PSI / RANKS),
    ("zero3", (2 + 2 + 12) * PSI / RANKS, 4 * SUB_GROUP),  # ZeRO-3 converts one sub-group at a time
    ("zero2_offload", 2 * PSI + (2 + 12 + 4 + 2) * PSI / RANKS, 0),  # the fp32 gradient partition is kept
])
def test_memory_theory_mixed_precision(name, total, step_fp32_grads):
    theory = theory_bytes(PSI, name, RANKS, mixed=True, sub_group_size=SUB_GROUP)
    assert theory["total"] == total
    assert theory["step_fp32_grads"] == step_fp32_grads


def test_memory_theory_fp32():
    zero0 = theory_bytes(PSI, "zero0", RANKS, mixed=False, sub_group_size=SUB_GROUP)
    zero3 = theory_bytes(PSI, "zero3", RANKS, mixed=False, sub_group_size=SUB_GROUP)
    assert (zero0["weights"], zero0["grads"], zero0["optimizer"]) == (4 * PSI, 4 * PSI, 8 * PSI)
    assert zero3["total"] == 16 * PSI / RANKS
    assert zero0["step_fp32_grads"] == zero3["step_fp32_grads"] == 0


def test_tensor_parallel_theory_is_megatrons_arithmetic():
    """The baby GPT (6 layers, d 384, context 256, 128 padded vocabulary) at tp 2: every rank keeps the positions
    and, per layer, two LayerNorms and two row-parallel biases whole, and half of everything else; per micro-batch
    of 8 sequences, 4 all-reduces of b x s x d per layer, 2 more around the vocabulary, 3 per-token fp32 ones."""
    cfg = load_run_config("configs/baby_gpt.yaml", ["model.vocab_size=65"]).model
    whole, d, tokens = 10_795_008, 384, 8 * 256
    replicated = 256 * d + 6 * (2 * d + 2 * d + d + d) + 2 * d
    tp1, tp2 = tensor_parallel_theory(cfg, 1, 8, 4), tensor_parallel_theory(cfg, 2, 8, 4)
    assert (tp1["params"], tp2["params"]) == (whole, replicated + (whole - replicated) // 2)
    assert (tp1["states"], tp2["states"]) == (12 * whole, 12 * tp2["params"])
    assert (tp1["tp_bytes"], tp2["tp_bytes"]) == (0, (4 * 6 + 2) * tokens * d * 4 + 3 * tokens * 4)
    assert tp2["ring_bytes"] == tp2["tp_bytes"]  # 2 (t - 1) / t = 1 at t = 2


def test_throughput_reference_trains_the_same_model(char_data, tmp_path):
    report = tmp_path / "throughput.json"
    run([sys.executable, "benchmarks/throughput.py", "--config", "configs/quickstart.yaml", "--ds_config",
         "ds_configs/zero1.json", "--steps", "4", "--warmup", "1", "--chunk", "2", "--profile", "1", "--json",
         str(report), f"data.dir={char_data}"])
    written = json.loads(report.read_text())
    results = {r["precision"]: r for r in written["results"]}
    for result in results.values():  # both loops profiled, each step's matmuls among its top operators
        for ops in result["profile"].values():
            assert "aten::mm" in [o["op"] for o in ops] and sum(o["share"] for o in ops) <= 1 + 1e-9
    assert set(results) == {"bf16", "fp32"}
    fp32, bf16 = results["fp32"], results["bf16"]
    # ZeRO-1 at one process is the plain loop's arithmetic (in bf16 DeepSpeed's bf16 optimizer: fp32 masters made
    # from the bf16 weights, fp32 gradients, the step on the device, training/steps.py) but for the order its flat
    # partition sums the gradient norm in: the clipped gradients differ in their last bits, which round a few bf16
    # weights apart once the steps are large (masters from the fp32 initialization end 1e-2 apart)
    assert bf16["deepspeed"]["final_loss"] == pytest.approx(bf16["reference"]["final_loss"], rel=1e-5)
    assert fp32["deepspeed"]["final_loss"] == pytest.approx(fp32["reference"]["final_loss"], rel=1e-6)
    for result in results.values():
        # MFU is against the peak the script measured on this machine, for this precision
        assert result["peak_tflops"] > 0
        assert result["deepspeed"]["mfu"] == pytest.approx(
            result["deepspeed"]["tokens_per_s"] * written["flops_per_token"] / (result["peak_tflops"] * 1e12))


def test_a_cpu_profile_counts_custom_operators_and_no_wrappers():
    """A custom operator's Python work between the aten operators it calls is time a step spends: the table
    counts it, and not the autograd engine's nodes, whose self time is their operators'."""
    import torch

    from benchmarks.turns import CPU_OPERATORS, profiled
    from model.cpu_attention import causal_attention_forward

    q, k, v = (torch.randn(2, 2, 64, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    ops = profiled({"attention": lambda step: causal_attention_forward(q, k, v)[0].sum().backward()},
                   first=1, steps=1, top=100)["attention"]
    names = [o["op"] for o in ops]
    assert {"megalite::causal_attention", "megalite::causal_attention_backward", "aten::bmm"} <= set(names)
    assert all(name.startswith(CPU_OPERATORS) for name in names)


def test_checkpoint_stall_times_both_saves(char_data, tmp_path):
    """One save of each kind of the tiny quickstart model: both timed, the background one written, the folder
    of checkpoints removed."""
    report, work = tmp_path / "stall.json", tmp_path / "work"
    run([sys.executable, "benchmarks/checkpoint_stall.py", "--presets", "quickstart", "--steps", "1", "--warmup", "0",
         "--saves", "1", "--block_size", "16", "--micro_batch", "1", "--work_dir", str(work), "--json", str(report),
         f"data.dir={char_data}"])
    result = json.loads(report.read_text())["results"][0]
    assert result["preset"] == "quickstart" and result["checkpoint_bytes"] > 4 * result["parameters"]
    assert result["stall_s"]["synchronous"] > 0 and result["background_copy_s"] > 0  # the background stall: the copy
    assert result["background_written_s"] >= result["background_copy_s"]           # give or take the steps' noise
    assert os.listdir(work) == []


def test_llama_throughput_builds_and_times_both_models(char_data, tmp_path):
    """The mode whose import once moved away unnoticed: one timed step each of a tiny GPT and Llama."""
    out = tmp_path / "out"
    run([sys.executable, "benchmarks/llama.py", "throughput", "--steps", "1", "--warmup", "0", "--chunk", "1",
         "--out_dir", str(out), f"data.dir={char_data}", *TINY])
    written = json.loads((out / "throughput.json").read_text())
    assert written["llama"]["parameters"] != written["gpt"]["parameters"]  # two models, not one twice
    assert written["gpt"]["tokens_per_s"] > 0 and written["llama"]["tokens_per_s"] > 0 and written["mfu_ratio"] > 0


def test_document_masking_cost_counts_the_kept_masks_as_the_memory_plan_does(shakespeare_path, tmp_path):
    """One timed step of a tiny masked and unmasked Llama; the masks its forward pass keeps are the memory plan's
    count of them, byte for byte, and all it keeps beyond the unmasked pass within 5% of the plan's count (the
    unmasked pass keeps one context x head_dim RoPE table a layer, which the per-token ones replace)."""
    run([sys.executable, "benchmarks/documents.py", "cost", "--text", shakespeare_path, "--work_dir", str(tmp_path),
         "--contexts", "64", "--tokens", "1024", "--steps", "1", "--warmup", "0", "--chunk", "1", "model.n_layer=2",
         "model.n_embd=96"])
    measured = json.loads((tmp_path / "cost.json").read_text())["64"]
    layers, tokens, context, fp32 = 2, 1024, 64, 4
    assert measured["mask_bytes_measured"] == layers * tokens * context * fp32
    rope = layers * tokens * 2 * (96 // 6) * fp32  # cos and sin at each token's position
    assert measured["added_bytes_planned"] == measured["mask_bytes_measured"] + rope
    assert measured["saved_bytes_added"] == pytest.approx(measured["added_bytes_planned"], rel=0.05)
    assert measured["masked_tokens_per_s"] > 0 and measured["unmasked_tokens_per_s"] > 0


def test_generation_times_the_cache_the_window_and_transformers(tmp_path):
    report = tmp_path / "generation.json"
    run([sys.executable, "benchmarks/generation.py", "--presets", "quickstart", "--prompt", "8", "--new", "4",
         "--repeats", "1", "--json", str(report)])
    result = json.loads(report.read_text())["results"]["quickstart"]
    assert (result["prompt"], result["new"], result["block_size"]) == (8, 4, 64)
    for way in ("cache", "full window", "transformers"):
        assert result[way]["first_token_s"] > 0 and result[way]["decode_tokens_per_s"] > 0


def test_structured_outputs_times_free_and_schema_answers(tmp_path):
    report = tmp_path / "structured.json"
    run([sys.executable, "benchmarks/structured_outputs.py", "--presets", "quickstart", "--clients", "2", "--prompt",
         "8", "--new", "4", "--rounds", "1", "--json", str(report)])
    result = json.loads(report.read_text())["results"]["quickstart"]
    assert result["vocab_size"] == 257  # a byte-level BPE asked for quickstart's 65 ids has its 256 bytes and EOT
    assert result["free"]["grammar_ms_per_token"] == 0 < result["JSON schema"]["grammar_ms_per_token"]
    assert result["free"]["decode_tokens_per_s"] > 0 and result["JSON schema"]["decode_tokens_per_s"] > 0


def test_lora_serving_times_no_adapter_one_and_each_its_own(tmp_path):
    report = tmp_path / "lora.json"
    run([sys.executable, "benchmarks/lora_serving.py", "--presets", "quickstart", "--clients", "2", "--prompt", "8",
         "--new", "2", "--rank", "2", "--rounds", "1", "--json", str(report)])
    result = json.loads(report.read_text())["results"]["quickstart"]
    # rank 2 on the 4 blocks' q|k|v, attention output, MLP in and out maps: r x (in + out) each
    assert result["adapter_parameters"] == 4 * 2 * ((128 + 384) + (128 + 128) + (128 + 512) + (512 + 128))
    for way in ("none", "one adapter", "own adapters"):
        assert result[way]["prefill_tokens_per_s"] > 0 and result[way]["decode_tokens_per_s"] > 0


@pytest.mark.launch  # a server process
def test_serving_times_the_server_and_its_scheduler_in_process(tmp_path, shakespeare_path):
    report = tmp_path / "serving.json"
    run([sys.executable, "benchmarks/serving.py", "--presets", "quickstart", "--clients", "3", "--prompt", "8",
         "--new", "4", "--dtypes", "fp32", "--text", shakespeare_path, "--json", str(report)])
    result = json.loads(report.read_text())["results"]["quickstart"]
    assert (result["prompt"], result["new"], result["block_size"], result["vocab_size"]) == (8, 4, 64, 65)
    engines = result["fp32"]
    assert set(engines) == {"megalite", "in process"}
    for figures in engines.values():
        assert [len(figures[s]["answers"]) for s in ("new", "again", "together")] == [4, 4, 3]
        assert all(figures[s]["tokens_per_s"] > 0 and figures[s]["first_token_s"] > 0 for s in ("new", "again"))
    assert engines["megalite"]["together"]["answers"] == engines["in process"]["together"]["answers"]  # greedy


def test_cpu_attention_times_both_kernels_and_their_gradients(tmp_path):
    report = tmp_path / "cpu_attention.json"
    run([sys.executable, "benchmarks/cpu_attention.py", "--shapes", "2x2x32x16", "--rounds", "1", "--steps", "1",
         "--json", str(report)])
    result = json.loads(report.read_text())["results"]["2x2x32x16"]
    for kernel in ("flash", "matmul backward"):
        assert result[kernel]["median_ms"] > 0 and 0 < result[kernel]["gradient_error"] < 0.01


def test_the_list_covers_every_benchmark():
    mains = {os.path.basename(path) for path in glob.glob(os.path.join(REPO, "benchmarks", "*.py"))
             if '__name__ == "__main__"' in open(path).read()}
    shell = {os.path.basename(path) for path in glob.glob(os.path.join(REPO, "benchmarks", "*.sh"))}
    assert mains | shell == set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_starts(script):
    """--help runs what a script runs before its arguments are read: its imports, for the Python ones."""
    proc = benchmark(script, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout if script.endswith(".py") else "bash benchmarks/" + script in proc.stdout


def test_memory_measures_one_stage(char_data, tmp_path):
    """The launcher, a worker rank and the table, at the smallest size: the worker's imports run only there."""
    report = tmp_path / "memory.json"
    run([sys.executable, "benchmarks/memory.py", "--config", "configs/quickstart.yaml", "--nprocs", "1", "--stages",
         "zero0", "--steps", "1", "--json", str(report), f"data.dir={char_data}", *TINY,
         "ds.train_micro_batch_size_per_gpu=2"], env={"OMP_NUM_THREADS": "1"})
    zero0 = json.loads(report.read_text())["results"]["zero0"]
    assert len(zero0["ranks"]) == 1 and zero0["ranks"][0]["peak"] > 0 and zero0["theory"]["total"] > 0


def test_the_sweep_runs_train_py_per_row_and_holds_the_plan_beside_it(char_data, tmp_path):
    """Each micro-batch at the same global batch, then the levers at the faster one (an environment lever in its
    row's process alone: an accelerator DeepSpeed has not, which ends that row); each row's figures are its
    run's own metrics.jsonl (the intervals after the first); a plan over --gpu_gb is marked, and a run that ended
    out of memory is told from one that failed otherwise."""
    report = tmp_path / "sweep.json"
    proc = benchmark("sweep.py", "--config", "configs/quickstart.yaml", "--global_batch", "8", "--micro", "4", "8",
                     "--steps", "4", "--log_interval", "2", "--levers", "ds_config=ds_configs/zero0.json",
                     "env:DS_ACCELERATOR=none_such",
                     "--gpu_gb", "0.0001", "--work_dir", str(tmp_path / "work"), "--json", str(report),
                     f"data.dir={char_data}", *TINY)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(report.read_text())
    rows = result["rows"]
    assert [(r["micro"], r["lever"], r["status"]) for r in rows[:2]] == [(4, None, "ok"), (8, None, "ok")]
    faster = max(rows[:2], key=lambda r: r["tokens_per_s"])["micro"]
    assert (rows[2]["micro"], rows[2]["lever"], rows[2]["status"]) == (faster, "ds_config=ds_configs/zero0.json", "ok")
    assert (rows[3]["micro"], rows[3]["lever"], rows[3]["status"]) == (faster, "env:DS_ACCELERATOR=none_such", "failed")
    assert 'Value "none_such" is not supported' in rows[3]["error"][0]
    logged = [json.loads(line) for line in (tmp_path / "work" / "micro4" / "metrics.jsonl").read_text().splitlines()]
    intervals = [r for r in logged if "tokens_per_s" in r][1:]
    assert rows[0]["tokens_per_s"] == sum(r["tokens_per_s"] for r in intervals) / len(intervals)
    assert not any(r["plan_fits"] for r in rows) and result["plan_largest_fitting_micro"] is None
    assert result["largest_micro_that_ran"] == 8
    assert "largest micro-batch the plan fits: None; largest that ran: 8" in proc.stdout
    from benchmarks.sweep import measured
    oom = subprocess.CompletedProcess([], 1, "", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")
    assert measured(oom, str(tmp_path))["status"] == "out of memory"
    assert measured(subprocess.CompletedProcess([], 2, "", "error: x"), str(tmp_path))["status"] == "failed"
    over = subprocess.CompletedProcess([], 2, "", "error: the memory plan needs 53.8 GB a rank (...)")
    assert measured(over, str(tmp_path))["status"] == "over the plan"


def test_quality_trains_and_judges_the_val_loss(char_data, tmp_path):
    out = tmp_path / "quality"
    proc = benchmark("quality.py", "--target", "100", "--out_dir", str(out), f"data.dir={char_data}", *TINY,
                     "train.max_steps=2", "train.eval_windows=2", "sample.max_new_tokens=1", "ds.bf16.enabled=false")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout
    assert json.loads((out / "quality.json").read_text())["step"] == 2


def test_data_prepares_and_loads_at_the_smallest_size(tmp_path):
    report = tmp_path / "data.json"
    run([sys.executable, "benchmarks/data.py", "--small_mb", "1", "--large_mb", "1", "--bpe_size", "257",
         "--work_dir", str(tmp_path / "work"), "--json", str(report)])
    written = json.loads(report.read_text())
    assert [r["workers"] for r in written["prepare"]] == [1, 2, 2]
    assert written["batch"]["mean_ms"] > 0
    assert os.listdir(tmp_path / "work") == []  # the corpora are deleted after


# (script, arguments, the message's start). {file} is a file where a folder or a file's folder is wanted,
# {data} a prepared dataset, {tmp} a fresh folder, {repo} the repository.
def test_the_gpu_figures_set_a_throughput_row_beside_the_plan_of_its_own_settings(tmp_path, capsys):
    """record.sh's MEMORY=0 leaves an earlier run's memory probe in the results: a row shows the plan's figures only
    where the probe ran at the row's settings (train.compile aside)."""
    from benchmarks.gpu_figures import main

    settings = ["data.tokenizer=char", "ds.train_micro_batch_size_per_gpu=64"]
    row = {"precision": "bf16", "tokens_per_step": 65536, "ratio": 0.95, "peak_tflops": 989.0, "peak_source": "sheet",
           "attention": "cudnn", "deepspeed": {"tokens_per_s": 400000.0, "mfu": 0.4},
           "reference": {"tokens_per_s": 420000.0}}
    (tmp_path / "throughput_gpt2_124m_zero1_compiled.json").write_text(json.dumps(
        {"date": "2026-11-28", "device": "GPU", "overrides": [*settings, "train.compile=true"], "results": [row]}))
    plan = {"overrides": settings, "results": {"zero1.json": {"measured": 3 * 2**30, "plan": 2**31}}}
    for probed, shown in ((settings, True), ([*settings, "train.compile=false"], True), (settings[:1], False)):
        (tmp_path / "memory_plan_gpt2_124m_zero1.json").write_text(json.dumps({**plan, "overrides": probed}))
        main([str(tmp_path), "gpt2_124m"])
        line = capsys.readouterr().out.splitlines()[-1]
        assert "| 65,536 | bf16 | yes | cudnn | 400,000 | 420,000 | 0.950 | 40.0% |" in line
        assert ("| 3.00 GiB | 2.00 GiB |" in line) == shown, line
