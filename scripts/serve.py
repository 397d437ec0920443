"""Serve a checkpoint, an export or a Hugging Face model's folder over OpenAI's HTTP API, with continuous batching
and a chat page.

    python -m scripts.serve --out_dir out/llama_quickstart_sft              # the newest checkpoint of a run
    python -m scripts.serve --export out/llama_quickstart_export --port 8001
    python -m scripts.serve --export path/to/Qwen3-0.6B --max_model_len 4096   # a model from the Hub
    python -m scripts.serve --out_dir out/llama_quickstart_sft --host 0.0.0.0 --api_key KEY  # from other machines
    python -m scripts.serve --export out/base_export --lora_modules pirate=out/pirate_lora tutor=adapters/tutor

Then open http://127.0.0.1:8000/ for the chat page, or point any OpenAI client at http://127.0.0.1:8000/v1.
`--slots` sequences decode together (each a slot of the key/value cache); up to `--max_queue` more wait for one,
and past that a request is answered 429. Each `--lora_modules` NAME=PATH (a LoRA run's out_dir, or an adapter
folder in PEFT's layout) is served over the same weights as the model NAME. Without --api_key (or MEGALITE_API_KEY)
the server listens on loopback only, unless --host names another address. Prompts and keys are never logged.
Ctrl-C stops it.

If the model's worker dies, the traceback is printed once, every request is answered 500 and /health 503 for
FAILURE_LINGER_S (so clients and a load balancer learn it), and the process exits 1 for its supervisor to restart.
"""
import argparse
import os
import signal
import socket
import sys
import threading
import traceback

import torch

from common import freeze_imports
from common.checks import ConfigError, ToolParser, exit_bad_input
from data.tokenizers import TokenizerError
from model.generate import DTYPES, generation_dtype
from serving.adapters import lora_module
from training.checkpoints.export import add_trained_arguments, load_trained

KEY_VARIABLE = "MEGALITE_API_KEY"
FAILURE_LINGER_S = 5


def check_port(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); fix: pick a free "
                              f"port (--port) or stop the server that holds it") from None


def arguments(argv=None) -> argparse.Namespace:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trained_arguments(parser, "serve")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="auto: bf16 on a GPU, fp32 on a CPU")
    parser.add_argument("--slots", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--max_queue", type=int, default=64, help="requests waiting for a slot before 429")
    parser.add_argument("--prefix_cache_mb", type=int, default=512, help="keys and values of prompts seen before, "
                        "reused by a prompt that begins the same way (0: off)")
    parser.add_argument("--max_model_len", type=int, help="the tokens a sequence may hold, prompt and answer (default: "
                        "the model's context; vLLM's name): each of the --slots keeps a key/value cache that long")
    parser.add_argument("--name", help="the model's id in the API (default: the folder's name)")
    parser.add_argument("--lora_modules", nargs="+", default=[], type=lora_module, metavar="NAME=PATH",
                        help="LoRA adapters served beside the model, each as the model NAME: a LoRA run's "
                             "out_dir (its newest checkpoint) or a folder in PEFT's layout (scripts.export --adapter)")
    parser.add_argument("--api_key", default=os.environ.get(KEY_VARIABLE),
                        help=f"require 'Authorization: Bearer KEY' (default: ${KEY_VARIABLE})")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = arguments(argv)
    try:
        import uvicorn

        from serving.api import Served, create_app
        from serving.metrics import Metrics
    except ImportError as e:
        exit_bad_input(f"python -m scripts.serve needs its ASGI stack ({e}); fix: pip install '.[serve]'")
    cfg, model, tokenizer, meta = checked_model(args)
    from serving.adapters import Adapters
    from serving.engine import start_engine
    from serving.weights import Weights

    context = args.max_model_len or cfg.block_size
    try:
        engine = start_engine(cfg, model, meta, args.device, args.dtype, args.slots, args.max_queue,
                              args.prefix_cache_mb, thread=False, context=context)
    except ConfigError as e:
        exit_bad_input(e)
    scheduler = engine.scheduler
    name = args.name or os.path.basename(os.path.normpath(args.export or args.out_dir))
    metrics = Metrics(scheduler.stats, engine.prefix_cache, name)
    scheduler.observe = metrics.observe
    weights = Weights(cfg, meta, engine.load, engine.prefix_cache, engine.dtype)
    adapters = Adapters(name, cfg, meta, engine.adapters, weights.check_model)
    try:
        for lora_name, path in args.lora_modules:
            adapters.add(adapters.read(lora_name, path))
    except (ConfigError, TokenizerError) as e:
        exit_bad_input(f"--lora_modules: {e}")
    served = Served(name, context, tokenizer, meta, scheduler, metrics, weights=weights, adapters=adapters,
                    api_key=args.api_key)
    print(f"serving {name} ({engine.parameters:,} parameters, {engine.dtype}, {args.device}, "
          f"{args.slots} slots) on http://{args.host}:{args.port}/ (chat page) and /v1"
          + (f"; LoRA adapters {', '.join(adapters.by_name)}" if adapters.by_name else "")
          + ("; API key required" if args.api_key else "")
          + (f"; no structured outputs ({served.grammars.unavailable})" if served.grammars.unavailable else ""),
          flush=True)
    app = create_app(served)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=FAILURE_LINGER_S))
    return serve(server, scheduler)


