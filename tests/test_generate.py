"""Generation: the sampling rules (temperature, top-k, top-p, over the real vocabulary only; min_p, the penalties,
logit biases and min_tokens as transformers' logits processors and OpenAI's formula give them); the key/value cache,
whose logits equal a forward pass over the whole window at every step (fp32, 1e-5) for the GPT and the Llama with
grouped-query attention, several sequences of different lengths at once, a prompt of several documents, a
sequence sliding past block_size; and greedy text equal to transformers' generate on the export (the GPT, the Llama,
Mixtral, Qwen2-MoE), with a repetition penalty, biases and min_tokens too, and the frequency and presence
penalties as a plain loop over the transformers model gives them."""
import dataclasses

import numpy as np
import pytest
import torch

from data.documents import Documents
from hf_check import load_in_transformers
from model import build_model
from model.config import ModelConfig
from model.generate import CachedDecoder, Sampling, WindowDecoder, decoder_for, generate, shaped
from training.checkpoints.export import write_export

CPU = torch.device("cpu")
GPT = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=20)
LLAMA = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64, block_size=16,
                    vocab_size=20)
MIXTRAL = dataclasses.replace(LLAMA, n_experts=4, expert_hidden=48)  # DeepSpeed's MoE layer, top-2
QWEN2_MOE = dataclasses.replace(MIXTRAL, experts_per_token=3, n_shared_experts=1)  # top-3, a shared expert
QWEN3 = dataclasses.replace(LLAMA, head_dim=16, qk_norm=True)  # per-head norms, heads wider than n_embd / n_head
QWEN2 = dataclasses.replace(LLAMA, qkv_bias=True)
MODELS = {"gpt": GPT, "llama_gqa": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE}
EOT = 3  # the documents' delimiter below: the token after it starts the next document
DOCUMENTS = Documents({"delimiter": "eot", "eot_id": EOT})


class FixedLogits:
    """A 'model' whose next-token logits are one fixed row (padded vocabulary: 8 real ids + 8 padding ids
    whose logits are the largest, as an untrained head can make them)."""

    def __init__(self, row: torch.Tensor):
        self.row = row

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        return self.row.expand(idx.size(0), idx.size(1), -1)


ROW = torch.tensor([0.3, 2.0, -1.0, 1.5, 0.0, 1.9, -3.0, 0.5])


def draws(sampling: Sampling, n: int = 4000) -> set[int]:
    decoder = WindowDecoder(FixedLogits(torch.cat([ROW, torch.full((8,), 50.0)])), 8, 8, CPU)
    generator = torch.Generator().manual_seed(0)
    return {token for _ in range(n) for token in generate(decoder, [0], sampling, generator)}


def test_temperature_zero_takes_the_most_likely_real_token():
    assert draws(Sampling(4, temperature=0), n=1) == {1}  # logit 2.0 at id 1; never a padding id (50.0)


def test_top_k_and_top_p_draw_only_from_their_tokens_and_never_padding():
    assert draws(Sampling(1, top_k=3)) == {1, 3, 5}  # the three best logits (2.0, 1.9, 1.5), each drawn
    assert draws(Sampling(1)) == set(range(8))  # no top-k: every real id, still no padding id
    assert max(draws(Sampling(1, top_k=100), n=50)) < 8  # top_k beyond the vocabulary
    probs = torch.softmax(ROW, 0).sort(descending=True)
    kept = {int(i) for i, before in zip(probs.indices, probs.values.cumsum(0) - probs.values) if before < 0.7}
    assert len(kept) == 3 and draws(Sampling(1, top_p=0.7)) == kept  # the fewest whose mass reaches 0.7
    assert draws(Sampling(1, top_p=0.7, top_k=2)) == {1, 5}


@pytest.mark.parametrize("setting,value,message", [
    ("temperature", -0.5, "temperature=-0.5: must be >= 0 (0: greedy)"), ("top_p", 0.0, "top_p=0.0: must be in (0, 1]"),
    ("top_p", 1.5, "top_p=1.5: must be in (0, 1]"), ("top_k", 0, "top_k=0: must be at least 1"),
    ("max_new_tokens", -1, "max_new_tokens=-1: must be >= 0")])
def test_sampling_settings_out_of_range_are_refused(setting, value, message):
    with pytest.raises(ValueError) as e:
        Sampling(**{"max_new_tokens": 4, setting: value})
    assert str(e.value) == message


def test_a_stop_id_ends_the_sequence_and_stays_its_last_token():
    decoder = WindowDecoder(FixedLogits(ROW), 8, 8, CPU)
    assert generate(decoder, [0], Sampling(10, temperature=0, stop_ids=(1,))) == [1]
    assert generate(decoder, [0], Sampling(0)) == []


