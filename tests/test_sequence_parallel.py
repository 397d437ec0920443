"""Ulysses sequence parallelism through the launcher's ranks, fp32, dropout 0, on tinyshakespeare's speeches under
document masking (and on the one-document quickstart data without): sp 2 trains as one process does, under
ZeRO-3 too and with the MLP in tiles, sp 2 x dp 2 as dp 2, tp 2 x sp 2 and pp 2 x sp 2 as one process (4 ranks
each), GPT and Llama with grouped-query attention, down to the final sample, drawn from both sequence ranks'
halves of the window; an sp 2 checkpoint resumes exactly, and at sp 1 through the universal format; layouts
Ulysses cannot split stop at start."""
import os

import pytest

from common.checks import ConfigError
from harness import FP32, grad_norms, launch, metrics, train_losses, universal
from model.config import ModelConfig
from model.sequence_parallel import check_sequence_parallel
from model.tiling import check_tiles
from training.topology import resolve_layout

pytestmark = pytest.mark.launch  # several train.py processes per test (python -m pytest -m "not launch" skips them)

# Global batch 8 in every layout (micro 2 x accumulation / dp); a checkpoint at step 2 of 4. The Llama has 8 query
# and 4 key/value heads: whole groups on each of tp 2 x sp 2 ranks. The final sample draws its 48 tokens from the
# logits of the first sequence rank's half of the window (positions 0-15), then of the second's (16-31, then 31 as
# the window slides): each rank must get the last position's logits from whichever holds them. Four steps leave
# the model close to a unigram model; at temperature 0.2 its draws still tell one position's logits from another's.
PROMPT, NEW_TOKENS, TEMPERATURE = "KING", 48, 0.2
SMALL = ["model.n_layer=2", "model.n_embd=64", "train.max_steps=4", "train.save_interval=2", "train.eval_interval=2",
         "train.eval_windows=8", "optim.warmup_steps=2", "optim.lr=3e-3", "ds.train_micro_batch_size_per_gpu=2",
         f"sample.prompt={PROMPT}", f"sample.max_new_tokens={NEW_TOKENS}", f"sample.temperature={TEMPERATURE}",
         "eval.limit=24", *FP32]
ARCHS = {"gpt": ("quickstart.yaml", ["model.n_head=4"]),
         "llama": ("llama_quickstart.yaml", ["model.n_head=8", "model.n_kv_head=4", "model.ffn_hidden=128"])}
SP2 = "ds.sequence_parallel_size=2"
LAYOUTS = {  # name: (processes, ds_config, overrides)
    "one": (1, "zero0.json", ["ds.gradient_accumulation_steps=4"]),
    "one_zero1": (1, "zero1.json", ["ds.gradient_accumulation_steps=4"]),  # DeepSpeed loads universal into ZeRO 1-3
    "sp2": (2, "zero0.json", [SP2, "ds.gradient_accumulation_steps=4"]),
    "sp2_zero1": (2, "zero1.json", [SP2, "ds.gradient_accumulation_steps=4"]),
    # with every block recomputed selectively (model/recompute.py): around Ulysses' all-to-alls and ZeRO-3's gathers
    "sp2_zero3": (2, "zero3.json", [SP2, "ds.gradient_accumulation_steps=4",
                                    "ds.pipeline.activation_checkpoint_interval=1", "ds.pipeline.recompute=selective"]),
    "dp2": (2, "zero1.json", ["ds.gradient_accumulation_steps=2"]),
    "sp2_dp2": (4, "zero1.json", [SP2, "ds.gradient_accumulation_steps=2"]),
    "tp2_sp2": (4, "tp2.json", [SP2, "ds.gradient_accumulation_steps=4"]),
    "pp2_sp2": (4, "pipe2.json", [SP2, "ds.gradient_accumulation_steps=4"]),
    "pp2_sp2_compiled": (4, "pipe2.json", [SP2, "ds.gradient_accumulation_steps=4", "train.compile=true"]),
    # The MLP in tiles along each rank's slice (DeepSpeed's TiledMLP), computed again in the backward.
    "sp2_tiled": (2, "zero0.json", [SP2, "ds.gradient_accumulation_steps=4", "train.mlp_tiles=4"]),
}
REFERENCE = {"sp2": "one", "sp2_zero3": "one", "sp2_dp2": "dp2", "tp2_sp2": "one", "pp2_sp2": "one",
             "sp2_tiled": "one"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, speech_data, char_data, shakespeare_task):
    done = {}

    def get(arch: str, layout: str, masked: bool = True):
        key = (arch, layout, masked)
        if key not in done:
            config, shape = ARCHS[arch]
            procs, ds_config, overrides = LAYOUTS[layout]
            out = tmp_path_factory.mktemp(f"{arch}_{layout}")
            data = speech_data if masked else char_data
            proc = launch(procs, ds_config, out, data, [*SMALL, *shape, *overrides, f"eval.tasks=[{shakespeare_task}]",
                                                        f"model.document_masking={str(masked).lower()}"], config=config)
            done[key] = (out, proc.stdout)
        return done[key]
    return get


