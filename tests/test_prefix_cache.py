"""The prefix cache in one process, on a Llama with the key/value cache and several documents a prompt: a prompt
that begins as an earlier one computes only its new tokens and draws what it draws with the cache off (its logits
equal to 1e-5); hits are counted in whole blocks and always leave the last token to compute; the cache holds its
bound, dropping the end of the least recently used chain first; a forked slot decodes as the slot it copied."""
import torch

from data.documents import Documents
from model.config import ModelConfig
from model.generate import CachedDecoder, Sampling, generate
from model.kv_cache import KVCache
from model.prefix_cache import PrefixCache
from model_checks import decisive_model

LLAMA = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64, block_size=64,
                    vocab_size=20)
EOT = 19  # ends a document: a prompt of several documents is masked as training masked it
DOCUMENTS = Documents({"delimiter": "eot", "eot_id": EOT})


def model():
    return decisive_model(LLAMA, seed=3)


def prompts() -> tuple[list[int], list[int]]:
    """Two prompts sharing their first 37 tokens (an end of document among them)."""
    shared = torch.randint(0, EOT, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    shared[20] = EOT
    return shared + [1, 2, 3], shared + [4, 5, 6, 7, 8]


def computed(monkeypatch) -> list[int]:
    """The tokens each forward pass puts through the model, recorded as they go."""
    seen, forward = [], KVCache.forward

    def recording(self, model, slots, tokens, positions):
        seen.append(tokens.size(1))
        return forward(self, model, slots, tokens, positions)

    monkeypatch.setattr(KVCache, "forward", recording)
    return seen


@torch.no_grad()
def test_a_prompt_seen_before_computes_only_its_new_tokens_and_draws_the_same(monkeypatch):
    net, documents = model(), DOCUMENTS
    plain = CachedDecoder(net, LLAMA.block_size, LLAMA.vocab_size, documents=documents)
    cache = PrefixCache(capacity_bytes=10**8, block=8)
    cached = CachedDecoder(net, LLAMA.block_size, LLAMA.vocab_size, documents=documents, prefix_cache=cache)
    first, second = prompts()
    seen = computed(monkeypatch)
    for prompt, reused in [(first, 0), (second, 32), (first, 32), (first[:33], 32), (first[:32], 24)]:
        seen.clear()
        slot, logits = cached.start(prompt)
        cached.release(slot)
        assert seen == [len(prompt) - reused]
        slot, expected = plain.start(prompt)
        plain.release(slot)
        assert torch.allclose(logits, expected, atol=1e-5, rtol=0)
    assert (cache.queries, cache.hits) == (40 + 42 + 40 + 33 + 32, 32 + 32 + 32 + 24)
    greedy, sampled = Sampling(20, temperature=0), Sampling(20, temperature=1.0)
    assert generate(cached, second, greedy) == generate(plain, second, greedy)
    assert generate(cached, second, sampled, torch.Generator().manual_seed(4)) == \
        generate(plain, second, sampled, torch.Generator().manual_seed(4))


@torch.no_grad()
def test_the_cache_keeps_its_bound_dropping_the_least_recently_used_chain_from_its_end():
    net = model()
    first, second = prompts()
    block_bytes = 2 * LLAMA.n_layer * LLAMA.n_kv_head * 8 * (LLAMA.n_embd // LLAMA.n_head) * 4  # fp32
    cache = PrefixCache(capacity_bytes=7 * block_bytes, block=8)
    decoder = CachedDecoder(net, LLAMA.block_size, LLAMA.vocab_size, prefix_cache=cache)
    for prompt in (first, second):  # 5 blocks each, the first 4 shared: 6 blocks
        decoder.release(decoder.start(prompt)[0])
    assert cache.bytes == 6 * block_bytes
    other = [7] * 24  # 3 blocks of its own: the least recently used, second's last block, goes; then first's
    decoder.release(decoder.start(other)[0])
    assert cache.bytes == 7 * block_bytes <= cache.capacity_bytes
    assert [len(cache.lookup(p)) for p in (first, second, other)] == [4, 4, 2]  # a lookup leaves the last token
    cache.clear()
    assert cache.bytes == 0 and cache.lookup(first) == []


@torch.no_grad()
def test_a_forked_slot_decodes_as_the_slot_it_copied():
    decoder = CachedDecoder(model(), LLAMA.block_size, LLAMA.vocab_size, slots=3, documents=DOCUMENTS)
    first, _ = prompts()
    slot, logits = decoder.start(first)
    fork = decoder.fork(slot)
    assert fork != slot and decoder.windows[fork] == decoder.windows[slot]
    token = int(logits.argmax())
    stepped = decoder.step({slot: [token], fork: [token]})
    assert torch.allclose(stepped[slot], stepped[fork], atol=1e-6, rtol=0)
    alone = CachedDecoder(model(), LLAMA.block_size, LLAMA.vocab_size, documents=DOCUMENTS)
    one, _ = alone.start(first)
    assert torch.allclose(alone.step({one: [token]})[one], stepped[fork], atol=1e-5, rtol=0)
