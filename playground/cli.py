"""`tandem` command line: generate, serve (OpenAI-compatible HTTP), playground (server + UI),
bench. It sits above the packages it dispatches to: engine/ imports no web module and no
benchmark."""

from __future__ import annotations

import argparse
import sys

from playground.launch import add_server_args


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(args.model, num_threads=args.threads)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )

    def run(prompt: str) -> None:
        if args.chat:
            prompt = llm.apply_chat_template([{"role": "user", "content": prompt}])
        for out in llm.stream(prompt, params):
            print(out.outputs[0].text, end="", flush=True)
        print()

    if args.prompt is not None:
        run(args.prompt)
        return 0
    print(f"tandem on {args.model}: type a prompt, empty line or Ctrl-D to quit", file=sys.stderr)
    for line in sys.stdin:
        if not line.strip():
            break
        run(line.rstrip("\n"))
    return 0


def _web(args: argparse.Namespace) -> int:
    from playground.launch import playground_main, serve_main

    return serve_main(args) if args.command == "serve" else playground_main(args)


def _bench(args: argparse.Namespace) -> int:
    if args.name == "throughput":
        from bench.throughput import main as bench_main

        return bench_main(args.rest)
    raise SystemExit(f"unknown benchmark {args.name!r}; available: throughput")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate", help="generate text (one-shot with --prompt, else interactive)"
    )
    gen.add_argument(
        "--model", default="smollm2-135m-instruct", help="embedded name, HF directory or .gguf"
    )
    gen.add_argument("--prompt", default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--threads", type=int, default=None)
    gen.set_defaults(func=_generate)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    playground = sub.add_parser("playground", help="the HTTP server with the Gradio UI mounted")
    for parser_, port in ((serve, 8000), (playground, 7860)):
        add_server_args(parser_, port)
        parser_.set_defaults(func=_web)
    playground.add_argument(
        "--no-demo-adapters",
        action="store_true",
        help="without --lora, the playground writes two small random PEFT adapters to show",
    )
    bench = sub.add_parser("bench", help="run a benchmark from bench/")
    bench.add_argument("name", choices=["throughput"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