def val_losses(out_dir) -> list[float]:
    return [m["val_loss"] for m in metrics(out_dir) if "val_loss" in m]


def task_scores(out_dir) -> list[tuple]:
    return [(m["shakespeare_acc"], m["shakespeare_acc_norm"]) for m in metrics(out_dir) if "shakespeare_acc" in m]


def assert_trains_alike(out, reference) -> None:
    assert len(train_losses(out)) == 4
    assert train_losses(out) == pytest.approx(train_losses(reference), abs=1e-5)
    assert grad_norms(out) == pytest.approx(grad_norms(reference), abs=1e-5)
    assert val_losses(out) == pytest.approx(val_losses(reference), abs=1e-5)
    assert len(task_scores(out)) == 3 and task_scores(out) == task_scores(reference)
    assert train_losses(reference)[-1] < train_losses(reference)[0] - 0.05  # it really trains


def sample(stdout: str) -> str:
    text = stdout.split("--- sample ---\n")[1].split("\n--------------")[0]
    assert text.startswith(PROMPT) and len(text) >= len(PROMPT) + NEW_TOKENS  # a token: a character or more
    return text


@pytest.mark.parametrize("layout", REFERENCE)
@pytest.mark.parametrize("arch", ARCHS)
def test_layouts_train_as_their_reference_does(runs, arch, layout):
    """Losses, gradient norms, validation losses; and the final sample, each rank generating from its slice."""
    (out, stdout), (reference, reference_stdout) = runs(arch, layout), runs(arch, REFERENCE[layout])
    assert "sequence groups" in stdout and "sp 2" in stdout
    assert_trains_alike(out, reference)
    assert sample(stdout) == sample(reference_stdout)


