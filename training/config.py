"""The two configuration files of a run, their command-line overrides, and their validation.

- The ds_config JSON (`--ds_config`) owns the engine: batch triple, ZeRO stage and offload, precision,
  gradient clipping, monitors. Override with `ds.<key>=<value>`.
- The run YAML (`--config`) owns model, data, optimizer/schedule, loop and sampling settings, typed by
  the dataclasses below. Override with `<section>.<key>=<value>`.
Every problem found here raises ConfigError before any process group or training work starts.
"""
import argparse
import os
from dataclasses import dataclass, field, fields
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common.checks import REPO_ROOT, Checks, ConfigError, ToolParser
from data.tasks import task_name
from model.config import ModelConfig
from model.registry import check_architecture
from training.device import SDPA_BACKENDS
from training.overrides import explain_omegaconf_error, read_overrides
from training.presets import layered, read_presets

DEFAULT_CONFIG = os.path.join(REPO_ROOT, "configs", "quickstart.yaml")
# On a GPU, ZeRO-1: in bf16, ZeRO-0 steps through DeepSpeed's unfused optimizer, which checks every gradient
# tensor for overflow with a host synchronization each (about 150 a step for GPT-2 124M); ZeRO-1 with fp32
# gradient accumulation goes through its bf16 optimizer (flat fp32 gradients and master weights, one norm)
# and at dp=1 holds what ZeRO-0 holds. On a CPU, where "auto" means fp32 unless it computes bf16, ZeRO-0.
def default_ds_config(cuda: bool) -> str:
    return os.path.join(REPO_ROOT, "ds_configs", "zero1.json" if cuda else "zero0.json")


DEFAULT_DS_CONFIG = default_ds_config(torch.cuda.is_available())
DS_PREFIX = "ds."


@dataclass
class SourceConfig:
    dir: str = ""  # a prepared dataset (python -m data.prepare)
    weight: float = 1.0  # relative share of the samples; any positive number


@dataclass
class DataConfig:
    dir: str = "data/shakespeare_char"  # holds train.bin, val.bin and meta.json (python -m data.prepare)
    # null: whatever the dataset was prepared with (every source of a blend alike). A name ("char", "gpt2",
    # "tiktoken:NAME", "bpe:SIZE", "tokenizer.json") must match the dataset's meta.json.
    tokenizer: Optional[str] = None
    # A weighted blend, [{dir: ..., weight: ...}, ...], used instead of `dir` when given.
    sources: list[SourceConfig] = field(default_factory=list)
    # Resume a checkpoint on other data (another dataset, tokenizer or weights) than it was trained on.
    allow_changed: bool = False
    # Conversation datasets (data.prepare --format chat): several whole conversations a window, kept apart by
    # document masking (model.document_masking=true), or one a window, padded.
    pack: bool = True

    def check(self, c: Checks) -> None:
        c.directory("dir")
        if self.tokenizer is not None:  # None: the dataset's own
            c.not_empty("tokenizer")
        # data.sources (each dir prepared, each weight positive) is checked where the blend is opened, at start:
        # data/token_data.py TokenData.


# optim.schedule and a WSD schedule's optim.decay_shape (training/optim.py; sqrt: 1 - sqrt(progress), the
# cooldown of Hägele et al., 2024)
SCHEDULES, DECAY_SHAPES = ("cosine", "wsd"), ("linear", "sqrt", "cosine")


@dataclass
class OptimConfig:
    """AdamW (decay on 2-D weights only) with linear warmup, then cosine decay to min_lr (DeepSpeed's
    WarmupCosineLR) or warmup-stable-decay: optim.lr until the last decay_fraction of the steps, then to min_lr."""
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    schedule: str = "cosine"
    decay_fraction: float = 0.2  # wsd: the share of train.max_steps, at the end, over which the rate decays
    decay_shape: str = "sqrt"  # wsd: how it decays

    def check(self, c: Checks) -> None:
        c.above("lr", 0)
        c.at_least("min_lr", 0, "0 decays to zero")
        c.at_least("warmup_steps", 1, "DeepSpeed's schedule warms up over one step at least")
        c.one_of("schedule", SCHEDULES)
        c.in_range("decay_fraction", 0.0, 1.0)
        c.above("decay_fraction", 0)
        c.one_of("decay_shape", DECAY_SHAPES)
        c.at_least("weight_decay", 0)
        c.that(self.min_lr <= self.lr, "min_lr", f"be <= optim.lr={self.lr}", "lower optim.min_lr or raise optim.lr")
        c.in_range("beta1", 0.0, 1.0, high_open=True)
        c.in_range("beta2", 0.0, 1.0, high_open=True)
        c.above("eps", 0)


