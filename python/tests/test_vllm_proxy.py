"""kvstream.vllm.proxy against two stand-in engines (aiohttp servers that record what
they are sent): what each engine's request carries in both modes, and that the client
gets the decode engine's answer. Skipped where aiohttp is not installed (vLLM brings it)."""

import asyncio

import pytest

aiohttp = pytest.importorskip("aiohttp")

from aiohttp import web  # noqa: E402
from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from kvstream.vllm import proxy  # noqa: E402

BODY = {"model": "m", "prompt": "hello", "max_tokens": 5, "stream": False}


def engine(name, seen, answer_params=None):
    async def handle(request):
        seen.append(await request.json())
        return web.json_response({"from": name, "kv_transfer_params": answer_params})

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    return app


async def run(sequential):
    p_seen, d_seen = [], []
    p_params = {"do_remote_prefill": True, "remote_host": "10.0.0.5", "remote_port": 14579,
                "transfer_id": "cmpl-1"}
    p = TestServer(engine("prefill", p_seen, p_params))
    d = TestServer(engine("decode", d_seen))
    await p.start_server()
    await d.start_server()
    kv = None if sequential else ("10.0.0.5", 14579)
    client = TestClient(TestServer(proxy.make_app(str(p.make_url("")).rstrip("/"),
                                                  str(d.make_url("")).rstrip("/"), kv)))
    await client.start_server()
    try:
        r = await client.post("/v1/completions", json=BODY)
        answer = await r.json()
    finally:
        await client.close()
        await p.close()
        await d.close()
    return answer, p_seen, d_seen, p_params


@pytest.mark.parametrize("sequential", [False, True], ids=["concurrent", "sequential"])
def test_each_engine_gets_its_part(sequential):
    answer, (p_body,), (d_body,), p_params = asyncio.run(run(sequential))
    assert answer["from"] == "decode"
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert d_body["max_tokens"] == 5 and d_body["prompt"] == "hello"
    if sequential:
        assert p_body["kv_transfer_params"] == {"do_remote_decode": True}
        assert d_body["kv_transfer_params"] == p_params
    else:
        tid = p_body["kv_transfer_params"]["transfer_id"]
        assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": tid}
        assert d_body["kv_transfer_params"] == proxy.concurrent_params(tid, "10.0.0.5", 14579)
