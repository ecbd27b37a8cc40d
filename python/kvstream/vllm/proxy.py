"""A proxy in front of one vLLM prefill engine and one vLLM decode engine that use
kvstream.vllm: clients talk to it as to an OpenAI-compatible vLLM server.

    python -m kvstream.vllm.proxy --prefill http://10.0.0.5:8100 --decode http://10.0.0.6:8200 \\
        --prefill-kv 10.0.0.5:14579 --port 8000

Each request gets a transfer id and goes to both engines at once: to the prefill engine
with max_tokens 1 and kv_transfer_params {do_remote_decode, transfer_id}, to the decode
engine with {do_remote_prefill, remote_host, remote_port (--prefill-kv: the producer's
kvstream address, its kv_ip and kv_port), transfer_id}. The decode engine hands the
request over to the producer while the prefill runs, and the prefill streams every layer's
KV right after that layer's attention. The client gets the decode engine's answer (also
streamed). --sequential asks the prefill engine first and passes its answer's
kv_transfer_params to the decode engine (no --prefill-kv needed; no overlap).

Needs aiohttp (a vLLM dependency). The request bodies are built by prefill_body and
decode_body, which need nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import uuid
from typing import Any

logger = logging.getLogger("kvstream.vllm.proxy")

PATHS = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict[str, Any], transfer_id: str | None) -> dict[str, Any]:
    """The prefill engine's request: the prompt only (one token), no stream."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    params = {"do_remote_decode": True}
    if transfer_id is not None:
        params["transfer_id"] = transfer_id
    out["kv_transfer_params"] = params
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(body)
    out["kv_transfer_params"] = dict(kv_transfer_params)
    return out


def concurrent_params(transfer_id: str, host: str, port: int) -> dict[str, Any]:
    return {"do_remote_prefill": True, "remote_host": host, "remote_port": port,
            "transfer_id": transfer_id}


def make_app(prefill_url: str, decode_url: str, prefill_kv: tuple[str, int] | None):
    """The aiohttp application. prefill_kv None: sequential mode."""
    from aiohttp import ClientSession, ClientTimeout, web

    async def start(app):
        app["session"] = ClientSession(timeout=ClientTimeout(total=None))

    async def stop(app):
        await app["session"].close()

    async def prefill(session, path, body):
        async with session.post(prefill_url + path, json=body) as r:
            payload = await r.json(content_type=None)
            if r.status != 200:
                raise web.HTTPBadGateway(text=f"prefill engine: {r.status} {payload}")
            return payload

    async def handle(request: web.Request):
        session = request.app["session"]
        body = await request.json()
        tid = uuid.uuid4().hex
        if prefill_kv is None:
            answer = await prefill(session, request.path, prefill_body(body, None))
            params = answer.get("kv_transfer_params") or {}
            prefill_task = None
        else:
            params = concurrent_params(tid, *prefill_kv)
            prefill_task = asyncio.ensure_future(
                prefill(session, request.path, prefill_body(body, tid)))
        try:
            async with session.post(decode_url + request.path,
                                    json=decode_body(body, params)) as r:
                response = web.StreamResponse(status=r.status)
                response.content_type = r.content_type
                await response.prepare(request)
                async for chunk in r.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        finally:
            if prefill_task is not None:
                try:
                    await prefill_task
                except Exception as e:  # the decode engine recomputes what did not come
                    logger.warning("prefill of transfer %s failed: %s", tid, e)

    app = web.Application()
    for path in PATHS:
        app.router.add_post(path, handle)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


def main(argv=None):
    from aiohttp import web

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="the prefill engine's URL")
    ap.add_argument("--decode", required=True, help="the decode engine's URL")
    ap.add_argument("--prefill-kv", help="HOST:PORT of the producer's kvstream address")
    ap.add_argument("--sequential", action="store_true",
                    help="prefill first, then decode with the prefill's kv_transfer_params")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)
    kv = None
    if not args.sequential:
        if not args.prefill_kv:
            ap.error("--prefill-kv is needed unless --sequential")
        host, port = args.prefill_kv.rsplit(":", 1)
        kv = (host, int(port))
    logging.basicConfig(level=logging.INFO)
    web.run_app(make_app(args.prefill.rstrip("/"), args.decode.rstrip("/"), kv),
                host=args.host, port=args.port)


if __name__ == "__main__":
    main()