# train.on_nonfinite and train.on_spike: what training/divergence.py does about a non-finite loss, a spike
NONFINITE_POLICIES = ("stop", "skip", "rewind")
SPIKE_POLICIES = ("warn", "stop", "rewind")

@dataclass
class TrainConfig:
    max_steps: int = 2000
    # Passes over the training windows (a small fine-tuning set); when set, it gives max_steps (the schedule's
    # length) from the data and the global batch.
    epochs: Optional[float] = None
    eval_interval: int = 250  # evaluate at step 0, every N steps and at the end (0: only at step 0 and the end)
    # The validation set: this many windows of each split, whatever dp, micro batch and accumulation.
    eval_windows: int = 240
    log_interval: int = 10  # a progress line every N steps (>= 1) and at the last step
    out_dir: str = "out/run"
    seed: int = 1337
    # MFU denominator in TFLOP/s per device; null measures a large matmul at start.
    peak_tflops: Optional[float] = None
    save_interval: int = 1000  # checkpoint every N steps (0: only at the end); always at the end
    keep_checkpoints: int = 3  # the newest K complete checkpoints are kept
    # Write checkpoint files from a thread while training goes on: a save costs the loop the copy of its
    # states into host memory (training/checkpoints/background_save.py). The last save of a run is waited for.
    background_save: bool = True
    # "auto": continue from the newest complete checkpoint in out_dir, or start fresh if there is none;
    # "none": start fresh (refused if out_dir holds checkpoints); or a tag / path to resume from.
    resume: str = "auto"
    # Resuming a checkpoint older than others in out_dir is refused unless this is true: then the newer ones
    # are deleted at start.
    discard_newer: bool = False
    # A local Hugging Face checkpoint folder (config.json + model.safetensors, GPT-2 or Llama) whose weights
    # start a fresh run (fine-tuning, continued pretraining); a run that resumes ignores it.
    init_from: Optional[str] = None
    # Stop after this step, with a checkpoint, though the schedule spans max_steps (fit a job's time slot).
    stop_at_step: Optional[int] = None
    # How long a rank waits in a collective for the others before the job ends with an error. Long enough
    # for a slow checkpoint save on a real cluster; tests make it seconds.
    dist_timeout_s: int = 1800
    # torch.compile each transformer block and the training loss's chunks (inductor; needs a C++ compiler on
    # CPU); evaluation and sampling run eager.
    compile: bool = False
    # fp32 matmuls on a GPU's tensor cores as TF32 (10-bit mantissa, several times faster); false for
    # bit-level fp32 parity checks. No effect on CPU.
    tf32: bool = True
    # The kernel torch's scaled_dot_product_attention tries first on a GPU: "auto" (torch's own order), "cudnn",
    # "flash", "efficient" or "math"; the others follow, for the shapes it cannot compute. The start names the
    # one it picks. No effect on CPU, which runs model/cpu_attention.py's kernels.
    sdpa_backend: str = "auto"
    # The MLP in this many tiles along the sequence (model/tiling.py): its hidden activations are computed
    # again in the backward instead of kept, for long windows. GPT and Llama, with model.dropout=0.
    mlp_tiles: int = 1
    # A step whose loss or gradient norm is not finite (training/divergence.py): "stop" ends the job, naming the
    # checkpoint to resume; "skip" goes on without its update, up to max_skipped_steps in a row; "rewind"
    # reloads the newest checkpoint and leaves out the batches since it, up to max_rewinds times.
    on_nonfinite: str = "stop"
    max_skipped_steps: int = 10
    max_rewinds: int = 3
    # A loss above spike_factor x its mean over about spike_window steps (0: not watched), and above that mean by
    # spike_min_rise at least, is logged as a warning ("warn"), or acted on as a non-finite step ("stop",
    # "rewind"). The rise keeps a fine-tuned model's losses near 0 from counting (0.002 to 0.03 is ten times, and
    # a DPO batch of harder pairs 0.03 to 0.54): a model that diverges loses nats, not fractions of one.
    spike_factor: float = 3.0
    spike_window: int = 50
    spike_min_rise: float = 1.0
    on_spike: str = "warn"
    # Print the run config and the ds_config, as the run took them, at start (they are always written to
    # out_dir/config.yaml and ds_config.json); without it the start-up says what matters in a few lines.
    print_config: bool = False
    # The objective (training/objectives/): null takes the data's (next_token for text and conversations, dpo
    # for preference pairs, grpo for prompts); dpo, ipo or simpo on preference pairs (settings under
    # preference.*); grpo or rloo on prompts (settings under rl.*).
    objective: Optional[str] = None

    @property
    def last_step(self) -> int:
        """The step the run ends at: train.stop_at_step where set, else train.max_steps."""
        return min(self.max_steps, self.stop_at_step or self.max_steps)

    def check(self, c: Checks) -> None:
        c.at_least("max_steps", 1)
        c.above("epochs", 0)
        c.at_least("eval_interval", 0, "0 evaluates only at step 0 and at the end")
        c.at_least("eval_windows", 1)
        c.at_least("log_interval", 1)
        c.writable_directory("out_dir")
        c.at_least("seed", 0)
        c.above("peak_tflops", 0)
        c.at_least("save_interval", 0, "0 saves only at the end")
        c.at_least("keep_checkpoints", 1)
        c.not_empty("resume")
        c.that(self.init_from is None or os.path.isdir(self.init_from), "init_from", "be a folder holding a Hugging "
               "Face checkpoint (config.json and model.safetensors)", "point it at one, e.g. written by "
               "save_pretrained or python -m scripts.export")
        c.at_least("stop_at_step", 1)
        c.that(self.stop_at_step is None or self.epochs is not None or self.stop_at_step <= self.max_steps,
               "stop_at_step",
               f"be <= train.max_steps={self.max_steps}", "lower train.stop_at_step or raise train.max_steps")
        c.at_least("dist_timeout_s", 1)
        c.at_least("mlp_tiles", 1)
        c.one_of("sdpa_backend", ("auto", *SDPA_BACKENDS))
        c.one_of("on_nonfinite", NONFINITE_POLICIES)
        c.at_least("max_skipped_steps", 1)
        c.at_least("max_rewinds", 1)
        c.that(self.spike_factor == 0 or self.spike_factor > 1, "spike_factor", "be above 1 (a loss that many times "
               "its recent mean is a spike), or 0 to watch no spikes", "set train.spike_factor to 3, say, or 0")
        c.at_least("spike_window", 1)
        c.at_least("spike_min_rise", 0, "0: the factor alone decides")
        c.one_of("on_spike", SPIKE_POLICIES)


