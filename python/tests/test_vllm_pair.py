"""A vLLM prefill engine and a vLLM decode engine, each with kvstream.vllm as its KV
connector, in two processes: vllm_peer.py is the prefill engine (kv_producer), this test
the decode engine (kv_consumer). Both are vLLM's real scheduler, Request objects, KV cache
tensors (CPU memory) and model-runner connector sequence (vllm_engine.py); the KV moves
through the plugin's methods (save_kv_layer on the prefill side, wait_for_layer_load on
the decode side, get_finished on both) over UCX shared memory, and must arrive
bit-identical in every layer. Skipped where vLLM is not installed."""

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import kvtest_util as u  # noqa: E402
import vllm_engine as ve  # noqa: E402
import vllm_harness as harness  # noqa: E402

TIMEOUT_S = 60
PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(40)]  # 40 tokens: 39 come from the producer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return harness.write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


class Peer:
    def __init__(self, model_dir, options):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "vllm_peer.py"), model_dir, json.dumps(options)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=HERE, text=False)
        self.reader = u.LineReader(self.proc.stdout)
        host, port = self.reader.read_message("PEER ready", TIMEOUT_S * 2).rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.unread = []

    def send(self, **cmd):
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def read(self, kind):
        """The next message of `kind`; messages of other kinds are kept for later."""
        for i, (k, payload) in enumerate(self.unread):
            if k == kind:
                del self.unread[i]
                return json.loads(payload)
        while True:
            k, payload = self.reader.read_message("PEER ", TIMEOUT_S).split(" ", 1)
            if k == kind:
                return json.loads(payload)
            self.unread.append((k, payload))

    def close(self):
        if self.proc.poll() is None:
            try:
                self.send(cmd="quit")
                self.proc.wait(timeout=TIMEOUT_S)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.proc.wait(timeout=TIMEOUT_S)


@pytest.fixture
def peers():
    started = []

    def start(model_dir, options):
        p = Peer(model_dir, options)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def decode_engine(model_dir, fmt):
    d = ve.Engine(model_dir, "kv_consumer", fmt=fmt, engine_id="decode-0")
    checked = []

    def check_loaded(layer, name):
        # The request's first step: every prompt token but the last came from the
        # producer, and the layer's wait returned, so its KV must be in place already.
        if d.steps != 0:
            return
        blocks = d.block_ids("client-D")
        k, v = d.views[name]
        n = len(PROMPT) - 1
        for view, is_v in ((k, False), (v, True)):
            got = ve.read_tokens(view, blocks, n)
            want = ve.expected_tokens(layer, PROMPT, n, is_v)
            assert got.view(-1).view(dtype=got.dtype).numpy().tobytes() == \
                want.numpy().tobytes(), f"layer {layer} {'V' if is_v else 'K'} differs"
        checked.append(layer)

    d.on_layer_loaded = check_loaded
    return d, checked


def finish_decode(d, checked, peer):
    d.run_until(lambda: not d.busy(), TIMEOUT_S)
    assert checked == list(range(len(ve.LAYERS)))
    out = d.finished["client-D"]
    assert len(out.new_token_ids) >= 1
    assert d.free_blocks() == ve.NUM_BLOCKS - 1  # all but vLLM's null block
    stats = d.worker.worker_side.worker.stats()
    assert stats["load_errors"] == 0
    assert stats["layers_received"] == len(ve.LAYERS)
    idle = peer.read("idle")
    assert idle["free_blocks"] == ve.NUM_BLOCKS - 1
    assert idle["layers_sent"] == len(ve.LAYERS)
    assert idle["bytes_sent"] == stats["bytes_received"] > 0
    d.worker.shutdown()


@pytest.mark.parametrize("fmt", sorted(ve.FORMATS))
def test_concurrent_proxy_streams_layer_by_layer(model_dir, peers, fmt):
    # A proxy that sends the request to both engines at once, with one transfer id: the
    # prefill engine holds the request until the decode engine's hand-off has come, then
    # sends each layer after its attention in the prefill step.
    peer = peers(model_dir, {"fmt": fmt, "extra": {"handoff_wait_ms": TIMEOUT_S * 1000}})
    peer.send(cmd="add", id="client-P", prompt=PROMPT, max_tokens=1,
              params={"do_remote_decode": True, "transfer_id": "xfer-1"})
    peer.send(cmd="run", timeout_s=TIMEOUT_S)
    d, checked = decode_engine(model_dir, fmt)
    d.add("client-D", PROMPT, max_tokens=3, kv_transfer_params={
        "do_remote_prefill": True, "remote_host": peer.host, "remote_port": peer.port,
        "transfer_id": "xfer-1"})
    finish_decode(d, checked, peer)
    finished = peer.read("finished")
    assert finished["id"] == "client-P"


def test_prefill_first_proxy_sends_kept_blocks(model_dir, peers):
    # A proxy that asks the prefill engine first and hands its answer's kv_transfer_params
    # to the decode engine (as vLLM's proxies for pull connectors do): the prefill engine
    # finishes without a hand-off, keeps the request's blocks, and sends them, every
    # layer, in a step with no forward pass once the hand-off comes.
    # The proxy names no transfer id: the prefill engine's request id serves as one.
    port = free_port()
    peer = peers(model_dir, {"fmt": "cpu", "kv_port": port,
                             "extra": {"handoff_keep_ms": TIMEOUT_S * 1000}})
    peer.send(cmd="add", id="client-P", prompt=PROMPT, max_tokens=1,
              params={"do_remote_decode": True})
    peer.send(cmd="run", timeout_s=TIMEOUT_S)
    finished = peer.read("finished")
    params = finished["kv_transfer_params"]
    # vLLM adds keys of its own (remote_prefill_cached_tokens) to the connector's.
    assert {k: params.get(k) for k in ("do_remote_prefill", "remote_host", "remote_port",
                                       "transfer_id")} == {
        "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port,
        "transfer_id": "client-P"}
    d, checked = decode_engine(model_dir, "cpu")
    d.add("client-D", PROMPT, max_tokens=3, kv_transfer_params=params)
    finish_decode(d, checked, peer)
