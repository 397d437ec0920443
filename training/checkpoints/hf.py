"""This repo's weights and settings <-> Hugging Face's layout, both directions, for each architecture that has
one (its Architecture's `hf`: the GPT's `GPT2LMHeadModel`; the Llama's `LlamaForCausalLM`, with q/k/v biases
`Qwen2ForCausalLM`, with per-head norms `Qwen3ForCausalLM`, with experts `MixtralForCausalLM`, `Qwen3MoeForCausalLM`
or `Qwen2MoeForCausalLM`). Used by export.py,
sample.py and `train.init_from`; `transformers` itself is never imported here (it is a test-only dependency: the
tests load what this writes with it).

The architecture's table pairs each of our tensor names with Hugging Face's and how it moves: as it is,
transposed (GPT-2's Conv1D stores (in, out)), or cut to / padded from the real vocabulary (our embedding
and head have `padded_vocab_size` rows; the padding is exported away and imported as zeros).
"""
import os

import torch
from deepspeed.runtime.zero import GatheredParameters
from safetensors import SafetensorError, safe_open

from common.checks import ConfigError, existing_file, json_file
from model import ARCHITECTURES, architecture, build_model, layer_names, model_layers
from model.architecture import TRANSPOSED, VOCAB_ROWS
from model.config import ModelConfig
from model.llama import LLAMA3_ROPE, rope_of
from model.lora import is_adapter
from model.moe import global_expert_names
from model.tensor_parallel import SINGLE, TensorParallel, shard_parameter, split_rule


def hf_layouts() -> dict[str, tuple]:
    """Hugging Face's model_type -> (the model.arch that reads it, its layouts: Qwen2-MoE's two, with q/k/v biases
    and without, which read a folder alike)."""
    out = {}
    for a in ARCHITECTURES.values():
        for hf in a.hf:
            out.setdefault(hf.model_type, (a.name, []))[1].append(hf)
    return out


def tensor_pairs(cfg: ModelConfig) -> list[tuple[str, str, str]]:
    """(our name, Hugging Face's name, how it moves) for every tensor of the model, in layer order, read off
    the model's layer list."""
    arch = architecture(cfg)
    layout = arch.hf_layout(cfg)
    if layout is None:
        raise ConfigError(f"no Hugging Face layout holds this model.arch={cfg.arch!r} model (those of {arch.title}: "
                          f"{', '.join(dict.fromkeys(hf.model_type for hf in arch.hf)) or 'none'}, each with the "
                          f"settings its class computes)")
    layout.check(cfg)
    specs = model_layers(cfg)
    pairs, block = [], 0
    for prefix, spec in zip(layer_names(specs), specs):
        if getattr(spec, "forward_fn", None):  # a tied layer's reuse (the LM head): its tensors are paired
            continue
        kind = spec.typename
        for ours, theirs, how in layout.pairs(spec):
            experts = range(cfg.n_experts) if "{e}" in ours else [None]  # an expert's tensors: one pair each
            pairs += [(f"{prefix}.{ours.format(e=e)}", theirs.format(i=block, e=e), how) for e in experts]
        block += kind is arch.block
    return pairs


