"""What the server's tests share: a chat-tuned Llama's shape with random weights, exported with the chat template
of real prepared conversations; `python -m scripts.serve` (or tests/fault_serve.py, which slows or breaks its
decoder) started on a free loopback port and stopped with Ctrl-C; the requests and readings they make."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

from chats import reverse_tasks
from harness import REPO, free_port
from model.config import ModelConfig
from model_checks import decisive_model

KEY = "test-key-0123"
MESSAGE = "Reverse: king crown night"


def chat_model_export(folder, block_size: int, seed: int = 1, system: str | None = None,
                      tokenizer: str = "char", template: str | None = None) -> str:
    """`system`: a system turn some of the conversations begin with (its characters in the vocabulary); `tokenizer`:
    data.prepare's (a byte-level `bpe:N` writes any text); `template`: a chat template's file (default: the
    tokenizer's built-in one)."""
    from data.prepare_chat import prepare_chat
    from training.checkpoints.export import write_export

    folder.mkdir(parents=True, exist_ok=True)
    tasks = folder / "tasks.jsonl"
    conversations = reverse_tasks(50, seed=1)
    if system is not None:
        conversations += [{"messages": [{"role": "system", "content": system}, *c["messages"]]}
                          for c in reverse_tasks(5, seed=2)]
    tasks.write_text("".join(json.dumps(t) + "\n" for t in conversations))
    prepare_chat([str(tasks)], str(folder / "data"), tokenizer, template, context=64, val_fraction=0.1)
    meta = json.loads((folder / "data" / "meta.json").read_text())
    cfg = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64, block_size=block_size,
                      vocab_size=meta["vocab_size"])
    model = decisive_model(cfg, seed)
    return write_export(str(folder / "export"), cfg, model.state_dict(), meta, step=0, data_dir=str(folder / "data"))


def template_export(folder, template: str, block_size: int) -> str:
    """chat_model_export over a byte-level BPE (it writes any text) with `template` (Jinja source) as its chat
    template."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "template.jinja").write_text(template)
    return chat_model_export(folder / "model", block_size=block_size, tokenizer="bpe:300",
                             template=str(folder / "template.jinja"))


def adapter_folder(export: str, folder) -> str:
    """A LoRA adapter of rank 2 on every map of the export's model, in PEFT's layout (scripts.export --adapter's)."""
    import dataclasses

    from model import build_model
    from training.checkpoints.adapter import write_adapter
    from training.checkpoints.export import load_trained

    cfg = dataclasses.replace(load_trained(None, None, export)[0], lora_rank=2)
    return write_adapter(str(folder), cfg, build_model(cfg, seed=2).state_dict(), export)


class Server:
    def __init__(self, export: str, *args: str, script=("-m", "scripts.serve"), env: dict | None = None,
                 source: str = "--export"):
        """`script`: how the server is started (tests/fault_serve.py slows or breaks its decoder, through env);
        `source`: --export, or --out_dir for a run's newest checkpoint."""
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, *script, source, export, "--port", str(self.port),
                                      "--slots", "4", *args], cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
            assert self.proc.poll() is None, self.proc.stdout.read()
        raise AssertionError("the server did not answer /health within 120 s")

    def client(self, key: str = "unused"):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def stop(self) -> tuple[int, str]:
        """Ctrl-C, as a user stops it: (exit code, everything it printed)."""
        self.proc.send_signal(signal.SIGINT)
        output = self.proc.communicate(timeout=30)[0]
        return self.proc.returncode, output


def chat(server, message: str = MESSAGE, temperature: float = 0, **options):
    return server.client().chat.completions.create(model="export", messages=[{"role": "user", "content": message}],
                                                   temperature=temperature, **options)


def streamed_calls(chunks) -> list[tuple]:
    """The tool calls of a chat stream's chunks put together as OpenAI's clients do: (name, arguments, pieces) of
    each index in order, its id and name in its first piece alone, its arguments the pieces' in order."""
    calls = {}
    for chunk in chunks:
        for piece in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.name, piece
                calls[piece.index] = [piece.function.name, "", 0]
            else:
                assert piece.id is None and piece.function.name is None, piece
            calls[piece.index][1] += piece.function.arguments or ""
            calls[piece.index][2] += 1
    return [tuple(calls[k]) for k in sorted(calls)]


def at_once(calls: list) -> list:
    """Each of `calls` (no arguments) on a thread of its own, all started together: their results, in order."""
    results = [None] * len(calls)

    def call(i):
        results[i] = calls[i]()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    found = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def wait_for(condition, what: str, seconds: float = 30):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.05)


BAD = [  # (body or raw bytes, status, the error message's start)
    (b"{not json", 400, "the request body is not valid JSON"),
    (b"\xff\xfe", 400, "the request body is not UTF-8"),
    ({"model": "export", "messages": []}, 400, "messages must be a non-empty list"),
    ({"model": "export", "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0] has the unknown role"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400,
     "max_tokens must be at least 1"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}, 400, "max_tokens=500"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi " * 60}]}, 400, "the prompt has"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400,
     "temperature must be in [0, 2]"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400,
     "top_p=0: must be in (0, 1]"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400,
     '"tools" must be a list of'),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400,
     "tool_choice needs tools"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}, 400,
     "legacy function definitions (functions: send tools) are not supported by this server"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "function_call": "auto"}, 400,
     "legacy function-call choices (function_call: send tool_choice) are not supported by this server"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f"}}]}, 400, "the chat: the model's chat template does not render "
                                                                "tools"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
     400, "the requested format cannot be written with this model's vocabulary"),  # no "{" among its characters
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "min_tokens": 2,
      "structured_outputs": {"choice": ["king"]}}, 400, "min_tokens cannot be combined with a response format"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 2.5}, 400,
     "frequency_penalty=2.5: must be in [-2, 2]"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 0}, 400,
     "repetition_penalty=0: must be above 0 (1: none)"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "min_p": 1.5}, 400,
     "min_p=1.5: must be in [0, 1]"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "min_tokens": 5}, 400,
     "min_tokens=5: must be in [0, 4] (at most the tokens asked for)"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 101}}, 400,
     "logit_bias: token 5's bias 101 must be in [-100, 100]"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"999": 1}}, 400,
     "the token id 999 is outside the vocabulary"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"king": 1}}, 400,
     "logit_bias must map token ids to biases, not 'king': 1"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "best_of": 3}, 400,
     "best_of is not supported by this server: ask for n answers"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "top_k": -2}, 400,
     "top_k must be -1 or 0 (off) or at least 1, not -2"),
    ({"model": "export", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "only text content is supported"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": ["x"]}, 400,
     "chat_template_kwargs must be an object of the chat template's variables"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tools": []}}, 400,
     "chat_template_kwargs cannot set tools: the request's own fields do"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "continue_final_message": True,
      "add_generation_prompt": True}, 400, "continue_final_message continues the last turn, add_generation_prompt "
                                           "begins a new one: set one of them"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "continue_final_message": "yes"}, 400,
     "continue_final_message must be true or false"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": "no", "tools": [
        {"type": "function", "function": {"name": "f"}}]}, 400, "parallel_tool_calls must be true or false"),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "the model 'gpt-9' is not served"),
]
