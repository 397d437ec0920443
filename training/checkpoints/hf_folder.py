"""A Hugging Face model folder this repo did not write (config.json, safetensors weights, tokenizer.json, and the
chat template in chat_template.jinja or tokenizer_config.json, as save_pretrained or a download from the Hub leaves
them), read as an export is: the model its config.json describes, its weights, and its tokenizer and chat template
as a dataset's meta records them. Sampling, serving and evaluation take such a folder where they take an export
(`--export`), as vLLM serves a model's folder.
"""
import json
import os

import torch

from common.checks import ConfigError, json_file
from data.chat_template import ChatTemplate, ChatTemplateError, template_tokens
from data.out_dir import FORMAT
from data.prepare_chat import tokenizer_config, tokenizer_template
from data.readers import InputError
from data.tokenizers import HF_FILE, HFTokenizer, TokenizerError, folder_tokenizer
from model import ARCHITECTURES, architecture, build_empty, build_model
from model.config import ModelConfig
from training.checkpoints import hf

SOURCE = "--export"
# Tensors a folder may hold that no model computes: rotary frequencies older checkpoints saved as weights.
NOT_WEIGHTS = (".rotary_emb.inv_freq",)
# The answer rendered to find the token that ends an assistant's turn (answer_end).
ANSWER = "Fine, thank you."


def is_hf_folder(folder: str | None) -> bool:
    """Whether `folder` holds a Hugging Face model's config.json (its model_type named) that is not this repo's
    export's (which records its `megalite` model)."""
    path = os.path.join(folder or "", "config.json")
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read())
    except (OSError, ValueError):  # none, or not JSON: the export's reader says which
        return False
    return isinstance(record, dict) and "megalite" not in record and "model_type" in record


def load_hf_folder(folder: str, context: int | None = None, dtype: torch.dtype = torch.float32) -> tuple:
    """(model config, model holding the folder's weights on the CPU at `dtype`, tokenizer, meta): load_trained's
    answer for a Hugging Face folder. `context` caps a rotary model's block_size, the context it serves (a model whose
    positions are a table keeps its rows)."""
    cfg = folder_model(folder, context)
    meta, tokenizer = folder_meta(folder, cfg)
    model = build_empty(cfg, dtype)
    hf.load_into(model, folder, cfg)  # every tensor: folder_model found each one the model holds there
    return cfg, model.eval(), tokenizer, meta


def folder_model(folder: str, context: int | None = None) -> ModelConfig:
    """The model a folder's config.json describes (folder_settings), the rest of its settings the defaults."""
    return ModelConfig(**folder_settings(folder, context))


def folder_settings(folder: str, context: int | None = None) -> dict:
    """The model settings a folder's config.json tells, in the layout of its class whose tensors the folder holds,
    every one of them (a tensor this repo would not read, an attention bias say, is refused), checked as
    train.init_from checks a folder (shapes, RoPE, norms, what the class computes and this repo does not)."""
    config = hf.folder_config(folder, SOURCE)
    model_type = config.get("model_type")
    family, layouts = hf.hf_layouts().get(model_type, (None, []))
    if family is None:
        raise ConfigError(f"{SOURCE} {folder} holds a {model_type!r} model (config.json's model_type), which this repo "
                          f"does not compute; fix: pass a model of one of its classes ({', '.join(hf.hf_layouts())})")
    shapes = {name: shape for name, shape in hf.folder_shapes(folder, SOURCE).items() if not name.endswith(NOT_WEIGHTS)}
    found = set(shapes)
    readings = [_layout_settings(folder, config, family, layout, context) for layout in layouts]
    models = [ModelConfig(**settings) for settings in readings]
    for settings, cfg in zip(readings, models):
        if _tensors(cfg, found) == found:
            with torch.device("meta"):  # shapes only
                expected = hf.to_hf(dict(build_model(cfg).named_parameters()), cfg)
            for name, tensor in expected.items():
                if shapes[name] != tuple(tensor.shape):
                    raise ConfigError(f"{SOURCE} {folder}: its tensor {name} has shape {list(shapes[name])}, the "
                                      f"model its config.json describes {list(tensor.shape)}; fix: save the model "
                                      f"again (save_pretrained)")
            hf.check_hf_folder(folder, cfg, SOURCE)  # its RoPE, its norms, what its class computes and this repo not
            return settings
    names = _tensors(models[0], found)
    if names - found:
        raise ConfigError(f"{SOURCE} {folder}: its weights lack {min(names - found)}, which the model its config.json "
                          f"describes holds; fix: save the model again (save_pretrained)")
    raise ConfigError(f"{SOURCE} {folder}: its weights hold {min(found - names)}, which this repo's {model_type!r} "
                      f"model does not compute (a bias, say, of another variant of the class); fix: pass a model of "
                      f"the class as transformers' own config describes it")


def _tensors(cfg: ModelConfig, found: set) -> set:
    """Hugging Face's names of the model's tensors, and a tied model's lm_head where the folder holds one (transformers
    ties it to the embedding, its copy unread)."""
    names = {theirs for _, theirs, _ in hf.tensor_pairs(cfg)}
    return names | ({"lm_head.weight"} & found if architecture(cfg).ties(cfg) else set())


def _layout_settings(folder: str, config: dict, family: str, layout, context: int | None) -> dict:
    """The settings of `config` read in `layout` (one of the architecture `family`'s), a rotary model's context at
    most `context`."""
    try:
        settings = {"arch": family, **layout.read(config), **dict(layout.settings)}
    except KeyError as e:
        raise ConfigError(f"{SOURCE} {folder}: its config.json lacks {e}, which a {layout.model_type!r} model's shape "
                          f"needs; fix: save the model's config again (save_pretrained)") from None
    except ConfigError as e:
        raise ConfigError(f"{SOURCE} {folder}: {e}; fix: pass another model") from None
    if layout.scorer in (config.get("architectures") or []):  # a reward model's folder (TRL's)
        settings["head"] = "score"
    if context is not None and ARCHITECTURES[family].rope:
        settings["block_size"] = min(settings["block_size"], context)
    return settings