def test_compiled_blocks_train_the_eager_losses_in_pipeline_stages_over_sequence_ranks(runs):
    """train.compile with pp 2 x sp 2: each stage compiles its block around Ulysses' all-to-alls, and the last
    stage's loss its chunks; one eager process's losses (compiled kernels sum in their own order)."""
    (out, stdout), (reference, _) = runs("llama", "pp2_sp2_compiled"), runs("llama", "one")
    assert "compiling 1 blocks (torch.compile)" in stdout and "pp 2" in stdout and "sp 2" in stdout
    assert len(train_losses(out)) == 4 and train_losses(out) == pytest.approx(train_losses(reference), abs=1e-4)
    assert grad_norms(out) == pytest.approx(grad_norms(reference), abs=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_final_sample_tells_the_last_positions_logits_from_any_other(runs, arch):
    """What makes the samples' equality above check which logits each rank draws from: the one-process model,
    drawing as train.py does, gives the run's sample; drawn from a row of zeros (the logits of a sequence rank that
    does not hold the last position, not gathered from the one that does) or from the position before the last,
    the text differs."""
    import torch

    from model.generate import Sampling, WindowDecoder, generate
    from training.checkpoints.export import load_trained
    from training.config import SampleConfig

    out, stdout = runs(arch, "one")
    cfg, model, tokenizer, _ = load_trained(str(out))
    settings = SampleConfig()  # the runs' top_k and seed

    def drawn(logits_of) -> str:
        decoder = WindowDecoder(lambda idx: logits_of(model.eval()(idx)), cfg.block_size, cfg.vocab_size,
                                torch.device("cpu"))
        prompt = tokenizer.encode(PROMPT)
        ids = generate(decoder, prompt, Sampling(NEW_TOKENS, TEMPERATURE, settings.top_k),
                       torch.Generator().manual_seed(settings.seed))
        return tokenizer.decode(prompt + ids)

    assert drawn(lambda logits: logits) == sample(stdout)
    assert drawn(torch.zeros_like) != sample(stdout)
    assert drawn(lambda logits: logits.roll(1, dims=1)) != sample(stdout)


@pytest.mark.parametrize("arch", ARCHS)
def test_without_document_masking_each_slice_takes_its_window_positions(runs, arch):
    assert_trains_alike(runs(arch, "sp2", masked=False)[0], runs(arch, "one", masked=False)[0])


# (the run a checkpoint of step 2 comes from, the layout it resumes at): exactly at its own, else through the
# universal format (one process's by this repo's ZeRO-0 converter)
RESUMES = {"sp2": ("sp2_zero1", "sp2_zero1"), "sp1": ("sp2_zero1", "one_zero1"), "sp1_to_sp2": ("one", "sp2_zero1")}


@pytest.mark.parametrize("at", RESUMES)
@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoints_resume_exactly_at_sp2_and_across_sp_degrees(runs, tmp_path, speech_data, shakespeare_task, arch,
                                                                 at):
    source, layout = RESUMES[at]
    run_dir = runs(arch, source)[0]
    config, shape = ARCHS[arch]
    procs, ds_config, overrides = LAYOUTS[layout]
    tag = os.path.join(run_dir, "checkpoints", "step_000002") if at == "sp2" else universal(run_dir, "step_000002")
    resumed = launch(procs, ds_config, tmp_path, speech_data,
                     [*SMALL, *shape, *overrides, "model.document_masking=true", f"eval.tasks=[{shakespeare_task}]",
                      f"train.resume={tag}"], config=config)
    assert "at step 2" in resumed.stdout
    after = [m for m in metrics(tmp_path) if "loss" in m]
    uninterrupted = [m for m in metrics(run_dir) if "loss" in m][2:]
    assert [m["step"] for m in after] == [3, 4]
    tolerance = 0 if at == "sp2" else 1e-5  # at its own layout, exactly
    assert [m["loss"] for m in after] == pytest.approx([m["loss"] for m in uninterrupted], abs=tolerance)
    assert [m["grad_norm"] for m in after] == pytest.approx([m["grad_norm"] for m in uninterrupted], abs=tolerance)


def test_layouts_ulysses_cannot_split_are_refused():
    llama = ModelConfig(arch="llama", n_head=8, n_kv_head=2, n_embd=64, block_size=64, vocab_size=65)
    with pytest.raises(ConfigError, match=r"tensor x sequence-parallel degree 2 x 2 does not divide the key/value "
                                          r"heads \(model.n_kv_head\) = 2"):
        check_sequence_parallel(llama, 2, 2)
    with pytest.raises(ConfigError, match=r"sequence_parallel_size=3 does not divide model.block_size=64"):
        check_sequence_parallel(ModelConfig(n_head=6, n_embd=48, block_size=64, vocab_size=65), 1, 3)
    with pytest.raises(ConfigError, match=r"needs the GPT or the Llama"):
        check_sequence_parallel(ModelConfig(arch="encoder", n_head=4, n_embd=32, ffn_hidden=64, block_size=64,
                                            vocab_size=65), 1, 2)
    with pytest.raises(ConfigError, match=r"2 pipeline stages x sequence-parallel degree 2 = 4 do not divide the "
                                          r"world size 6: launch a multiple of 4 processes"):
        resolve_layout({"train_micro_batch_size_per_gpu": 1}, 6, 2, 1, 2)
    with pytest.raises(ConfigError, match=r"train.mlp_tiles=2 computes the MLP again in its backward, which would "
                                          r"draw other dropout masks than its forward: set model.dropout=0"):
        check_tiles(ModelConfig(dropout=0.1), 2)
    with pytest.raises(ConfigError, match=r"train.mlp_tiles=2 needs the GPT or the Llama"):
        check_tiles(ModelConfig(arch="encoder"), 2)


def _sliced_against_whole(rank: int, world: int, port: int, results) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    from model import build_model
    from model.sequence_parallel import SequenceParallel, gathered_logits

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    deepspeed.init_distributed("gloo")  # DistributedAttention's all-to-all goes through DeepSpeed's comm
    sp = SequenceParallel(world, rank, dist.new_group(list(range(world))))
    torch.manual_seed(0)
    idx = torch.randint(0, 65, (2, 16))
    positions = torch.tensor([list(range(5)) + list(range(11)), list(range(16))])  # two documents, then one
    for arch, masked in (("gpt", False), ("llama", True)):
        cfg = ModelConfig(arch=arch, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=16, vocab_size=65,
                          document_masking=masked)
        whole, sliced = build_model(cfg, seed=3), build_model(cfg, seed=3, sp=sp)
        inputs = (idx, positions) if masked else idx
        (part_inputs, part_targets) = sp.split(inputs, idx)
        expected = whole(inputs)
        got = sliced(part_inputs)
        got.sum().backward()
        expected.sum().backward()
        grads = {n: p.grad.clone() for n, p in sliced.named_parameters()}
        for grad in grads.values():
            dist.all_reduce(grad, group=sp.group)  # the whole sequence's gradient: the sum of the slices'
        error = (got - expected[:, sp.part(16)]).abs().max().item()
        grad_error = max(((grads[n] - p.grad).abs().max() / p.grad.abs().max()).item()  # relative: a sum of logits
                         for n, p in whole.named_parameters())
        with torch.no_grad():  # generation: any length, each rank its slice of the padded ids
            sample_error = (gathered_logits(sliced, sp)(idx[:, :7]) - whole(idx[:, :7])).abs().max().item()
        if rank == 0:
            results[arch] = (error, grad_error, sample_error)
    dist.destroy_process_group()


def test_sliced_attention_and_generation_compute_what_the_whole_model_does():
    """Two gloo processes, no DeepSpeed engine: each sequence rank's logits are the whole model's for its slice
    (learned positions offset, RoPE and the document mask from the whole window's positions), the slices'
    gradients add up to the whole sequence's, and generation gathers the logits of an odd length."""
    import torch.multiprocessing as mp

    from harness import free_port

    results = mp.Manager().dict()
    mp.spawn(_sliced_against_whole, args=(2, free_port(), results), nprocs=2)
    for arch in ("gpt", "llama"):
        error, grad_error, sample_error = results[arch]
        assert error < 1e-5 and sample_error < 1e-5, arch
        assert grad_error < 1e-5, arch
