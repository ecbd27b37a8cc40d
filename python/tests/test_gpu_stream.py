"""torch tensors as caches, streamed layer by layer between two Python processes: this test
is the decode worker (consumer), stream_producer.py the prefill worker. The "cuda" cases are
the GPU test: torch CUDA tensors registered as device caches and streamed over cuda_ipc
between two processes on one GPU. The "cpu" cases run the same test on torch CPU tensors
over UCX shared memory, so that its logic is checked wherever torch is installed.

Both sides' caches are sub-ranges of one larger torch allocation (as PyTorch's caching
allocator hands them out) and both sides' block ids are scattered. Every layer is checked
bit for bit as soon as its wait returns; the producer writes each layer on a torch stream
behind a GPU delay and posts it at once, so the data is there only if the transfer waited
for the compute and the arrival notice for the transfer.

The cuda cases skip without torch, a CUDA build of kvstream or a GPU, saying which; with
KVSTREAM_REQUIRE_GPU=1 in the environment (bench/gpu/python_on_gpu_host.sh) they fail
instead, so that a GPU run cannot pass by skipping them.
"""

import os

import numpy as np
import pytest

import kvstream
import kvtest_util as u

SEED = 4321
TIMEOUT_S = 60  # the producer imports torch and, on the GPU, creates a CUDA context
GUARD = 192     # bytes before and after the consumer's caches in its allocation

DEVICES = [pytest.param("cpu", id="torch-cpu-ucx"), pytest.param("cuda", id="torch-cuda-ipc")]


def _unavailable(device, why):
    if device == "cuda" and os.environ.get("KVSTREAM_REQUIRE_GPU") == "1":
        pytest.fail(f"KVSTREAM_REQUIRE_GPU=1 but {why}")
    pytest.skip(why)


def need_torch(device):
    """torch, where `device` can be used; else skips (or fails, see above) saying why."""
    try:
        import torch
    except ImportError as e:
        _unavailable(device, f"torch is not installed ({e})")
    if device == "cuda":
        if not kvstream.built_with_cuda:
            _unavailable(device, "kvstream was built without CUDA (no cuda_ipc transport)")
        if not torch.cuda.is_available():
            _unavailable(device, f"no GPU: torch {torch.__version__} (CUDA "
                                 f"{torch.version.cuda}) sees no CUDA device")
    return torch