def to_hf(state: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {}
    for ours, theirs, how in tensor_pairs(cfg):
        tensor = state[ours]
        out[theirs] = tensor.t() if how == TRANSPOSED else tensor[: cfg.vocab_size] if how == VOCAB_ROWS else tensor
    return {name: tensor.contiguous() for name, tensor in out.items()}


def from_hf(hf: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of to_hf, the vocabulary padding restored as zero rows."""
    return {ours: _to_ours(hf[theirs], how, cfg) for ours, theirs, how in tensor_pairs(cfg)}


def _to_ours(tensor: torch.Tensor, how: str, cfg: ModelConfig) -> torch.Tensor:
    if how == VOCAB_ROWS:
        padded = torch.zeros(cfg.padded_vocab_size, tensor.size(1), dtype=tensor.dtype)
        padded[: tensor.size(0)] = tensor
        return padded
    return (tensor.t() if how == TRANSPOSED else tensor).contiguous()


# Special tokens per tokenizer kind (meta.json's "tokenizer"): the character tokenizer has none, GPT-2's
# BPE one end-of-text token that opens and closes documents. A meta.json that records its tokenizer's
# end-of-text and begin-of-text ids ("eot_id", "bos_id") is taken at its word.
SPECIAL_TOKENS = {"char": {}, "gpt2": {"bos_token_id": 50256, "eos_token_id": 50256}}


def special_token_ids(meta: dict) -> dict:
    ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    ids.update(SPECIAL_TOKENS.get(meta.get("tokenizer"), {}))
    if meta.get("eot_id") is not None:
        ids["eos_token_id"] = ids["bos_token_id"] = meta["eot_id"]
    if meta.get("bos_id") is not None:
        ids["bos_token_id"] = meta["bos_id"]
    if "chat" in meta:  # a fine-tuned model's answers end with the template's end of turn
        ids["eos_token_id"] = meta["chat"]["end_of_turn_id"]
    return ids


def score_pad_id(meta: dict) -> int:
    """The pad_token_id of a model with a score head: the tokenizer's end of text (TRL pads a reward model's batch
    with its end of sequence), else its beginning of text, else id 0. transformers' *ForSequenceClassification
    reads a row's score at its last token that is not this id, and so does this repo (training/objectives/
    reward.py): a sequence that ends with it (an appended end of text) is scored at the token before, alike."""
    ids = special_token_ids({key: value for key, value in meta.items() if key != "chat"})  # not the end of turn
    return next((i for i in (ids["eos_token_id"], ids["bos_token_id"]) if i is not None), 0)


def hf_config(cfg: ModelConfig, meta: dict) -> dict:
    """config.json for transformers, special token ids from the dataset's tokenizer meta; a score head's model
    as *ForSequenceClassification with one label, and the pad id its score is read by."""
    hf = architecture(cfg).hf_layout(cfg)
    config = {"architectures": [hf.architecture], "vocab_size": cfg.vocab_size, "initializer_range": 0.02,
              "tie_word_embeddings": architecture(cfg).ties(cfg), "dtype": "float32", **special_token_ids(meta),
              "model_type": hf.model_type, **hf.config(cfg)}
    if cfg.head == "score":
        config.update(architectures=[hf.scorer], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0},
                      pad_token_id=score_pad_id(meta))
    return config


# Tensors a folder may lack: a score head that train.init_from starts from a causal LM begins at its own init.
FRESH = ("score.weight",)


WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
# How messages name the setting or flag that gave the folder: a run's, or a command's (--export).
INIT_FROM = "train.init_from"


def folder_fix(source: str) -> str:
    return (f"point {source} at a Hugging Face checkpoint saved with safetensors, e.g. by save_pretrained or python -m "
            f"scripts.export")


def weight_files(folder: str, source: str = INIT_FROM) -> dict[str, str]:
    """Each tensor's safetensors file: one model.safetensors, or the shards its index names."""
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        weight_map = json_file(index, f"{source}'s index", folder_fix(source), keys=("weight_map",))["weight_map"]
        return {name: os.path.join(folder, file) for name, file in weight_map.items()}
    return {name: os.path.join(folder, WEIGHTS) for name in tensor_shapes(os.path.join(folder, WEIGHTS), source)}


def tensor_shapes(path: str, source: str = INIT_FROM) -> dict[str, tuple]:
    """The tensors of a safetensors file and their shapes, read from its header; one line if it is not one."""
    existing_file(path, f"{source}'s weights", folder_fix(source))
    try:
        with safe_open(path, framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{source}'s weights {path} are not a safetensors file ({e}); fix: "
                          f"{folder_fix(source)}") from None


def folder_shapes(folder: str, source: str = INIT_FROM) -> dict[str, tuple]:
    """Every tensor of a folder's safetensors files (one, or an index's shards) and its shape."""
    found = {}
    for path in sorted(set(weight_files(folder, source).values())):
        found.update(tensor_shapes(path, source))
    return found


