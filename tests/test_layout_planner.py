"""The layout planner (training/layout_planner.py, `python -m scripts.memory_plan --plan`): the layouts it
enumerates are those train.py accepts, each row's memory is the memory plan's of its ds_config, the step-time
model is the one its docstring states, the Llama 3 paper's 405B layout is among the feasible ones, and the
command recommends one or says in one line that none fits."""
import dataclasses

import pytest

from model_checks import preset
from ranks import run_tool
from training.layout_planner import Assumptions, Candidate, candidates, plan_layouts, step_seconds
from training.memory_plan import GB, layer_params, plan
from training.metrics import flops_per_token

QUICK = dataclasses.replace(preset("llama_quickstart"), vocab_size=65)  # 4 layers, 4 heads, 2 key/value heads


def test_the_layouts_are_those_train_py_accepts():
    found = list(candidates(QUICK, 8, 8, 64))
    # tensor x sequence degrees divide the 2 key/value heads; pipelines hold a block a stage (4 blocks)
    assert {(c.tp, c.sp) for c in found} == {(1, 1), (1, 2), (2, 1)}
    assert {c.pp for c in found} == {1, 2, 4}
    assert all(c.dp * c.tp * c.sp * c.pp == 8 and c.micro * c.accum * c.dp == 64 for c in found)
    assert all(c.zero == 1 for c in found if c.pp > 1)  # DeepSpeed's pipeline engine: ZeRO 0-1
    assert all(c.accum >= c.pp for c in found)
    assert all(c.tp_sequence == (c.tp > 1) for c in found)  # the sequence split wherever tp > 1 allows it
    assert {(c.zero, c.recompute) for c in found if c.pp == 1 and not c.offload} == {
        (zero, recompute) for zero in (1, 2, 3) for recompute in ("none", "selective", "full")}


def test_a_mixture_of_experts_is_planned_where_train_py_takes_it():
    """Expert-parallel degrees that divide the 4 experts, none under ZeRO-3 (DeepSpeed refuses it), and under
    tensor parallelism only 1 or the tensor degree: check_experts' rules, the one place they live."""
    moe = dataclasses.replace(QUICK, n_experts=4, expert_hidden=192)
    layouts = [r["layout"] for r in plan_layouts(moe, 8, 8, 64, Assumptions())]
    assert {c.ep for c in layouts} == {1, 2, 4}
    assert not any(c.zero == 3 for c in layouts)
    assert all(c.ep in (1, c.tp) for c in layouts if c.tp > 1)
    # ep 4 adds its all-to-alls: 4 a layer and micro-batch, of k routes of each token's 16-bit activations
    spread = next(c for c in layouts if c.ep == 4 and c.tp == 1 and c.pp == 1 and c.sp == 1)
    whole, a = dataclasses.replace(spread, ep=1), Assumptions()
    routes = 2 * spread.micro * moe.block_size * moe.n_embd * moe.experts_per_token
    assert step_seconds(moe, spread, 8, a) - step_seconds(moe, whole, 8, a) == pytest.approx(
        spread.accum * moe.n_layer * 4 * 3 / 4 * routes / (a.intra_gbps * 1e9))


def test_lora_moves_the_adapters_gradients_alone():
    """Under LoRA the data-parallel traffic is the adapters' fp32 gradients and 16-bit updates (ZeRO-1), and ZeRO-3
    still gathers every weight."""
    lora = dataclasses.replace(QUICK, lora_rank=4)
    a = dataclasses.replace(Assumptions(), intra_gbps=1.0)
    params, trained = sum(layer_params(lora)), sum(layer_params(lora, trainable=True))
    for zero, moved in ((1, 2 * 4 * trained + 2 * trained), (3, 4 * trained + 2 * 2 * params)):
        spread = Candidate(tp=1, sp=1, pp=1, dp=8, zero=zero, micro=4, accum=2, recompute="none")
        alone = dataclasses.replace(spread, dp=1)
        compute = step_seconds(lora, alone, 8, a)  # each GPU computes as many tokens; one moves nothing
        assert step_seconds(lora, spread, 8, a) - compute == pytest.approx(7 / 8 * moved / 1e9)