@dataclass
class PreferenceConfig:
    """Preference tuning's settings (train.objective dpo, ipo, simpo; training/objectives/preference.py), and a
    reward model's (train.objective reward; training/objectives/reward.py)."""
    beta: float = 0.1  # how far from the reference the policy may go (dpo, ipo); simpo's reward scale
    label_smoothing: float = 0.0  # dpo, simpo: the chance a pair's preference is wrong (conservative DPO)
    gamma: float = 0.5  # simpo: the target margin of the rewards
    sft_weight: float = 0.0  # adds this times the chosen answer's loss per token (RPO: TRL's rpo_alpha)
    # reward: adds this times (r_chosen + r_rejected)^2, which keeps the scores near 0 (TRL's
    # center_rewards_coefficient)
    center_rewards: float = 0.0

    def check(self, c: Checks) -> None:
        c.above("beta", 0)
        c.in_range("label_smoothing", 0.0, 0.5, high_open=True)
        c.at_least("gamma", 0)
        c.at_least("sft_weight", 0, "0 adds no supervised term")
        c.at_least("center_rewards", 0, "0 adds no centering term")


@dataclass
class RLConfig:
    """Online RL's settings (train.objective grpo, rloo; training/objectives/rl.py, docs/rl.md)."""
    group_size: int = 8  # answers sampled a prompt, compared with each other (TRL's num_generations)
    temperature: float = 1.0  # of the rollouts, and of the log-probabilities the loss reads (as TRL)
    top_p: float = 1.0
    max_new_tokens: int = 64  # an answer's most tokens; one cut there counts as truncated
    reward: str = "exact_match"  # exact_match (the record's "answer"), or module:function(record, completion)
    reward_model: Optional[str] = None  # an export of train.objective=reward: its score is the reward instead
    scale_rewards: str = "group"  # group: advantages divided by the group's standard deviation; none
    loss_type: str = "dapo"  # dapo: a mean over the global batch's answer tokens; grpo: per answer, then over them
    epsilon: float = 0.2  # the clip of the ratio to the rollouts' policy
    epsilon_high: Optional[float] = None  # its upper side (DAPO's clip-higher); null: epsilon
    beta: float = 0.0  # the weight of the KL to the starting model (0: no reference kept)
    epochs: int = 1  # steps a batch of rollouts is trained on (TRL's num_iterations)

    def check(self, c: Checks) -> None:
        c.at_least("group_size", 2, "answers of one prompt are compared with each other")
        c.above("temperature", 0)
        c.above("top_p", 0)
        c.in_range("top_p", 0, 1)
        c.at_least("max_new_tokens", 1)
        c.not_empty("reward")
        c.one_of("scale_rewards", ("group", "none"))
        c.one_of("loss_type", ("dapo", "grpo"))
        c.in_range("epsilon", 0, 1, high_open=True)
        c.at_least("epsilon_high", 0)
        c.at_least("beta", 0, "0 keeps no reference")
        c.at_least("epochs", 1)


