"""The `kvrail` command line: `serve`, `worker`, `api` and `generate`.

`serve` is the single-machine setup: an embedded Redis (unless REDIS_URL names one), one
worker and the API in one process and one event loop, so `/metrics` shows both sides.
`worker` and `api` are the same parts as separate programs, to scale each on its own.
The environment is read once, into `service.settings.Settings`, before a command runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from service.settings import UNKNOWN_FIELDS, Settings


def speculative_config(raw: str) -> dict[str, Any]:
    """`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`: a JSON
    object, checked by the engine at startup."""
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError(raw)
    return value


ENGINE_OPTIONS = {
    "device": str,
    "dtype": str,
    "quantization": str,
    "kv_cache_dtype": str,
    "max_num_seqs": int,
    "max_waiting_requests": int,
    "scheduling_policy": str,
    "session_timeout_s": float,
    "max_num_batched_tokens": int,
    "max_model_len": int,
    "num_kv_blocks": int,
    "kv_cache_memory_bytes": int,
    "speculative_config": speculative_config,
}


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ENGINE_OPTIONS if getattr(args, k) is not None}


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (KVRAIL_MODEL)")
    for name, kind in ENGINE_OPTIONS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None)


def _add_http_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--unknown-fields",
        choices=UNKNOWN_FIELDS,
        default=None,
        help="unknown request fields: 400 (reject) or a logged warning (KVRAIL_UNKNOWN_FIELDS)",
    )


def _on_signals(callback) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, callback)


async def _load_worker(args: argparse.Namespace, redis_url: str, settings: Settings):
    from service.engine_thread import load_engine
    from service.worker import Worker

    engine = await load_engine(model=args.model, **_engine_kwargs(args))
    model_name = getattr(args, "served_model_name", None)
    return Worker(engine, redis_url, args.name, model_name=model_name, settings=settings)


async def _worker_main(args: argparse.Namespace, settings: Settings) -> None:
    if args.metrics_port:
        from prometheus_client import start_http_server

        from service.metrics import REGISTRY

        start_http_server(args.metrics_port, registry=REGISTRY)
    worker = await _load_worker(args, _require_redis_url(settings), settings)
    _on_signals(worker.stop)
    await worker.run()


async def _api_main(args: argparse.Namespace, settings: Settings) -> None:
    from service.api import build_api_server

    server = await build_api_server(
        args.host, args.port, _require_redis_url(settings), args.model, settings,
        served_model_name=args.served_model_name,
    )  # fmt: skip

    def stop() -> None:
        server.should_exit = True

    _on_signals(stop)
    await server.serve()


async def _serve_main(args: argparse.Namespace, settings: Settings) -> None:
    from queueing.redis_server import EmbeddedRedis
    from service.api import build_api_server

    redis_url, embedded = settings.redis_url, None
    if redis_url is None:
        embedded = await asyncio.to_thread(EmbeddedRedis(appendonly=True).start)
        redis_url = embedded.url
    try:
        worker = await _load_worker(args, redis_url, settings)
        server = await build_api_server(
            args.host,
            args.port,
            redis_url,
            args.model,
            settings,
            served_model_name=args.served_model_name,
        )

        def stop() -> None:
            server.should_exit = True
            worker.stop()

        _on_signals(stop)
        worker_task = asyncio.create_task(worker.run())
        await server.serve()
        worker.stop()
        await worker_task
    finally:
        if embedded is not None:
            embedded.cleanup()


def _require_redis_url(settings: Settings) -> str:
    if settings.redis_url is None:
        sys.exit(
            "REDIS_URL is not set (kvrail serve starts an embedded Redis; worker/api need one)"
        )
    return settings.redis_url


def _generate(args: argparse.Namespace, settings: Settings) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(model=args.model, **_engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    if args.raw:
        (output,) = llm.generate(args.prompt, params)
    else:
        (output,) = llm.chat([{"role": "user", "content": args.prompt}], params)
    print(output.outputs[0].text)
    return 0


def _run_async(main: Callable[..., Awaitable[None]]) -> Callable[..., int]:
    """The command for `main(args, settings)`: logging configured, run on uvloop."""

    def run(args: argparse.Namespace, settings: Settings) -> int:
        import uvloop

        from service.logging import configure_logging

        configure_logging(settings)
        uvloop.run(main(args, settings))
        return 0

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrail", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="embedded Redis (if no REDIS_URL) + worker + API")
    _add_engine_options(serve)
    _add_http_options(serve)
    serve.add_argument("--name", default=None, help="worker name in the consumer group")
    serve.set_defaults(func=_run_async(_serve_main))

    worker = sub.add_parser("worker", help="serve the request stream of REDIS_URL")
    _add_engine_options(worker)
    worker.add_argument("--name", default=None, help="consumer name (default host-pid)")
    worker.add_argument("--metrics-port", type=int, default=None, help="Prometheus port")
    worker.set_defaults(func=_run_async(_worker_main))

    api = sub.add_parser("api", help="the OpenAI-compatible HTTP API on REDIS_URL")
    api.add_argument("--model", default=None, help="for its tokenizer and name (KVRAIL_MODEL)")
    _add_http_options(api)
    api.set_defaults(func=_run_async(_api_main))

    gen = sub.add_parser("generate", help="answer one prompt offline, without Redis")
    _add_engine_options(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="no chat template")
    gen.set_defaults(func=_generate)
    return parser


def settings_of(args: argparse.Namespace) -> Settings:
    """The environment's settings, the command line's flags over them."""
    settings = Settings.from_env()
    if getattr(args, "unknown_fields", None) is not None:
        settings = dataclasses.replace(settings, unknown_fields=args.unknown_fields)
    return settings


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = settings_of(args)
    args.model = args.model or settings.model
    return args.func(args, settings)


if __name__ == "__main__":
    sys.exit(main())