def _check_experts(named: str, config: dict, theirs, cfg: ModelConfig) -> None:
    """The folder's experts, routed and shared (`theirs`: its layout), and their number per token are this run's."""
    experts, shared = theirs.folder_experts(config)
    layout = architecture(cfg).hf_layout(cfg)
    ours = repr(layout.model_type) if layout else f"model.arch={cfg.arch}"
    if experts != cfg.n_experts:
        raise ConfigError(f"{named} holds a {config.get('model_type')!r} model with {experts} "
                          f"experts, this run's {ours} model has {cfg.n_experts} (model.n_experts): set "
                          f"model.n_experts={experts} (and its shape) or pick another folder")
    if shared != cfg.n_shared_experts:
        raise ConfigError(f"{named} holds a {config.get('model_type')!r} model whose shared expert is "
                          f"{shared:g} experts wide (0: none), this run's {ours} model's "
                          f"{cfg.n_shared_experts} (model.n_shared_experts): set model.n_shared_experts={shared:g} or "
                          f"pick another folder")
    if experts and config.get("num_experts_per_tok") != cfg.experts_per_token:
        raise ConfigError(f"{named} routes each token to {config.get('num_experts_per_tok')} experts "
                          f"(num_experts_per_tok), this run to {cfg.experts_per_token}: set "
                          f"model.experts_per_token={config.get('num_experts_per_tok')}")


def _check_rope(named: str, config: dict, ours: dict | None) -> None:
    """The folder's rotary frequencies are this run's (`ours`: its rope_parameters; None: no RoPE): the same kind,
    and for Llama 3.1's scaling the same four numbers. Older config.json files name them rope_scaling."""
    if ours is None:
        return
    theirs = rope_of(config)
    kind = theirs.get("rope_type", theirs.get("type", "default"))
    if kind == ours["rope_type"] == "llama3":
        fix = " ".join(f"model.{name}={theirs[key]}" for key, name in LLAMA3_ROPE.items()
                       if key in theirs and float(theirs[key]) != float(ours[key]))
    elif kind == ours["rope_type"]:
        return
    elif kind == "llama3":
        fix = " ".join(f"model.{name}={theirs[key]}" for key, name in LLAMA3_ROPE.items() if key in theirs)
    elif kind == "default":
        fix = "model.rope_scale_factor=null"
    else:
        raise ConfigError(f"{named}: its RoPE is {kind!r}, which this repo does not compute (Llama "
                          f"3.1's scaling, model.rope_scale_factor, or none): pick another folder")
    if fix:
        raise ConfigError(f"{named}: its RoPE is {kind!r} ({theirs}), this run's "
                          f"{ours['rope_type']!r} ({ours}): set {fix}")


def _check_layout(named: str, config: dict, theirs: list, cfg: ModelConfig):
    """The folder's layout (of `theirs`, its class's) that holds this run's model: its attention computes what this
    run's model does (Qwen3's norms...), else the fix named from its layout nearest this run's settings. The tensors
    are read by the names of the run's own layout, which a layout holding the same model shares (a Mistral's are a
    Llama's)."""
    ours = architecture(cfg).hf_layout(cfg)
    holding = next((hf for hf in theirs if hf.holds(cfg)), None) if ours is not None else None
    if holding is None:
        differences = [[(name, value) for name, value in hf.settings if getattr(cfg, name) != value] for hf in theirs]
        fix = " ".join(f"model.{name}={str(value).lower()}" for name, value in min(differences, key=len))
        where = f"the {ours.model_type!r} layout" if ours else "no Hugging Face layout"
        raise ConfigError(f"{named} holds a {config.get('model_type')!r} model, this run's model "
                          f"has {where}: set {fix} or pick another folder")
    return holding


def folder_config(folder: str, source: str = INIT_FROM) -> dict:
    """A Hugging Face checkpoint's config.json, the folder checked to hold one and its safetensors weights."""
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path) or not any(os.path.isfile(os.path.join(folder, f)) for f in (WEIGHTS, INDEX)):
        raise ConfigError(f"{source}={folder}: no config.json and {WEIGHTS} (or {INDEX} and its shards) "
                          f"there: a Hugging Face checkpoint saved with safetensors, e.g. by save_pretrained or "
                          f"python -m scripts.export")
    return json_file(config_path, f"{source}'s config", folder_fix(source))