def test_each_row_is_the_memory_plan_of_its_ds_config():
    rows = plan_layouts(QUICK, 8, 8, 64, Assumptions())
    assert len(rows) == len(list(candidates(QUICK, 8, 8, 64)))
    for row in rows:
        assert row["memory"] == plan(QUICK, row["layout"].ds_config(), 8)["total"]
        assert sum(row["parts"].values()) == pytest.approx(row["memory"], rel=1e-12)
        assert min(row["parts"].values()) >= 0
    assert [r["seconds"] for r in rows if r["fits"]] == sorted(r["seconds"] for r in rows if r["fits"])


def test_one_gpu_is_compute_alone_and_the_network_only_slows():
    """On one GPU the step is the FLOPs at the assumed MFU, a third more when recomputed; 2 stages add the
    pipeline's bubble; a slower network never makes a layout faster."""
    one = Candidate(tp=1, sp=1, pp=1, dp=1, zero=1, micro=4, accum=2, recompute="none")
    assumed = Assumptions()
    assert step_seconds(QUICK, one, 8, assumed) == pytest.approx(
        flops_per_token(QUICK) * 8 * QUICK.block_size / (assumed.peak_tflops * 1e12 * assumed.mfu))
    recomputed = dataclasses.replace(one, recompute="full")
    assert step_seconds(QUICK, recomputed, 8, assumed) == pytest.approx(4 / 3 * step_seconds(QUICK, one, 8, assumed))
    selective = dataclasses.replace(one, recompute="selective")  # no matmul runs twice
    assert step_seconds(QUICK, selective, 8, assumed) == step_seconds(QUICK, one, 8, assumed)
    # at tp 2 the row-parallel projections run again, with their all-reduces, over links too fast to count
    instant = dataclasses.replace(assumed, intra_gbps=1e15, inter_gbps=1e15)
    split, split_selective = (dataclasses.replace(c, tp=2, dp=1) for c in (one, selective))
    again = 2 * QUICK.n_embd * (QUICK.n_embd + QUICK.ffn_hidden) * QUICK.n_layer * 8 * QUICK.block_size / 2
    assert step_seconds(QUICK, split_selective, 8, instant) - step_seconds(QUICK, split, 8, instant) == \
        pytest.approx(again / (assumed.peak_tflops * 1e12 * assumed.mfu), rel=1e-6)
    # 2 stages of 2 micro-batches: 1F1B's bubble, (accum + stages - 1) / accum, over links too fast to count
    staged = Candidate(tp=1, sp=1, pp=2, dp=1, zero=1, micro=4, accum=2, recompute="none")
    assert step_seconds(QUICK, staged, 8, instant) == pytest.approx(step_seconds(QUICK, one, 8, assumed) / 2 * 3 / 2)
    slow = dataclasses.replace(assumed, inter_gbps=5.0)
    for c in candidates(QUICK, 16, 8, 64):
        assert step_seconds(QUICK, c, 8, slow) >= step_seconds(QUICK, c, 8, assumed)