def checked_model(args) -> tuple:
    """The settings checked, the port free and the model loaded; a bad one ends here in one line (exit 2)."""
    try:
        for name, low in (("slots", 1), ("max_queue", 0), ("prefix_cache_mb", 0), ("max_model_len", 2)):
            if getattr(args, name) is not None and getattr(args, name) < low:
                raise ConfigError(f"--{name} {getattr(args, name)}: must be at least {low}")
        if not 1 <= args.port <= 65535:
            raise ConfigError(f"--port {args.port}: must be a TCP port, 1 to 65535; fix: e.g. --port 8000")
        check_port(args.host, args.port)
        # read at the served dtype: an 8B model's bf16 weights take 16 GB of the host's memory on their way
        loaded = load_trained(args.out_dir, args.tag, args.export, context=args.max_model_len,
                              dtype=generation_dtype(args.device, args.dtype))
        if args.max_model_len and args.max_model_len > loaded[0].block_size:
            raise ConfigError(f"--max_model_len {args.max_model_len}: above the model's context of "
                              f"{loaded[0].block_size:,} tokens; fix: pass {loaded[0].block_size} or less, or leave it "
                              f"out")
        return loaded
    except (ConfigError, TokenizerError) as e:
        exit_bad_input(e)


def serve(server, scheduler) -> int:
    """HTTP until Ctrl-C, SIGTERM or a failed model worker; the exit code (1 after a failure). The model's loop
    keeps the main thread, which loaded the model (serving/scheduler.py says why); HTTP runs on a thread of its
    own, where uvicorn installs no signal handlers: Ctrl-C and SIGTERM are handled here."""
    def failed(error: BaseException) -> None:
        traceback.print_exception(error)
        print(f"error: {scheduler.failure}; answering 500 for {FAILURE_LINGER_S} s, then exiting 1", file=sys.stderr,
              flush=True)
        threading.Timer(FAILURE_LINGER_S, lambda: setattr(server, "should_exit", True)).start()

    def stop(*_) -> None:
        server.should_exit = True
        scheduler.close()

    def serve_http() -> None:
        try:
            server.run()
        finally:  # the server ended (stopped, or it failed): the model's loop ends with it
            scheduler.close()

    scheduler.on_failure = failed
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    http = threading.Thread(target=serve_http, name="http")
    http.start()
    scheduler.run()  # until stopped, or the model's worker fails
    http.join()
    return 1 if scheduler.failure else 0


if __name__ == "__main__":
    freeze_imports()
    sys.exit(main())