def test_penalties_biases_and_min_tokens_change_the_logits_as_transformers_and_openai_say():
    from transformers import (
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 3
    prompt, answer = [4, 9, 9, 17], [9, 21, 30, 21, 21]
    ids = torch.tensor([prompt + answer])

    def ours(**options):
        return shaped(logits, Sampling(16, stop_ids=(2, 40), **options), prompt, answer)

    def theirs(processor):
        return processor(ids, logits[None].clone())[0]

    assert torch.equal(ours(), logits)
    assert torch.equal(ours(repetition_penalty=1.7), theirs(RepetitionPenaltyLogitsProcessor(1.7)))
    assert torch.equal(ours(logit_bias=((3, 5.0), (21, -100))),
                       theirs(SequenceBiasLogitsProcessor({(3,): 5.0, (21,): -100.0})))
    for min_tokens in (5, 6):  # the answer has 5 tokens: a sixth may not end it yet
        assert torch.equal(ours(min_tokens=min_tokens),
                           theirs(MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, [2, 40])))
    expected = logits.clone()  # OpenAI's formula: mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty
    for token in set(answer):
        expected[token] -= answer.count(token) * 0.6 + 1.1
    assert torch.allclose(ours(frequency_penalty=0.6, presence_penalty=1.1), expected, rtol=0, atol=1e-6)
    # vLLM's order: the bias first, then the penalty (3 / 2 + 0, not 1 / 2 + 2)
    one = torch.ones(50)
    assert shaped(one, Sampling(1, logit_bias=((4, 2.0),), repetition_penalty=2.0), [4], [])[4] == 1.5


def test_min_p_draws_among_tokens_near_the_most_likely_after_the_temperature():
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper
    for temperature in (1.0, 3.0):
        kept = MinPLogitsWarper(0.3)(None, TemperatureLogitsWarper(temperature)(None, ROW[None].clone()))[0]
        expected = set(torch.nonzero(kept > float("-inf"))[:, 0].tolist())
        assert 1 < len(expected) < 8
        assert draws(Sampling(1, temperature=temperature, min_p=0.3)) == expected
    assert draws(Sampling(1, min_p=1.0), n=50) == {1}


def test_min_tokens_holds_back_the_stop_id_then_lets_it_end_the_answer():
    decoder = WindowDecoder(FixedLogits(ROW), 8, 8, CPU)
    assert generate(decoder, [0], Sampling(10, temperature=0, stop_ids=(1,), min_tokens=3)) == [5, 5, 5, 1]
    assert generate(decoder, [0], Sampling(10, temperature=0, stop_ids=(1,), frequency_penalty=0.5,
                                                min_tokens=2)) == [5, 3, 1]


def model_of(cfg: ModelConfig) -> torch.nn.Module:
    """Random weights large enough that the next token is clear (greedy paths never hang on a near tie)."""
    model = build_model(cfg, seed=1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


@pytest.mark.parametrize("documents", [None, DOCUMENTS], ids=["one_document", "document_masking"])
@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_cached_logits_equal_a_forward_over_the_whole_window_at_every_step(name, documents):
    """Three sequences decoded together from prompts of 5, 1 and 7 tokens (the last of several documents), for
    30 steps of random tokens (delimiters among them), their slots in order (read as a view of the cache) and in
    reverse (gathered) in turn: every step's logits of each are the window's forward pass's, as the sequences
    pass block_size (16) and slide."""
    model = model_of(MODELS[name])
    cached = CachedDecoder(model, 16, 20, slots=3, documents=documents)
    window = WindowDecoder(model, 16, 20, CPU, slots=3, documents=documents)
    prompts = [[1, 2, 4, 5, 6], [7], [EOT, 9, EOT, 11, 12, EOT, 13]]
    started = [(cached.start(p), window.start(p)) for p in prompts]
    worst = max((a - b).abs().max().item() for (_, a), (_, b) in started)
    slots = [slot for (slot, _), _ in started]
    rng = np.random.default_rng(0)
    for step in range(30):
        new = {slot: [int(rng.choice([EOT, *range(4, 20)]))] for slot in (slots if step % 2 else slots[::-1])}
        got, expected = cached.step(new), window.step(new)
        worst = max(worst, *((got[s] - expected[s]).abs().max().item() for s in slots))
    assert worst <= 1e-5, worst
    assert all(len(cached.windows[s]) == 16 for s in slots) and cached.cache.lengths == [16] * 3  # every one slid


@torch.no_grad()
def test_a_prompt_of_several_documents_sees_only_its_last():
    """Under document masking the next token depends on the last document alone: what came before the
    delimiter changes nothing; without documents it does."""
    model = model_of(LLAMA)
    for documents, same in [(DOCUMENTS, True), (None, False)]:
        decoder = CachedDecoder(model, 16, 20, slots=2, documents=documents)
        (_, a), (_, b) = decoder.start([5, 6, EOT, 9, 10]), decoder.start([7, 8, 11, EOT, 9, 10])
        assert torch.allclose(a, b, atol=1e-5) is same


def test_models_without_a_cacheable_attention_decode_over_the_window():
    encoder = build_model(ModelConfig(arch="encoder", n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=20))
    assert type(decoder_for(encoder, 8, 20)) is WindowDecoder
    assert type(decoder_for(build_model(GPT), 16, 20)) is CachedDecoder


@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_greedy_text_equals_transformers_generate_on_the_export(tmp_path, name):
    cfg = dataclasses.replace(MODELS[name], vocab_size=65, block_size=32)
    model = model_of(cfg)
    write_export(str(tmp_path), cfg, model.state_dict(), {"format": 2, "tokenizer": "char", "vocab_size": 65,
                                                          "chars": [chr(32 + i) for i in range(65)]}, step=0)
    prompt = [5, 17, 33, 2]
    ours = generate(decoder_for(model, 32, 65), prompt, Sampling(24, temperature=0))
    theirs = load_in_transformers(str(tmp_path)).generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                                          pad_token_id=0)
    assert ours == theirs[0, len(prompt):].tolist()
    assert len(set(ours)) > 3  # not one token repeated: the comparison has a text to tell apart