class Consumer:
    """The decode worker's connector sides and caches: views into one torch allocation
    (after another one, so not at the caching allocator's segment start), zeroed, with
    guard bytes around them."""

    def __init__(self, torch, device, layout, load_timeout_ms):
        config = u.connector_config("kv_consumer", device, load_timeout_ms=load_timeout_ms)
        self.torch = torch
        self.device = device
        self.scheduler = kvstream.ConnectorScheduler(config, u.BLOCK_SIZE)
        self.worker = kvstream.ConnectorWorker(config)
        self.before = torch.empty(1000, dtype=torch.uint8, device=device)
        self.buffer = torch.full((u.cache_bytes() + 2 * GUARD,), 0xA5, dtype=torch.uint8,
                                 device=device)
        caches, self.arrays, self.used = u.carve_caches(self.buffer, layout, start=GUARD)
        for k, v in self.arrays:
            k.zero_()
            v.zero_()
        self.synchronize()
        self.worker.register_kv_caches(caches)
        memory = "device" if device == "cuda" else "host"
        assert {c.memory for c in caches.values()} == {memory}
        # The stream the layers' attention would run on: the wait orders nothing on it
        # (it returns once the layer is in place), but the hook takes it.
        self.stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else 0

    def synchronize(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def wait_and_check(self, layer, blocks, num_tokens):
        """Waits for the layer, then checks its K and V bit for bit: the producer's tokens in
        `blocks`, zeros everywhere else."""
        self.worker.wait_for_layer_load(u.layer_name(layer), stream=self.stream)
        k, v = self.arrays[layer]
        ek, ev = u.expected_layers(SEED)[layer]
        p_blocks = u.PRODUCER_BLOCKS[:len(blocks)]
        np.testing.assert_array_equal(u.to_numpy(k), u.placed(ek, p_blocks, blocks, num_tokens),
                                      err_msg=f"K of layer {layer}")
        np.testing.assert_array_equal(u.to_numpy(v), u.placed(ev, p_blocks, blocks, num_tokens),
                                      err_msg=f"V of layer {layer}")

    def outputs_until(self, done, what):
        """Takes the worker's outputs into the scheduler until done(merged) holds; merged has
        the decoded outputs' finished_recving (a set) and load_errors (a list)."""
        merged = {"finished_recving": set(), "load_errors": []}

        def step():
            out = self.worker.take_output()
            self.scheduler.update_connector_output(out)
            decoded = kvstream.decode_connector_output(out)
            merged["finished_recving"] |= decoded["finished_recving"]
            merged["load_errors"] += decoded["load_errors"]
            return done(merged)

        u.poll(step, TIMEOUT_S, what)
        return merged

    def guards_untouched(self):
        host = u.to_numpy(self.buffer)
        return bool((host[:GUARD] == 0xA5).all() and (host[GUARD + self.used:] == 0xA5).all())


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("device", DEVICES)
def test_streams_torch_caches_bit_identical(device, layout):
    torch = need_torch(device)
    with u.producer_process(SEED, layout, f"torch-{device}", timeout_s=TIMEOUT_S) as (
            proc, reader, port):
        c = Consumer(torch, device, layout, load_timeout_ms=20000)
        prompt = list(range(200, 219))  # 19 tokens: 18 come from remote, over 5 blocks of 4
        blocks = [13, 2, 9, 6, 0]
        num_tokens = u.hand_over(c.scheduler, c.worker, "req-g", prompt, blocks, port)
        assert num_tokens == len(prompt) - 1
        u.tell(proc, "go")
        for layer in range(u.NUM_LAYERS):
            c.wait_and_check(layer, blocks, num_tokens)
        c.worker.clear_connector_metadata()
        reported = reader.read_message("KVS prefilled", TIMEOUT_S).split()
        assert reported == ["decode-0/req-g", ",".join(map(str, u.PRODUCER_BLOCKS[:5]))]
        assert c.guards_untouched(), "bytes outside the caches' sub-range were written"

        c.outputs_until(lambda m: "req-g" in m["finished_recving"], "req-g finished receiving")
        assert c.worker.get_block_ids_with_load_errors() == set()
        per_layer = num_tokens * u.NUM_KV_HEADS * (u.HEAD_SIZE + u.HEAD_SIZE_V) * 2
        stats = c.worker.stats()
        assert stats["bytes_received"] == per_layer * u.NUM_LAYERS
        assert stats["layers_received"] == u.NUM_LAYERS
        assert stats["load_errors"] == 0
        assert stats["blocks_in_flight"] == 0
        assert c.scheduler.request_finished("req-g") is False

        u.tell(proc, "quit")
        done = reader.read_message("KVS done", TIMEOUT_S).split()
        assert int(done[0]) == per_layer * u.NUM_LAYERS and int(done[1]) == u.NUM_LAYERS
        assert proc.wait(timeout=TIMEOUT_S) == 0
        c.worker.close()


@pytest.mark.parametrize("device", DEVICES)
def test_producer_killed_mid_stream_is_a_load_error(device):
    torch = need_torch(device)
    pause_after = 1
    with u.producer_process(SEED, "NHD", f"torch-{device}", f"--pause-after-layer={pause_after}",
                            timeout_s=TIMEOUT_S) as (proc, reader, port):
        # A load timeout far beyond how long a lost link takes to notice: the error must be
        # the lost producer, not the deadline.
        c = Consumer(torch, device, "NHD", load_timeout_ms=30000)
        prompt = list(range(300, 314))
        blocks = [7, 12, 1, 10]
        num_tokens = u.hand_over(c.scheduler, c.worker, "req-k", prompt, blocks, port)
        u.tell(proc, "go")
        for layer in range(pause_after + 1):
            c.wait_and_check(layer, blocks, num_tokens)
        assert reader.read_message("KVS paused", TIMEOUT_S) == str(pause_after)
        proc.kill()  # SIGKILL: no cleanup, its sockets and CUDA context just go
        proc.wait(timeout=TIMEOUT_S)
        # The remaining layers' waits return (the request is a load error now) instead of
        # raising or waiting out the load timeout.
        for layer in range(pause_after + 1, u.NUM_LAYERS):
            c.worker.wait_for_layer_load(u.layer_name(layer), stream=c.stream)
        c.worker.clear_connector_metadata()

        merged = c.outputs_until(
            lambda m: m["load_errors"] and "req-k" in m["finished_recving"],
            "a load error for req-k and its blocks released")
        errors = merged["load_errors"]
        assert [e["request_id"] for e in errors] == ["req-k"]
        assert errors[0]["block_ids"] == blocks
        assert errors[0]["code"] == "UNAVAILABLE", errors[0]
        assert f"127.0.0.1:{port}" in errors[0]["message"], errors[0]
        assert c.worker.get_block_ids_with_load_errors() == set(blocks)
        stats = c.worker.stats()
        assert stats["load_errors"] == 1
        assert stats["layers_received"] == pause_after + 1
        assert stats["blocks_in_flight"] == 0  # no block leaked: nothing can land any more
        assert c.scheduler.request_finished("req-k") is False
        assert c.guards_untouched()
        c.worker.close()
