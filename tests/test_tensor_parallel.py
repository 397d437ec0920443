"""Tensor parallelism: the split layers against the whole model in-process (GPT, Llama with grouped-query
attention, the encoder), then training through the real launcher, fp32 and dropout 0: tp 2, tp 2 x dp 2 and
pp 2 x tp 2 give the losses and gradient norms of one process; replicated weights stay bitwise equal; a
tp 2 checkpoint resumes exactly at tp 2 and, through the universal format, at tp 1 (from pp 2 x tp 2 too), and a
tp 1 one at tp 2; export merges the slices into weights transformers loads; bad layouts stop at start."""
import dataclasses
import itertools
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.checks import ConfigError
from harness import FP32, REPO, export, free_port, grad_norms, launch, metrics, train_losses, universal
from hf_check import assert_export_matches_transformers
from model import build_model, model_layers
from model.config import ModelConfig
from model.parallelize import check_sequence_split
from model.tensor_parallel import TensorParallel, cross_entropy_sum, gather_vocab, merge_parameter, split_rule
from training.ds_config import load_ds_config
from training.steps import replicated_weights_in_sync
from training.topology import pipeline_settings, resolve_layout, tensor_parallel_size

pytestmark = pytest.mark.launch  # several train.py processes per test (python -m pytest -m "not launch" skips them)

SMALL = {"gpt": ModelConfig(arch="gpt", n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=65),
         "llama": ModelConfig(arch="llama", n_layer=2, n_head=8, n_kv_head=4, n_embd=64, ffn_hidden=64,
                              block_size=16, vocab_size=65),
         # Qwen's attention: q/k/v biases split with their maps; the per-head norms whole, their gradients summed
         "llama_qwen": ModelConfig(arch="llama", n_layer=2, n_head=8, n_kv_head=4, n_embd=64, head_dim=16,
                                   qkv_bias=True, qk_norm=True, ffn_hidden=64, block_size=16, vocab_size=65),
         "encoder": ModelConfig(arch="encoder", n_layer=2, n_head=4, n_embd=32, ffn_hidden=64, block_size=16,
                                vocab_size=65)}


def merged(model: torch.nn.Module, tp: TensorParallel, grads: bool = False) -> dict:
    """The whole tensors from every tensor rank's slices (collective)."""
    out = {}
    for name, p in model.named_parameters():
        t = (p.grad if grads else p.detach()).contiguous()
        slices = [torch.empty_like(t) for _ in range(tp.size)]
        dist.all_gather(slices, t, group=tp.group)
        out[name] = merge_parameter(slices, split_rule(p))
    return out