@pytest.mark.parametrize("name", ["gpt", "llama_gqa"])
@torch.no_grad()
def test_penalized_greedy_text_equals_transformers_generate_and_a_plain_loop(tmp_path, name):
    """repetition_penalty, logit_bias and min_tokens against transformers' generate (its order of the three gives
    vLLM's logits); the frequency and presence penalties against OpenAI's formula over the transformers model."""
    cfg = dataclasses.replace(MODELS[name], vocab_size=65, block_size=48)
    model = model_of(cfg)
    write_export(str(tmp_path), cfg, model.state_dict(), {"format": 2, "tokenizer": "char", "vocab_size": 65,
                                                          "chars": [chr(32 + i) for i in range(65)]}, step=0)
    hf, prompt = load_in_transformers(str(tmp_path)), [5, 17, 33, 2]
    plain = generate(decoder_for(model, 48, 65), prompt, Sampling(40, temperature=0))
    stop = plain[3]  # greedy draws it fourth: min_tokens holds it back
    sampling = Sampling(40, temperature=0, stop_ids=(stop,), repetition_penalty=1.8, logit_bias=((7, 2.5),),
                        min_tokens=10)
    ours = generate(decoder_for(model, 48, 65), prompt, sampling)
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, repetition_penalty=1.8,
                         sequence_bias={(7,): 2.5}, min_new_tokens=10, eos_token_id=stop, pad_token_id=stop)
    assert ours == theirs[0, len(prompt):].tolist() and ours != plain[:len(ours)]
    assert len(ours) > 10 and stop not in ours[:10]

    sampling = Sampling(40, temperature=0, frequency_penalty=0.7, presence_penalty=0.4)
    ours = generate(decoder_for(model, 48, 65), prompt, sampling)
    answer = []
    for _ in range(40):
        logits = hf(torch.tensor([prompt + answer])).logits[0, -1].float()
        for token in set(answer):
            logits[token] -= 0.7 * answer.count(token) + 0.4
        answer.append(int(logits.argmax()))
    assert ours == answer and ours != plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_query_attention_is_as_close_to_fp64_as_pytorchs_kernel(dtype):
    """The decode step's attention for several rows in bf16 (model/kv_cache.py): grouped heads, a mask of each row's
    own keys; its error against fp64 no larger than scaled_dot_product_attention's own at the dtype."""
    from model.kv_cache import one_query_attention

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=generator).to(dtype)
               for shape in [(3, 8, 1, 16), (3, 2, 20, 16), (3, 2, 20, 16)])
    mask = torch.arange(20)[None, None, None, :] < torch.tensor([20, 13, 5])[:, None, None, None]
    attention = torch.nn.functional.scaled_dot_product_attention
    expected = attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
    got = one_query_attention(q, k, v, mask)
    assert got.dtype == dtype and got.shape == expected.shape
    kernels = (attention(q, k, v, attn_mask=mask, enable_gqa=True).double() - expected).abs().max()
    assert (got.double() - expected).abs().max() <= max(kernels, 1e-6)