def check_hf_folder(folder: str, cfg: ModelConfig, source: str = INIT_FROM) -> None:
    """A Hugging Face checkpoint `source` (train.init_from, or a command's flag) can start this model from: same
    family, every tensor present with this model's shape (the first that is not is named), same norm and RoPE
    settings."""
    config, named = folder_config(folder, source), f"{source}={folder}"
    family, theirs = hf_layouts().get(config.get("model_type"), (None, []))
    if family != cfg.arch:
        raise ConfigError(f"{named} holds a {config.get('model_type')!r} model, this run builds "
                          f"model.arch={cfg.arch}: set model.arch={family} (and its shape) or pick another folder")
    _check_experts(named, config, theirs[0], cfg)
    layout = _check_layout(named, config, theirs, cfg)
    with torch.device("meta"):  # the run's own tensors, shapes only
        expected = to_hf(dict(build_model(cfg).named_parameters()), cfg)
    found = folder_shapes(folder, source)
    vocab = {theirs for _, theirs, how in tensor_pairs(cfg) if how == VOCAB_ROWS}
    for name, tensor in expected.items():
        if name not in found and name in FRESH:
            continue
        if name not in found:
            raise ConfigError(f"{named}: tensor {name} is missing there; this run's model config "
                              f"(model.*) needs it: match the folder's config.json")
        if name in vocab and found[name][1:] == tuple(tensor.shape[1:]) and found[name][0] != tensor.shape[0]:
            raise ConfigError(f"{named}: its vocabulary holds {found[name][0]:,} ids, this run's "
                              f"model {tensor.shape[0]:,} (model.vocab_size, the dataset's unless set): the dataset "
                              f"was prepared with another tokenizer; fix: prepare it with the folder's (python -m "
                              f"data.prepare ... --tokenizer {folder})")
        if found[name] != tuple(tensor.shape):
            raise ConfigError(f"{named}: tensor {name} has shape {list(found[name])} there, "
                              f"{list(tensor.shape)} in this run's model config: match model.* to the folder's "
                              f"config.json")
    layout.check_folder(config, cfg, named)
    ours = hf_config(cfg, {})
    _check_rope(named, config, ours.get("rope_parameters"))
    for key, value in (("rms_norm_eps", config.get("rms_norm_eps")), ("rope_theta", rope_of(config)["rope_theta"])):
        if key in ours and value is not None and float(value) != float(ours[key]):
            raise ConfigError(f"{named}: {key} is {value} there, {ours[key]} in this run's model "
                              f"config: set model.{'norm_eps' if key == 'rms_norm_eps' else key}={value}")




def load_into(model: torch.nn.Module, folder: str, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> list[str]:
    """Copy a checked Hugging Face checkpoint into a freshly built model, before deepspeed.initialize, one
    tensor at a time from the memory-mapped files. A pipeline stage holds, and so reads, only its own
    layers, a tensor rank its slice of each; under ZeRO-3 (each layer partitioned as it is built) each
    parameter is gathered, written by rank 0 and partitioned again (GatheredParameters is a no-op otherwise).
    Returns the FRESH tensors (Hugging Face's names) the folder lacks, which keep their initialization."""
    files, pairs = weight_files(folder), {ours: (theirs, how) for ours, theirs, how in tensor_pairs(cfg)}
    experts = global_expert_names(model)  # an expert-parallel rank's experts are numbered from its first
    fresh = sorted(name for name in FRESH if name in {theirs for theirs, _ in pairs.values()} and name not in files)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter(name):  # LoRA's adapters keep their initialization: the folder's model is the one adapted
                continue
            theirs, how = pairs[experts.get(name, name)]
            if theirs in fresh:
                continue
            with safe_open(files[theirs], framework="pt") as f:
                tensor = shard_parameter(_to_ours(f.get_tensor(theirs), how, cfg), split_rule(param), tp)
            with GatheredParameters([param], modifier_rank=0):
                param.copy_(tensor)
    return fresh