def test_the_optimizer_goes_to_the_cpu_only_where_nothing_else_fits():
    """8B on one 80 GB GPU: only ZeRO-2/3 with the optimizer offloaded fit, and the step pays the stated PCIe
    traffic and CPU Adam; on 8 GPUs a layout without offload is faster and recommended. The host's memory is
    DeepSpeed's estimate for the data group, shared out over the node's GPUs, held against --host_gb."""
    cfg, a = preset("llama3.1_8b"), Assumptions()
    rows = plan_layouts(cfg, 1, 8, 64, a)
    assert {(r["layout"].zero, r["layout"].offload) for r in rows if r["fits"]} == {(2, True), (3, True)}
    best = rows[0]["layout"]
    assert best.offload and plan(cfg, best.ds_config(), 1)["cpu"] == rows[0]["host"] > 0
    params = sum(layer_params(cfg))
    on_gpu = dataclasses.replace(best, offload=False)
    assert step_seconds(cfg, best, 1, a) - step_seconds(cfg, on_gpu, 1, a) == pytest.approx(
        6 * params / (a.pcie_gbps * 1e9) + params / (a.cpu_adam_gparams * 1e9))
    assert not any(r["fits"] for r in plan_layouts(cfg, 1, 8, 64, dataclasses.replace(a, host_gb=64)))
    assert not plan_layouts(cfg, 8, 8, 64, a)[0]["layout"].offload
    assert not any(c.offload and (c.pp > 1 or c.zero == 1) for c in candidates(cfg, 16, 8, 64))


def test_the_llama_3_papers_405b_layout_is_feasible():
    """TP 8 x PP 16 x DP 64 on 8,192 GPUs with 16M-token batches (Llama 3 paper, Table 4), the blocks recomputed
    in full or selectively; not without recomputation."""
    cfg, found = preset("llama3.1_405b"), set(candidates(preset("llama3.1_405b"), 8192, 8, 2048))
    for recompute, fits in (("full", True), ("selective", True), ("none", False)):
        paper = Candidate(tp=8, sp=1, pp=16, dp=64, zero=1, micro=1, accum=32, recompute=recompute,
                          tp_sequence=True)
        assert paper in found
        assert (plan(cfg, paper.ds_config(), 8192)["total"] < 0.9 * Assumptions().gpu_gb * GB) == fits


