"""The runs of a tiny mixture of experts at each layout, which tests/test_moe.py compares and
tests/test_moe_universal.py converts and resumes: one session fixture that the workers share, so each run happens
once."""
import pytest

from harness import FP32, TINY, launch, made_once, train_py

# TINY's 2 layers x 32 wide; 4 experts of width 48, 2 per token; global batch 8.
MOE = ["model.arch=llama", "model.n_kv_head=2", "model.ffn_hidden=64", "model.n_experts=4", "model.expert_hidden=48",
       "train.max_steps=4", "optim.warmup_steps=2", "optim.lr=3e-3", "model.router_aux_loss_coef=0.1",
       "model.router_z_loss_coef=0.01", *FP32]


RUNS = ("dp2", "ep2", "one", "pp2", "pp2_ep2", "tp2", "tp2_ep2", "sp2", "sp2_ep2", "bias_ep2", "bias_one", "ep2_dp4",
        "z0_ep2", "dp2_held", "ep2_held", "ep2_dp4_held", "pp2_held", "z0_ep2_held")


@pytest.fixture(scope="session")
def moe_runs(tmp_path_factory, char_data):
    """ep=1 x dp=2 for 4 steps; ep=2 (ZeRO-2) and pp=2 (ZeRO-1, 2 micro-batches) each stopped at step 2 and
    resumed to 4; one process with 2 accumulation steps; ep=2 x dp=4 and ep=2 under ZeRO-0 for 2 steps. Those
    that a test converts write what their engines hold of each parameter at the step they save
    (tests/optimizer_dump.py) into "<name>_held". Trained once, whichever worker asks first."""
    return runs_in(made_once(tmp_path_factory, "moe_runs", lambda folder: train(runs_in(folder), char_data)))


def runs_in(root) -> dict:
    return {name: root / name for name in RUNS}


def train(out: dict, char_data: str) -> None:
    for folder in out.values():
        folder.mkdir()
    proc = launch(2, "zero1.json", out["dp2"], char_data, [*MOE, "ds.train_micro_batch_size_per_gpu=4"],
                  env={"MEGALITE_OPTIMIZER_DUMP": f"4:{out['dp2_held']}"})
    (out["dp2"] / "stdout.txt").write_text(proc.stdout)
    ep2 = [*MOE, "ds.train_micro_batch_size_per_gpu=4", "ds.expert_parallel_size=2", "train.save_interval=2"]
    launch(2, "zero2.json", out["ep2"], char_data, [*ep2, "train.stop_at_step=2"],
           env={"MEGALITE_OPTIMIZER_DUMP": f"2:{out['ep2_held']}"})
    launch(2, "zero2.json", out["ep2"], char_data, ep2)
    # Each expert group's states partitioned over 2 of 4 ranks, numbered from 0 on each (a checkpoint to convert).
    # ep 2 without ZeRO: each expert-parallel rank's whole optimizer state in a file of its own.
    launch(2, "zero0.json", out["z0_ep2"], char_data, [*ep2, "train.stop_at_step=2"],
           env={"MEGALITE_OPTIMIZER_DUMP": f"2:{out['z0_ep2_held']}"})
    launch(4, "zero2.json", out["ep2_dp4"], char_data, [*MOE, "ds.train_micro_batch_size_per_gpu=2",
                                                        "ds.expert_parallel_size=2", "train.max_steps=2"],
           env={"MEGALITE_OPTIMIZER_DUMP": f"2:{out['ep2_dp4_held']}"})
    pp2 = [*MOE, "ds.train_micro_batch_size_per_gpu=4", "ds.gradient_accumulation_steps=2", "train.save_interval=2"]
    launch(2, "pipe2.json", out["pp2"], char_data, [*pp2, "train.stop_at_step=2"],
           env={"MEGALITE_OPTIMIZER_DUMP": f"2:{out['pp2_held']}"})
    launch(2, "pipe2.json", out["pp2"], char_data, pp2)
    # The same micro-batch everywhere: the load-balancing loss is a micro-batch's (a product of two means over
    # its tokens), so it changes with the micro-batch's size.
    launch(4, "pipe2.json", out["pp2_ep2"], char_data, [*MOE, "ds.train_micro_batch_size_per_gpu=4",
                                                         "ds.gradient_accumulation_steps=1",
                                                         "ds.expert_parallel_size=2"])
    # Tensor parallelism: the experts whole on each tensor rank (ep 1), or shared out over the tensor group (ep 2).
    # tp 2 stopped at step 2 and resumed: at ep 1 every tensor rank writes its own files too.
    tp2 = [*MOE, "ds.train_micro_batch_size_per_gpu=4", "ds.gradient_accumulation_steps=2", "train.save_interval=2"]
    launch(2, "tp2.json", out["tp2"], char_data, [*tp2, "train.stop_at_step=2"])
    launch(2, "tp2.json", out["tp2"], char_data, tp2)
    launch(4, "tp2.json", out["tp2_ep2"], char_data, [*MOE, "ds.train_micro_batch_size_per_gpu=4",
                                                      "ds.expert_parallel_size=2"])
    # Sequence parallelism: each rank a half of every window, the load-balancing loss the whole window's.
    for name, ep in (("sp2", 1), ("sp2_ep2", 2)):
        launch(2, "sp2.json", out[name], char_data, [*MOE, "ds.train_micro_batch_size_per_gpu=4",
                                                     "ds.gradient_accumulation_steps=2",
                                                     f"ds.expert_parallel_size={ep}"])
    one = ["--config", "configs/quickstart.yaml", "--ds_config", "ds_configs/zero0.json", f"data.dir={char_data}",
           *TINY, *MOE, "ds.train_micro_batch_size_per_gpu=4", "ds.gradient_accumulation_steps=2"]
    train_py([*one, f"train.out_dir={out['one']}"])
    # Balancing by a per-expert bias: the bias moves with the routes of the whole step, every rank's.
    bias = ["model.router_bias_rate=0.01", "model.router_aux_loss_coef=0"]
    bias_ep2 = [*MOE, *bias, "ds.train_micro_batch_size_per_gpu=4", "ds.expert_parallel_size=2",
                "train.save_interval=2"]
    launch(2, "zero2.json", out["bias_ep2"], char_data, [*bias_ep2, "train.stop_at_step=2"])  # the bias resumes too
    launch(2, "zero2.json", out["bias_ep2"], char_data, bias_ep2)
    train_py([*one, *bias, f"train.out_dir={out['bias_one']}"])