@dataclass
class SampleConfig:
    """Text printed at the end of training."""
    prompt: str = "\n"
    # A user message: the run ends with the model's answer through its dataset's chat template instead (sample.py
    # --chat's), up to its end of turn; a conversation dataset's alone.
    chat: Optional[str] = None
    max_new_tokens: int = 300
    temperature: float = 0.8
    top_k: Optional[int] = 200
    top_p: float = 1.0  # nucleus sampling: 1 keeps every token top_k keeps
    seed: int = 0

    def check(self, c: Checks) -> None:
        # Whether the prompt encodes with the dataset's tokenizer is checked once the data is open
        # (training/startup.py).
        c.not_empty("prompt")
        c.that(self.chat is None or bool(self.chat.strip()), "chat", "be a user message or null",
               "write a message in sample.chat, or leave it out")
        c.at_least("max_new_tokens", 0)
        c.at_least("temperature", 0, "0 takes the most likely token")
        c.at_least("top_k", 1)
        c.above("top_p", 0)
        c.in_range("top_p", 0, 1)
        c.at_least("seed", 0)


@dataclass
class EvalConfig:
    """Multiple-choice tasks scored at every evaluation (training/evaluation/multiple_choice.py), beside the losses."""
    # "hellaswag" (downloaded once into data_dir), or a JSONL file in HellaSwag's format (data/tasks.py).
    tasks: list[str] = field(default_factory=list)
    limit: Optional[int] = None  # the first N examples of each task: a quicker, noisier signal
    data_dir: str = "data/eval"  # where hellaswag's validation set is downloaded, or placed by hand offline

    def check(self, c: Checks) -> None:
        c.that(all(isinstance(t, str) and t.strip() for t in self.tasks), "tasks", "name hellaswag or JSONL files",
               "list them, e.g. eval.tasks=[hellaswag,data/eval/shakespeare.jsonl]")
        names = [task_name(t) for t in self.tasks]
        twice = sorted({n for n in names if names.count(n) > 1})
        c.that(not twice, "tasks", f"name each task once (files of one name report alike: {', '.join(twice)})",
               "rename one of the files")
        c.at_least("limit", 1)
        c.not_empty("data_dir")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def parse_args(argv=None) -> argparse.Namespace:
    parser = ToolParser(
        description="Train a preset of configs/ (GPT-2, Llama, its mixture of experts, the encoder stack) through "
                    "DeepSpeed's engine, on one process or under any launcher: pretraining, or what its objective "
                    "says (fine-tuning, preference tuning, a reward model, online RL). By default "
                    "(train.resume=auto) it resumes from train.out_dir's last checkpoint.",
        epilog="Overrides: section.key=value for the run config (e.g. train.max_steps=100), "
               "ds.key=value for the ds_config (e.g. ds.zero_optimization.stage=3).")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="run config YAML (model, data, optim, train; "
                        "default: the quickstart's)")
    parser.add_argument("--ds_config", default=DEFAULT_DS_CONFIG, help="DeepSpeed config JSON (the engine; default: "
                        "zero0.json on a CPU, zero1.json on a GPU)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    # Intermixed: --config and --ds_config may come anywhere among the overrides.
    return parser.parse_intermixed_args(argv)


def load_run_config(path: str, overrides: list[str]) -> RunConfig:
    """Dataclass defaults <- YAML preset <- train.init_from's model <- command line; returns the typed RunConfig
    object. A run that starts from a Hugging Face folder trains the model its config.json describes (init_settings),
    whatever shape the preset gives; the command line's model settings still win, and are checked against it."""
    sections = {f.name for f in fields(RunConfig)}
    whole = [key for key in (o.partition("=")[0] for o in overrides) if key in sections]
    if whole:  # OmegaConf's own error names no key
        raise ConfigError(f"'{whole[0]}' in the command line is a section of settings, not a setting; fix: set one "
                          f"of its keys, e.g. {whole[0]}.{fields(getattr(RunConfig(), whole[0]))[0].name}=...")
    layers = [(path, lambda: read_presets(path, sections)), ("the command line", lambda: read_overrides(overrides))]
    cfg = _merged(layers)
    folder = cfg.train.init_from
    if isinstance(folder, str) and os.path.isdir(folder):
        layers.insert(1, (f"train.init_from={folder}", lambda: OmegaConf.create({"model": init_settings(folder)})))
        cfg = _merged(layers)
    cfg = OmegaConf.to_object(cfg)
    check_run_config(cfg)
    return cfg


def _merged(layers: list) -> DictConfig:
    """The dataclass defaults under each (source, layer) in turn."""
    cfg = OmegaConf.structured(RunConfig)
    for source, layer in layers:
        try:
            cfg = layered(cfg, layer())
        except OmegaConfBaseException as e:
            raise ConfigError(explain_omegaconf_error(e, source, RunConfig)) from None
    return cfg


# What a run starting from a folder chooses itself: its context and what its last layer computes.
RUN_CHOICES = ("block_size", "head")


def init_settings(folder: str) -> dict:
    """The model settings train.init_from's folder tells (its config.json's shape and vocabulary, read as a served
    folder's are), less RUN_CHOICES; none where they cannot be read: the run's own check of the folder then says
    why, and a resumed run, which never reads the folder, goes on."""
    from training.checkpoints.hf_folder import folder_settings

    try:
        settings = folder_settings(folder)
    except ConfigError:
        return {}
    return {key: value for key, value in settings.items() if key not in RUN_CHOICES}


def check_run_config(cfg: RunConfig) -> None:
    """Every section's range checks (its dataclass's `check`); the first bad value raises ConfigError."""
    for section in fields(cfg):
        values = getattr(cfg, section.name)
        values.check(Checks(section.name, values))
    check_architecture(cfg.model, Checks("model", cfg.model))


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """Command-line key=value pairs -> (run config overrides, ds_config overrides without 'ds.')."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value (e.g. train.max_steps=100)")
    run = [o for o in overrides if not o.startswith(DS_PREFIX)]
    ds = [o[len(DS_PREFIX):] for o in overrides if o.startswith(DS_PREFIX)]
    return run, ds