@pytest.mark.parametrize("flag,message", [
    (["--gpus_per_node", "0"], "error: --gpus_per_node 0: must be > 0; fix: leave it out for its default"),
    (["--inter_gbps", "nan"], "error: --inter_gbps nan: must be > 0; fix: leave it out for its default"),
    (["--mfu", "1.5"], "error: --mfu 1.5: must be in (0, 1], the share of the peak the matmuls reach; fix: e.g. "
                       "--mfu 0.45"),
])
def test_a_bad_assumption_is_one_line(flag, message):
    proc = run_tool("scripts.memory_plan", ["--config", "configs/llama_quickstart.yaml", "--plan", "--gpus", "8",
                                            "model.vocab_size=65", *flag], {}, 120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [message]


@pytest.mark.parametrize("flags,message", [
    (["--gpus", "8", "--gpus", "0"], "error: --gpus 0: must be 1 or more; fix: e.g. --gpus 8"),
    (["--gpu_gb", "0"], "error: --gpu_gb 0.0: must be > 0; fix: leave it out for this machine's GPU (else 80 GB)"),
    (["--gpus", "64", "--nodes", "8"], "error: --nodes is an option of --plan, which enumerates every layout for a "
                                       "number of GPUs; fix: add --plan"),
    (["--mfu", "0.5"], "error: --mfu is an option of --plan, which enumerates every layout for a number of GPUs; fix: "
                       "add --plan"),
])
def test_the_table_checks_its_gpus_and_takes_no_option_of_the_plan(flags, message, capsys):
    """The table of shipped ds_configs checks its GPU count and size as --plan does, and refuses what only --plan
    reads (it would be left unread)."""
    import scripts.memory_plan
    with pytest.raises(SystemExit) as ended:
        scripts.memory_plan.main(["--config", "configs/llama_quickstart.yaml", *flags, "model.vocab_size=65"])
    assert ended.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [message]


def test_the_command_recommends_a_layout_or_says_none_fits():
    argv = ["--config", "configs/llama_quickstart.yaml", "--plan", "--gpus", "8", "--global_batch", "64",
            "model.vocab_size=65"]
    proc = run_tool("scripts.memory_plan", argv, {}, 120)
    assert proc.returncode == 0, proc.stderr
    assert "8 GPUs (8 a node), 64 windows a step; assumed: 79.1 GB a GPU, 989 TFLOP/s peak at 45% MFU" in proc.stdout
    assert ("each GPU's plan within 90% of it (7.9 GB left to the allocator's fragmentation, communication buffers "
            "and the CUDA context)") in proc.stdout
    assert ("| layout | weights | gradients | optimizer | buffers | activations | memory / GPU | host memory / node | "
            "fits | step s | MFU |") in proc.stdout
    assert "\nrecommended: dp " in proc.stdout and "tensor_model_parallel_size=" in proc.stdout
    proc = run_tool("scripts.memory_plan", [*argv, "--gpu_gb", "0.001"], {}, 120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: no layout fits 0.001 GB GPUs: add GPUs or lower --global_batch"]


def test_the_table_takes_ds_overrides_and_a_bad_override_is_one_line():
    argv = ["--config", "configs/llama_quickstart.yaml", "--ds_config", "ds_configs/zero1.json", "--gpus", "1",
            "model.vocab_size=65"]
    proc = run_tool("scripts.memory_plan", [*argv, "ds.train_micro_batch_size_per_gpu=3"], {}, 120)
    assert proc.returncode == 0, proc.stderr
    assert "| zero1.json | 1 | world 1 = dp 1 x pp 1 | 1 | 3 |" in proc.stdout
    proc = run_tool("scripts.memory_plan", [*argv, "modle.n_layer=2"], {}, 120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("error: unknown setting 'modle' in the command line")


# Published throughput, and what the step-time model says at the same layout with its default assumptions (45% of
# the peak in compute, nothing overlapped). torchtitan's Llama 3.1 8B, 8 H100s, FSDP, local batch 2, bf16 without
# compile or Float8, selective recomputation: 5,762 tokens/s a GPU (benchmarks/llama3_h100_202412_torchtitan.md,
# Table 1). The Llama 3 paper's 405B, 8,192 H100s, TP 8 x PP 16 x DP 64, 16M-token batches: 43% MFU (Table 4).
def test_the_step_model_against_published_runs():
    """The model brackets torchtitan's 8B run (faster without recomputation, slower with every block recomputed:
    torchtitan recomputes part) and reads the Llama 3 paper's 405B step 1.76 times as long as it was with the
    blocks recomputed selectively, and twice as long recomputed in full: DeepSpeed's 1F1B keeps 15 idle slots over
    32 micro-batches where Meta's interleaved schedule keeps fewer (docs/scaling.md)."""
    a = Assumptions()
    cfg = preset("llama3.1_8b")
    tokens = 16 * cfg.block_size
    per_gpu = {r: tokens / 8 / step_seconds(cfg, Candidate(1, 1, 1, 8, 3, 2, 1, r), 8, a) for r in ("none", "full")}
    assert per_gpu["full"] < 5762 < per_gpu["none"]
    assert per_gpu["none"] / 5762 == pytest.approx(1.26, abs=0.01)
    assert per_gpu["full"] / 5762 == pytest.approx(0.96, abs=0.01)

    cfg = preset("llama3.1_405b")
    useful = flops_per_token(cfg) * 2048 * cfg.block_size
    published = useful / (8192 * a.peak_tflops * 1e12 * 0.43)
    paper = {r: Candidate(tp=8, sp=1, pp=16, dp=64, zero=1, micro=1, accum=32, recompute=r, tp_sequence=True)
             for r in ("selective", "full")}
    assert step_seconds(cfg, paper["selective"], 8, a) / published == pytest.approx(1.76, abs=0.01)
    assert step_seconds(cfg, paper["full"], 8, a) / published == pytest.approx(2.07, abs=0.01)
    bubble = (32 + 16 - 1) / 32
    assert bubble * 0.43 / a.mfu == pytest.approx(1.40, abs=0.01)  # of the 1.76: the schedule, the assumed MFU
