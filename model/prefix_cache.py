"""Prefix caching: the keys and values of prompts prefilled before, kept in blocks of `block` tokens, so that a
prompt beginning as an earlier one did (a shared system prompt, a chat's earlier turns, one prompt sampled again)
computes only what is new: vLLM's automatic prefix caching, on whole blocks.

A token's keys and values depend on every token before it, so a block is found by its own tokens and its parent,
the block before it in the same prompt: two prompts share a block only where they are the same from their start.
They depend on the weights too: a prompt's first block hangs from a `root` naming what else it went through (a
LoRA adapter), None for the model alone.
The cache is bounded in bytes and drops the block used least recently. Each prefill marks its chain's blocks used
from its end back to its start, so a block is always more recent than those after it: the one dropped is never a
block others hang from.
"""
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Block:
    key: tuple  # (the parent's serial, or the root for a first block, this block's tokens)
    kv: torch.Tensor  # (2, layers, kv_heads, block, head_dim), as KVCache.read gives it
    serial: int = field(default_factory=itertools.count().__next__)


class PrefixCache:
    def __init__(self, capacity_bytes: int, block: int = 16):
        if block < 1:
            raise ValueError(f"block={block}: must be at least 1")
        self.capacity_bytes, self.block = capacity_bytes, block
        self.blocks: OrderedDict[tuple, Block] = OrderedDict()  # least recently used first
        self.bytes = 0
        self.queries = self.hits = 0  # prompt tokens looked up, and found

    def lookup(self, prompt: list[int], root=None) -> list[Block]:
        """The longest chain of cached blocks the prompt begins with, leaving at least its last token to compute
        (its logits are the first draw's)."""
        self.queries += len(prompt)
        chain = self._chain(prompt, (len(prompt) - 1) // self.block, root)
        self.hits += len(chain) * self.block
        return chain

    def store(self, prompt: list[int], read, root=None) -> None:
        """Keep the prompt's whole blocks that are not kept yet, read(start, end) giving their keys and values, and
        mark all of its blocks used (a prefill looks its prompt up, then stores it)."""
        whole = len(prompt) // self.block
        chain = self._chain(prompt, whole, root)
        parent = chain[-1].serial if chain else root
        added = []
        for i in range(len(chain), whole):
            tokens = tuple(prompt[i * self.block:(i + 1) * self.block])
            block = Block((parent, tokens), read(i * self.block, (i + 1) * self.block))
            size = block.kv.numel() * block.kv.element_size()
            if size > self.capacity_bytes:
                break
            self.blocks[block.key] = block
            self.bytes += size
            added.append(block)
            parent = block.serial
        for block in reversed(chain + added):  # the chain's end first: a parent stays more recent than its children
            self.blocks.move_to_end(block.key)
        while self.bytes > self.capacity_bytes:
            _, dropped = self.blocks.popitem(last=False)
            self.bytes -= dropped.kv.numel() * dropped.kv.element_size()

    def clear(self) -> None:
        """Forget every block (the weights changed)."""
        self.blocks.clear()
        self.bytes = 0

    def _chain(self, prompt: list[int], limit: int, root) -> list[Block]:
        chain, parent = [], root
        for i in range(limit):
            block = self.blocks.get((parent, tuple(prompt[i * self.block:(i + 1) * self.block])))
            if block is None:
                break
            chain.append(block)
            parent = block.serial
        return chain
