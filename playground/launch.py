"""`tandem serve` and `tandem playground`: build the engine, the app, and run uvicorn.

The web modules (fastapi, gradio) are imported only when a server starts, so the command line's
other subcommands (and engine/) never load them."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from engine.entrypoints.reasoning import PARSERS
from lora.adapter import LoRARequest

if TYPE_CHECKING:
    from engine.entrypoints.openai.server import ServerState


def served_name(model: str) -> str:
    """The name /v1/models shows for --model: a GGUF file's stem (not its path on this
    machine), else what was given."""
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else model


def add_server_args(parser: argparse.ArgumentParser, port: int) -> None:
    parser.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="an embedded model's name, an HF model directory or a .gguf file",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="default: --model (a GGUF file: its name)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port, help="0 picks a free port")
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="a key every route but /health needs (repeat for tenants: each key's requests "
        "get their own prefix cache); or $TANDEM_API_KEY (several: comma-separated)",
    )
    parser.add_argument(
        "--allowed-hosts",
        nargs="*",
        default=[],
        help="without an API key: Host names besides localhost, 127.0.0.1, ::1, --host ('*': any)",
    )
    parser.add_argument(
        "--allowed-origins",
        nargs="*",
        default=[],
        help="sites (scheme://host:port) whose pages may call the server (CORS; '*': any)",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens (shows which prefixes are cached)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=PARSERS,
        default="auto",
        help="chat answers' <think>...</think> as reasoning_content: auto (when the chat "
        "template writes <think>), qwen3 or deepseek_r1 (always), none",
    )
    # (defaults: engine.entrypoints.openai.admission.AdmissionLimits)
    parser.add_argument("--max-prompts-per-request", type=int, help="prompts in one request")
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        help="requests held at once (a prompt with n completions counts n); past it: 429",
    )
    parser.add_argument(
        "--max-queued-tokens", type=int, help="prompt tokens of the requests held; past it: 429"
    )
    parser.add_argument(
        "--quantization",
        choices=["auto", "none", "int4", "int8"],
        default="auto",
        help="auto: a GGUF model runs its own quantized blocks on CPU; none: dense, exact",
    )
    parser.add_argument("--draft-model", default=None, help='a model, or "self"')
    parser.add_argument(
        "--speculative-method",
        choices=["ngram", "suffix", "draft"],
        default=None,
        help="suffix: drafts from the request's and its tenant's earlier text (with --draft-model"
        ": the draft model where suffix drafts score low)",
    )
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=None, help="default: 15 suffix, else 4"
    )
    parser.add_argument("--no-adaptive-speculation", action="store_true")
    parser.add_argument(
        "--lora", action="append", default=[], metavar="NAME=PATH", help="a PEFT adapter dir"
    )
    parser.add_argument(
        "--lora-dir",
        help="allow POST /v1/load_lora_adapter for adapter directories inside this directory",
    )
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument(
        "--max-step-ms",
        type=float,
        default=100.0,
        help="while requests decode, limit a step's prompt tokens to stay within this time "
        "(ms; 0: no limit, a prompt chunk of --max-num-batched-tokens shares any step)",
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="dense weights' dtype (auto: float32 on CPU, bfloat16 on CUDA); with --quantization "
        "none, bfloat16 on a CPU with AVX512-BF16 or AMX is the fast approximate dense path",
    )
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "float32", "bfloat16", "int8"],
        default="auto",
        help="auto: the model's dtype (exact); int8: ~3x the tokens per byte, bfloat16 beside "
        "float32 weights: 2x (C++ CPU layers)",
    )
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="ranks the model is split over"
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas on Ray Serve behind this server (needs the [distributed] extra)",
    )
    parser.add_argument(
        "--router",
        choices=["prefix", "round_robin"],
        default="prefix",
        help="how requests pick a replica: longest cached prefix, or in turn",
    )
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda:N")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule the next step while the device runs this one (default: on with CUDA)",
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=None, help="request body limit (default 4 MiB)"
    )


def parse_loras(specs: list[str]) -> dict[str, LoRARequest]:
    adapters = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora takes NAME=PATH, got {spec!r}")
        adapters[name] = LoRARequest(name, path)
    return adapters


def engine_config(args: argparse.Namespace, adapters: dict[str, LoRARequest]):
    from engine.config import EngineConfig

    return EngineConfig(
        model=args.model,
        quantization=None if args.quantization == "none" else args.quantization,
        draft_model=args.draft_model,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        adaptive_speculation=not args.no_adaptive_speculation,
        enable_lora=bool(adapters) or bool(args.lora_dir),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_step_ms=args.max_step_ms or None,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=args.dtype,
        num_threads=args.threads,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_prefix_caching=not args.no_prefix_caching,
        device=args.device,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
    )


def build_state(args: argparse.Namespace, adapters: dict[str, LoRARequest]) -> ServerState:
    from engine.entrypoints.openai.server import ServerState

    config = engine_config(args, adapters)
    if args.data_parallel_size != 1:
        engine = _replicas(args, config, adapters)
    else:
        from engine.entrypoints.async_engine import AsyncEngine

        engine = AsyncEngine.loading(config, adapters.values())
    body_limit = {"max_body_bytes": args.max_body_bytes} if args.max_body_bytes else {}
    keys = api_keys(args.api_key)
    return ServerState(
        engine,
        args.served_model_name or served_name(args.model),
        adapters,
        api_keys=keys,
        lora_dir=Path(args.lora_dir) if args.lora_dir else None,
        limits=admission_limits(args),
        bind_host=args.host,
        allowed_hosts=tuple(args.allowed_hosts),
        allowed_origins=tuple(args.allowed_origins),
        show_cached_tokens=args.enable_prompt_tokens_details,
        reasoning_parser=args.reasoning_parser,
        **body_limit,
    )


def api_keys(flags: list[str]) -> tuple[str, ...]:
    """The server's keys: the --api-key flags, else $TANDEM_API_KEY's comma-separated keys
    (as the flag repeated: each a tenant with its own default cache salt; blanks around a key
    and empty ones dropped); a key given twice counts once."""
    if not flags:
        flags = [k.strip() for k in os.environ.get("TANDEM_API_KEY", "").split(",")]
    return tuple(dict.fromkeys(k for k in flags if k))


def admission_limits(args: argparse.Namespace):
    from engine.entrypoints.openai.admission import AdmissionLimits

    names = ("max_prompts_per_request", "max_queued_requests", "max_queued_tokens")
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    try:
        return AdmissionLimits(**given)
    except ValueError as exc:
        flag = "--" + str(exc).split()[0].replace("_", "-")
        raise SystemExit(f"{flag}: {exc}") from None


def _replicas(args: argparse.Namespace, config, adapters: dict[str, LoRARequest]):
    """--data-parallel-size N: N engines on Ray Serve (engine/entrypoints/replicas.py)."""
    n = args.data_parallel_size
    if not isinstance(n, int) or n < 1:
        raise SystemExit(f"--data-parallel-size must be >= 1, got {n!r}")
    try:
        from engine.entrypoints.replicas import Replicas
    except ImportError as exc:
        raise SystemExit(
            f"--data-parallel-size needs Ray Serve: pip install -e '.[distributed]' ({exc})"
        ) from None
    return Replicas.start(config, n, list(adapters.values()), policy=args.router)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the engine loads: a taken --port fails at once (not
    after minutes of loading), and nothing the load opens (tensor parallelism's rendezvous and
    gloo's ephemeral listeners) can take the port first. Port 0 lets the kernel pick one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = exc.strerror or exc
        raise SystemExit(f"--port {port}: cannot listen on {host}:{port} ({why})") from None
    return sock


def run(state: ServerState, sock: socket.socket, with_ui: bool) -> int:
    import uvicorn

    from engine.entrypoints.openai.server import build_app

    app = build_app(state)
    if with_ui:
        from playground.ui import mount_playground

        app = mount_playground(app, state)
    host, port = sock.getsockname()[:2]
    where = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    print(f"tandem: serving {state.model_name} at {where}/v1", file=sys.stderr, flush=True)
    if with_ui:
        print(f"tandem: playground at {where}/", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    finally:
        sock.close()
        state.engine.shutdown()
    return 0


def serve_main(args: argparse.Namespace) -> int:
    sock = listen(args.host, args.port)
    return run(build_state(args, parse_loras(args.lora)), sock, with_ui=False)


def playground_main(args: argparse.Namespace) -> int:
    if args.data_parallel_size != 1:
        raise SystemExit("the playground draws one engine; run replicas with `tandem serve`")
    sock = listen(args.host, args.port)
    adapters = parse_loras(args.lora)
    if not adapters and not args.no_demo_adapters:
        from playground.demo_adapters import write_demo_adapters

        adapters = write_demo_adapters(args.model)
    if args.speculative_method is None and args.draft_model is None:
        args.speculative_method = "ngram"  # something to watch in the speculation view
    return run(build_state(args, adapters), sock, with_ui=True)