def folder_meta(folder: str, cfg: ModelConfig) -> tuple[dict, HFTokenizer]:
    """(a dataset's meta of the folder's tokenizer.json, with the chat record of its chat template where it has one;
    the tokenizer). A TokenizerError says why the tokenizer cannot be read."""
    path = os.path.join(folder, HF_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"{SOURCE} {folder} holds no {HF_FILE}, the model's tokenizer; fix: save it beside the "
                          f"weights (tokenizer.save_pretrained), as the Hub's model folders hold it")
    tokenizer = HFTokenizer.from_file(path)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ConfigError(f"{SOURCE} {folder}: its {HF_FILE} holds {tokenizer.vocab_size:,} ids, its model's "
                          f"embedding {cfg.vocab_size:,} rows; fix: pass the tokenizer the model was trained with")
    meta = {"format": FORMAT, "tokenizer": HF_FILE, "tokenizer_fingerprint": tokenizer.fingerprint(),
            "vocab_size": tokenizer.vocab_size, "delimiter": tokenizer.delimiter, **tokenizer.meta()}
    chat = _chat_record(folder, tokenizer, cfg.block_size)
    ends = generation_ends(folder, tokenizer.vocab_size)
    return {**meta, **({"stop_ids": ends} if ends else {}), **({"chat": chat} if chat else {})}, tokenizer


def generation_ends(folder: str, vocab_size: int) -> list[int]:
    """The ids that end the model's answers by its generation_config.json (eos_token_id: one, or a list), as
    transformers' generate and vLLM stop at them; none where it names none."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return []
    ends = json_file(path, f"{SOURCE}'s generation config", "correct it, or remove it").get("eos_token_id")
    ends = [ends] if isinstance(ends, int) else ends or []
    if not all(isinstance(i, int) and 0 <= i < vocab_size for i in ends):
        raise ConfigError(f"{SOURCE} {folder}: its generation_config.json's eos_token_id is {ends}, not ids of its "
                          f"tokenizer (0 to {vocab_size - 1}); fix: correct it, or remove it")
    return ends


def _chat_record(folder: str, tokenizer: HFTokenizer, context: int) -> dict | None:
    """What a conversation dataset's meta records under "chat" (data/prepare_chat.py) that rendering reads, for the
    folder's chat template (None: it has none, a base model's folder)."""
    fix = "correct the folder's chat template, or remove it to serve the model for completions alone"
    try:
        found = tokenizer_template(folder, fix)
        if found is None:
            return None
        config = tokenizer_config(folder, fix)
        template = ChatTemplate(found[1], template_tokens(config[1]) if config else None)
    except InputError as e:
        raise ConfigError(f"{SOURCE} {folder}: {e}") from None
    except ChatTemplateError as e:
        raise ConfigError(f"{SOURCE} {folder}: {e.describe(f'its chat template {found[0]}', '')}; fix: {fix}") from None
    end = answer_end(template, tokenizer, f"{SOURCE} {folder}")
    return {"template": found[0], "chat_template": found[1], "special_tokens": template.special_tokens,
            "end_of_turn_id": end, "end_of_turn": tokenizer.decode([end]), "context": context}


def answer_end(template: ChatTemplate, tokenizer: HFTokenizer, where: str) -> int:
    """The token that ends an assistant's turn, where its answers stop: the special token the template writes right
    after an answer's text (Qwen's <|im_end|>, Llama 3's <|eot_id|>, Mistral's </s>), else the tokenizer's
    eos_token."""
    special = {i for i, token in tokenizer.tokenizer.get_added_tokens_decoder().items() if token.special}
    try:
        text, _ = template.render([{"role": "user", "content": "Hello."}, {"role": "assistant", "content": ANSWER}])
    except ChatTemplateError:  # a template that takes no such conversation: its eos_token is all there is
        text = ""
    if ANSWER in text:
        ids, offsets = tokenizer.encode_with_offsets(text)
        after = text.rindex(ANSWER) + len(ANSWER)
        following = next((i for i, (start, _) in zip(ids, offsets) if start >= after), None)
        if following in special:
            return following
    eos = template.special_tokens.get("eos_token")
    ids = tokenizer.encode(eos) if eos else []
    if len(ids) == 1:
        return ids[0]
    raise ConfigError(f"{where}: its chat template writes no special token after an answer and its "
                      f"tokenizer_config.json names no eos_token, so where an answer ends is unknown; fix: set "
                      f"eos_token there to the token that ends the model's turns")


def check_dataset_tokenizer(folder: str, meta: dict) -> None:
    """A ConfigError where the dataset (`meta`) of a run starting from `folder` was prepared with another tokenizer
    than the folder's (its tokenizer.json, or an export's record), told by their ids' count; a folder without a
    tokenizer is not checked."""
    try:
        tokenizer = folder_tokenizer(folder)
    except TokenizerError:
        return
    if tokenizer.vocab_size != meta["vocab_size"]:
        raise ConfigError(f"train.init_from={folder}: its tokenizer holds {tokenizer.vocab_size:,} ids, the dataset's "
                          f"{meta['vocab_size']:,}: the dataset was prepared with another tokenizer; fix: prepare it "
                          f"with the folder's (python -m data.prepare ... --tokenizer {folder})")
