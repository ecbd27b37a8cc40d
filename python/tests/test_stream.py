"""Two Python processes stream numpy-backed caches over UCX shared memory, layer by layer:
this test is the decode worker (consumer), stream_producer.py the prefill worker. The
engine logic (blocks, metadata, hand-off, the per-layer waits) is written out here, as an
engine would drive the connector's two sides. The consumer's blocks must come out
bit-identical to the producer's."""

import threading

import numpy as np
import pytest

import kvstream
import kvtest_util as u

SEED = 1234
TIMEOUT_S = 30


@pytest.fixture
def producer(request):
    layout, source = request.param
    with u.producer_process(SEED, layout, source, timeout_s=TIMEOUT_S) as (proc, reader, port):
        yield proc, reader, port, layout


def consumer_config(load_timeout_ms=10000):
    return u.connector_config("kv_consumer", load_timeout_ms=load_timeout_ms)


@pytest.mark.parametrize("producer", [("NHD", "numpy"), ("HND", "worker")], indirect=True,
                         ids=["nhd-numpy-producer", "hnd-allocated-producer"])
def test_streams_every_layer_bit_identical(producer):
    proc, reader, port, layout = producer
    scheduler = kvstream.ConnectorScheduler(consumer_config(), u.BLOCK_SIZE)
    worker = kvstream.ConnectorWorker(consumer_config())
    # The consumer's caches: views at an odd 64-byte multiple into one larger numpy buffer,
    # with guard bytes around them that must stay untouched.
    guard = 192
    buffer = np.full(u.cache_bytes() + 2 * guard, 0xA5, dtype=np.uint8)
    caches, arrays, used = u.carve_caches(buffer, layout, start=guard)
    for k, v in arrays:
        k[...] = 0
        v[...] = 0
    worker.register_kv_caches(caches)

    prompt = list(range(100, 114))  # 14 tokens: 13 come from remote, over 4 blocks of 4
    blocks = [9, 2, 14, 5]
    request = kvstream.Request("req-1", prompt, remote_prefill=("127.0.0.1", port))
    num_tokens, _ = scheduler.get_num_new_matched_tokens(request, 0)
    assert num_tokens == len(prompt) - 1
    scheduler.update_state_after_alloc(request, blocks, num_tokens)
    meta = scheduler.build_connector_meta([("req-1", 0, len(prompt))])
    decoded = kvstream.decode_connector_metadata(meta)
    assert [l["request_id"] for l in decoded["loads"]] == ["req-1"]
    assert decoded["waits"] == ["req-1"]
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()

    # The producer starts its layers only on a "go" that a second Python thread sends once
    # this thread is about to block in the wait for layer 0: the layers can arrive only if
    # that wait releases the GIL (else the thread cannot run, and the wait times out).
    entering = threading.Event()

    def go():
        if entering.wait(TIMEOUT_S):
            u.tell(proc, "go")

    sender = threading.Thread(target=go)
    sender.start()
    expected = u.expected_layers(SEED)
    # The producer's blocks for the request: the first of its scattered free list.
    p_blocks = u.PRODUCER_BLOCKS[:len(blocks)]
    for layer in range(u.NUM_LAYERS):
        if layer == 0:
            entering.set()
        worker.wait_for_layer_load(u.layer_name(layer))
        if layer == 0:
            sender.join()
        # The layer is in place as soon as its wait returns (the producer may still be
        # computing the next ones).
        k, v = arrays[layer]
        ek, ev = expected[layer]
        np.testing.assert_array_equal(u.tokens(k, blocks, num_tokens), u.tokens(ek, p_blocks, num_tokens))
        np.testing.assert_array_equal(u.tokens(v, blocks, num_tokens), u.tokens(ev, p_blocks, num_tokens))
        # The last prompt token is the consumer's own to compute: its slot is not written.
        assert not k[blocks[-1], (len(prompt) - 1) % u.BLOCK_SIZE].any()
    worker.clear_connector_metadata()
    reported = reader.read_message("KVS prefilled", TIMEOUT_S).split()
    assert reported == ["decode-0/req-1", ",".join(map(str, p_blocks))]
    # Nothing outside the caches' sub-ranges of the buffer was written.
    assert (buffer[:guard] == 0xA5).all() and (buffer[guard + used:] == 0xA5).all()

    def finished():
        out = worker.take_output()
        scheduler.update_connector_output(out)
        return "req-1" in kvstream.decode_connector_output(out)["finished_recving"]

    u.poll(finished, TIMEOUT_S, "req-1 finished receiving")
    assert worker.get_block_ids_with_load_errors() == set()
    per_layer = num_tokens * u.NUM_KV_HEADS * (u.HEAD_SIZE + u.HEAD_SIZE_V) * 2
    stats = worker.stats()
    assert stats["bytes_received"] == per_layer * u.NUM_LAYERS
    assert stats["layers_received"] == u.NUM_LAYERS
    assert stats["load_errors"] == 0
    assert stats["handshakes"] == 1
    request_stats = worker.take_request_stats()
    assert [r["request_id"] for r in request_stats] == ["req-1"]
    assert len(request_stats[0]["layer_arrival_ms"]) == u.NUM_LAYERS
    assert scheduler.request_finished("req-1") is False  # its load is over: free the blocks

    u.tell(proc, "quit")
    done = reader.read_message("KVS done", TIMEOUT_S).split()
    assert int(done[0]) == per_layer * u.NUM_LAYERS and int(done[1]) == u.NUM_LAYERS
    assert proc.wait(timeout=TIMEOUT_S) == 0
    worker.close()


@pytest.mark.parametrize("producer", [("NHD", "numpy")], indirect=True, ids=["nhd"])
def test_lost_producer_is_a_load_error(producer):
    proc, reader, port, _ = producer
    scheduler = kvstream.ConnectorScheduler(consumer_config(load_timeout_ms=3000), u.BLOCK_SIZE)
    worker = kvstream.ConnectorWorker(consumer_config(load_timeout_ms=3000))
    buffer = np.zeros(u.cache_bytes(), dtype=np.uint8)
    caches, _, _ = u.carve_caches(buffer, "NHD")
    worker.register_kv_caches(caches)
    # The producer dies before it runs anything: the request's layers never come.
    proc.kill()
    proc.wait(timeout=TIMEOUT_S)
    u.hand_over(scheduler, worker, "req-2", list(range(9)), [3, 7, 11], port)
    # The hand-off fails (nothing listens): the request becomes a load error and the layers'
    # waits return for the rest of the batch (there is none) instead of raising.
    for layer in range(u.NUM_LAYERS):
        worker.wait_for_layer_load(u.layer_name(layer))

    errors = []

    def failed():
        out = worker.take_output()
        scheduler.update_connector_output(out)
        errors.extend(kvstream.decode_connector_output(out)["load_errors"])
        return errors

    u.poll(failed, TIMEOUT_S, "a load error for req-2")
    assert errors[0]["request_id"] == "req-2"
    assert errors[0]["block_ids"] == [3, 7, 11]
    assert errors[0]["code"] in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    assert worker.get_block_ids_with_load_errors() == {3, 7, 11}
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
    worker.close()