def _split_against_whole(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    idx, targets = torch.randint(0, 65, (2, 16)), torch.randint(0, 65, (2, 16))
    targets[0, :3] = -100  # padding rows add no loss and no gradient
    for (arch, cfg), sequence in itertools.product(SMALL.items(), (False, True)):
        tp = TensorParallel(world, rank, group, sequence)
        whole, split = build_model(cfg, seed=3), build_model(cfg, seed=3, tp=tp)
        weights_equal = all(torch.equal(merged(split, tp)[n], p) for n, p in whole.named_parameters())
        whole_loss = cross_entropy_sum(whole(idx).flatten(0, 1), targets.flatten(), TensorParallel())
        split_loss = cross_entropy_sum(split(idx).flatten(0, 1), targets.flatten(), tp)
        whole_loss.backward()
        split_loss.backward()
        grads = merged(split, tp, grads=True)
        grad_error = max((grads[n] - p.grad).abs().max().item() for n, p in whole.named_parameters())
        with torch.no_grad():
            logit_error = (gather_vocab(split(idx), tp) - whole(idx)).abs().max().item()
            in_sync = replicated_weights_in_sync(split, tp)
            replicated = next(p for p in split.parameters() if split_rule(p) is None)  # a norm's gain, say
            replicated.data[0] += rank  # tensor rank 1's copy drifts
            drifted = replicated_weights_in_sync(split, tp)
        if rank == 0:
            results[arch, sequence] = (weights_equal, whole_loss.item(), split_loss.item(), grad_error, logit_error,
                             in_sync, drifted)
    dist.destroy_process_group()


def test_split_layers_compute_what_the_whole_model_does():
    """Two gloo processes, no DeepSpeed, with and without Megatron's sequence parallelism: the same seed gives the
    same whole weights; the summed loss (with padding targets), every gradient (the replicated weights' summed over
    the slices under sequence parallelism) and the gathered logits equal the whole model's; the replicated-weight
    check holds, and fails once one rank's copy of a replicated weight drifts."""
    port = free_port()
    results = mp.Manager().dict()
    mp.spawn(_split_against_whole, args=(2, port, results), nprocs=2)
    for arch, sequence in itertools.product(SMALL, (False, True)):
        weights_equal, whole_loss, split_loss, grad_error, logit_error, in_sync, drifted = results[arch, sequence]
        assert weights_equal, (arch, sequence)
        assert (in_sync, drifted) == (True, False), (arch, sequence)  # the check sees one rank's drift
        assert split_loss == pytest.approx(whole_loss, rel=1e-6), (arch, sequence)
        assert grad_error < 1e-5 and logit_error < 1e-5, (arch, sequence, grad_error, logit_error)


@pytest.mark.parametrize("arch", SMALL)
def test_every_degree_holds_slices_of_the_same_weights(arch):
    """Built rank by rank at tp 2 and 4 (no process group: building needs none), the slices merge into the
    tp 1 weights bitwise, and each split rule is the one the layer applied."""
    whole = dict(build_model(SMALL[arch], seed=5).named_parameters())
    for size in (2, 4):
        ranks = [dict(build_model(SMALL[arch], seed=5, tp=TensorParallel(size, r)).named_parameters())
                 for r in range(size)]
        for name, p in whole.items():
            assert torch.equal(merge_parameter([r[name].detach() for r in ranks], split_rule(ranks[0][name])), p), name
    rules = {n: split_rule(p) for n, p in build_model(SMALL["gpt"], tp=TensorParallel(2)).named_parameters()}
    assert (rules["2.attn.qkv.weight"], rules["2.attn.proj.weight"], rules["2.attn.proj.bias"],
            rules["tied_modules.embed.weight"], rules["2.ln_1.weight"]) == (("column", 3), "row", None, "column", None)


def test_bad_tensor_parallel_layouts_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=4 does not divide model.n_head = 6"):
        model_layers(ModelConfig(n_head=6, n_embd=48, vocab_size=65), TensorParallel(4))
    with pytest.raises(ValueError, match=r"does not divide the key/value heads \(model.n_kv_head\) = 2"):
        model_layers(ModelConfig(arch="llama", n_head=8, n_kv_head=2, n_embd=64, vocab_size=65), TensorParallel(4))
    with pytest.raises(ConfigError, match=r"2 pipeline stages x tensor-parallel degree 2 = 4 do not divide the world "
                                          r"size 6: launch a multiple of 4 processes"):
        resolve_layout({"train_micro_batch_size_per_gpu": 1}, 6, 2, 2)
    with pytest.raises(ConfigError, match=r"ZeRO stage 2 cannot be combined with pipeline parallelism"):
        pipeline_settings({"pipeline": {"stages": 2}, "zero_optimization": {"stage": 2},
                           "tensor_model_parallel_size": 2})
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=0 in .*tp2.json: must be an integer >= 1"):
        load_ds_config(os.path.join(REPO, "ds_configs", "tp2.json"), ["tensor_model_parallel_size=0"])
    with pytest.raises(ConfigError, match=r"DeepSpeed's AutoTP .* remove the tensor_parallel section"):
        tensor_parallel_size({"tensor_model_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}})


def test_what_the_sequence_split_cannot_run_with_is_refused():
    micro = {"train_micro_batch_size_per_gpu": 1}
    with pytest.raises(ConfigError, match=r"tensor_sequence_parallel=true splits the sequence over the tensor ranks, "
                                          r"and tensor_model_parallel_size is 1: set tensor_model_parallel_size > 1"):
        resolve_layout({**micro, "tensor_sequence_parallel": True}, 2)
    with pytest.raises(ConfigError, match=r"tensor_sequence_parallel='yes': must be true or false"):
        resolve_layout({**micro, "tensor_sequence_parallel": "yes"}, 2, 1, 2)
    assert resolve_layout({**micro, "tensor_sequence_parallel": True}, 2, 1, 2).tp_sequence
    gpt = SMALL["gpt"]
    check_sequence_split(gpt, 2, 1)  # the split layers' test model runs
    refusals = {"model.block_size=18": ({"block_size": 18}, 4, 1), "Ulysses' sequence_parallel_size=2": ({}, 2, 2),
                "model.dropout=0.1 would draw the same mask": ({"dropout": 0.1}, 2, 1),
                "DeepSpeed's MoE layer": ({"arch": "llama", "n_experts": 4, "n_head": 8, "n_kv_head": 4}, 2, 1),
                "the score head is not split": ({"head": "score"}, 2, 1)}
    for why, (change, tp, sp) in refusals.items():
        with pytest.raises(ConfigError, match=rf"tensor_sequence_parallel=true cannot run here: .*{why}.*; fix: "
                                              r"remove tensor_sequence_parallel from the ds_config"):
            check_sequence_split(dataclasses.replace(gpt, **change), tp, sp)


def test_a_world_the_degree_does_not_divide_stops_at_start(tmp_path, char_data):
    proc = launch(1, "tp2.json", tmp_path, char_data, FP32, check=False)
    assert proc.returncode != 0
    assert ("1 pipeline stages x tensor-parallel degree 2 = 2 do not divide the world size 1"
            in proc.stdout + proc.stderr)
    assert not os.path.exists(tmp_path / "metrics.jsonl")


# Global batch 8 in every layout (micro 2 x accumulation 4 / dp); a checkpoint at step 2 of 4.
CONFIGS = {"gpt": "quickstart.yaml", "llama": "llama_quickstart.yaml", "encoder": "encoder_tiny.yaml"}
FAST = ["model.n_layer=2", "train.max_steps=4", "train.save_interval=2", "optim.warmup_steps=2", "optim.lr=3e-3",
        "ds.train_micro_batch_size_per_gpu=2", "sample.max_new_tokens=8", *FP32]
# name: (arch, processes, ds_config, overrides); ZeRO 0-3 spread over the layouts; "_seq": Megatron's sequence
# parallelism inside the tensor groups (under ZeRO-2 and dp 2, ZeRO-3, and a pipeline); three recompute every block
# selectively (model/recompute.py): in a pipeline with the row-parallel maps' sums, with the sequence split, and
# under ZeRO-3's weight gathers.
SEQ = "ds.tensor_sequence_parallel=true"
SELECTIVE = ["ds.pipeline.activation_checkpoint_interval=1", "ds.pipeline.recompute=selective"]
RUNS = {
    "gpt_tp1": ("gpt", 1, "zero1.json", ["ds.gradient_accumulation_steps=4"]),
    "gpt_zero0_tp1": ("gpt", 1, "zero0.json", ["ds.gradient_accumulation_steps=4"]),  # converted by this repo
    "gpt_tp2": ("gpt", 2, "tp2.json", ["ds.gradient_accumulation_steps=4"]),
    "gpt_tp2_dp2_seq": ("gpt", 4, "tp2.json", ["ds.gradient_accumulation_steps=2", "ds.zero_optimization.stage=2",
                                               SEQ, *SELECTIVE]),
    "gpt_pp2_tp2": ("gpt", 4, "pipe2_tp2.json", ["ds.gradient_accumulation_steps=4", *SELECTIVE]),
    "llama_tp1": ("llama", 1, "zero1.json", ["ds.gradient_accumulation_steps=4"]),
    "llama_tp2_seq": ("llama", 2, "tp2.json", ["ds.gradient_accumulation_steps=4", "ds.zero_optimization.stage=3",
                                               SEQ, *SELECTIVE]),
    "llama_tp2_dp2": ("llama", 4, "tp2.json", ["ds.gradient_accumulation_steps=2", "ds.zero_optimization.stage=0"]),
    "llama_pp2_tp2_seq": ("llama", 4, "pipe2_tp2.json", ["ds.gradient_accumulation_steps=4",
                                                         "ds.zero_optimization.stage=0", SEQ]),
    "encoder_tp1": ("encoder", 1, "zero1.json", ["ds.gradient_accumulation_steps=4"]),
    "encoder_tp2": ("encoder", 2, "tp2.json", ["ds.gradient_accumulation_steps=4"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, char_data):
    done = {}

    def get(name: str):
        if name not in done:
            arch, procs, ds, extra = RUNS[name]
            out = tmp_path_factory.mktemp(name)
            proc = launch(procs, ds, out, char_data, [*FAST, *extra], config=CONFIGS[arch])
            done[name] = (out, proc.stdout)
        return done[name]
    return get


def sample_of(stdout: str) -> str:
    return stdout.split("--- sample ---")[1].split("-----")[0]


@pytest.mark.parametrize("name", [n for n in RUNS if not n.endswith("tp1")])
def test_layouts_train_as_one_process_does(runs, name):
    """Losses and gradient norms of tp 2, tp 2 x dp 2 and pp 2 x tp 2 (ZeRO 0-3, the fp32 ZeRO-0 pipeline among them),
    with and without the sequence split between the tensor ranks, with and without selective recomputation, equal one
    process's to 1e-5; the replicated weights
    end bitwise equal across tensor ranks, the tie across stages holds, and the sample (gathered vocabulary logits) is
    the same text."""
    arch = RUNS[name][0]
    (out, stdout), (reference, reference_stdout) = runs(name), runs(f"{arch}_tp1")
    assert len(train_losses(out)) == 4
    assert train_losses(out) == pytest.approx(train_losses(reference), abs=1e-5)
    assert grad_norms(out) == pytest.approx(grad_norms(reference), abs=1e-5)
    assert train_losses(reference)[-1] < train_losses(reference)[0] - 0.05  # it really trains
    assert [m["replicated_weights_in_sync"] for m in metrics(out) if "replicated_weights_in_sync" in m] == [True]
    if "pp2" in name and arch == "gpt":
        assert [m["tied_weights_in_sync"] for m in metrics(out) if "tied_weights_in_sync" in m] == [True]
    assert sample_of(stdout) == sample_of(reference_stdout)


def test_startup_names_each_ranks_coordinates_and_groups(runs):
    stdout = runs("gpt_pp2_tp2")[1]
    assert "world 4 = dp 1 x pp 2 x tp 2" in stdout
    assert ("tensor groups [[0, 1], [2, 3]]; data groups [[0], [1], [2], [3]]; pipeline groups [[0, 2], [1, 3]]"
            in stdout)
    assert "rank 3: stage 1, tensor rank 1, data rank 0" in stdout
    assert "stage 1: layers" in stdout and "on ranks [2, 3]" in stdout


def resume(char_data, out, checkpoint_dir, procs: int, ds_config: str, extra=()):
    launch(procs, ds_config, out, char_data, [*FAST, "ds.gradient_accumulation_steps=4", *extra,
                                              f"train.resume={checkpoint_dir}"])
    return [m for m in metrics(out) if "loss" in m]


@pytest.mark.parametrize("source,procs,ds_config", [("gpt_tp2", 2, "tp2.json"), ("gpt_tp2", 1, "zero1.json"),
                                                    ("gpt_pp2_tp2", 1, "zero1.json"), ("gpt_tp1", 2, "tp2.json"),
                                                    ("gpt_zero0_tp1", 2, "tp2.json")],
                         ids=["tp2-exact", "tp2-to-tp1-universal", "pp2xtp2-to-pp1-universal", "tp1-to-tp2-universal",
                              "tp1-zero0-to-tp2-universal"])
def test_resumed_runs_continue_the_uninterrupted_one(runs, tmp_path, char_data, source, procs, ds_config):
    run_dir = runs(source)[0]
    same_layout = (source, procs) == ("gpt_tp2", 2)
    checkpoint_dir = (os.path.join(run_dir, "checkpoints", "step_000002") if same_layout
                      else universal(run_dir, "step_000002"))
    steps = resume(char_data, tmp_path, checkpoint_dir, procs, ds_config)
    uninterrupted = [m for m in metrics(run_dir) if "loss" in m][2:]
    assert [m["step"] for m in steps] == [3, 4]
    assert [m["loss"] for m in steps] == pytest.approx([m["loss"] for m in uninterrupted], abs=1e-5)
    assert [m["grad_norm"] for m in steps] == pytest.approx([m["grad_norm"] for m in uninterrupted], abs=1e-5)


def test_a_tp1_checkpoint_without_the_split_rules_is_not_converted(runs, tmp_path):
    """A checkpoint of one tensor rank saved before checkpoints recorded the split rules at tp 1 (its universal
    info without the patterns) would resume at tp 2 with its row-parallel and fused weights cut on the wrong
    dimension: refused in one line, with the way on. This version's checkpoints record them."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    from training.checkpoints import checkpoint, universal

    source = os.path.join(runs("gpt_tp1")[0], "checkpoints", "step_000002")
    saved = checkpoint.read_run_state(source)
    assert universal.records_split_rules(source, saved) and universal.unconvertible(source, saved) is None
    old = tmp_path / "step_000002"
    shutil.copytree(source, old)
    states = checkpoint.load_state_file(str(old / "mp_rank_00_model_states.pt"))
    states[UNIVERSAL_CHECKPOINT_INFO] = {k: v for k, v in states[UNIVERSAL_CHECKPOINT_INFO].items()
                                         if k.startswith(("universal_checkpoint_version", "pipeline_replicated"))}
    torch.save(states, old / "mp_rank_00_model_states.pt")
    assert universal.unconvertible(str(old), saved) == (
        f"{old} was saved at tp=1 before checkpoints recorded how each parameter splits over tensor ranks: converted, "
        f"it would resume at tp > 1 with its row-parallel and fused weights cut wrongly. Resume it on its own layout "
        f"(pp=1, tp=1, ZeRO-1) and convert a checkpoint saved after that")


def test_export_merges_the_slices_into_weights_transformers_loads(runs):
    """The tp 2 run's final checkpoint, exported: its weights are the one-process run's, and transformers'
    GPT2LMHeadModel computes with them what our model does."""
    from training.checkpoints.export import consolidated_state_dict

    run_dir = runs("gpt_tp2")[0]
    state = consolidated_state_dict(os.path.join(run_dir, "checkpoints", "step_000004"))
    reference = consolidated_state_dict(os.path.join(runs("gpt_tp1")[0], "checkpoints", "step_000004"))
    assert state.keys() == reference.keys()
    # Adam turns a 1e-7 difference in a near-zero gradient into up to lr x steps (1.2e-2) in a weight: 1e-4 is tight
    assert max((state[k] - reference[k]).abs().max().item() for k in state) < 1e-4
    assert_export_matches_transformers(export(run_dir, "step_000004"), tokens=16)
