"""The prefill worker (producer) of the two-process streaming test, driven over stdin and
stdout by the test, which is the decode worker (consumer).

It prints "KVS ready <port>", then, for every request a consumer hands over: allocates
blocks (scattered: counting down from the last), waits for "go" on stdin, runs the
prefill's layers one by one
(save_kv_layer after each, a short pause standing in for the compute), and prints
"KVS prefilled <request id> <block ids, comma-separated>". On "quit" on stdin it waits for
every send to finish and prints "KVS done <bytes sent> <layers sent>", then exits 0.
Any failure: a traceback on stderr and exit status 1.

  python stream_producer.py <seed> <layout> <cache source: numpy | worker>
"""

import select
import sys
import time

import numpy as np

import kvstream
import kvtest_util as u


def say(*words):
    print("KVS", *words, flush=True)


def main():
    seed, layout, source = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    config = {
        "kv_connector": "LayerwiseConnector",
        "kv_role": "kv_producer",
        "engine_id": "prefill-0",
        "kv_ip": "127.0.0.1",
        "kv_port": 0,
        "kv_connector_extra_config": {"transport": "ucx", "ucx_tls": "shm",
                                      "send_timeout_ms": 10000},
    }
    scheduler = kvstream.ConnectorScheduler(config, u.BLOCK_SIZE)
    worker = kvstream.ConnectorWorker(config)
    if source == "worker":
        # Memory peers write fastest, with the caches as sub-ranges of the one allocation.
        memory = worker.allocate_cache_memory(u.cache_bytes() + 64)
    else:
        memory = np.zeros(u.cache_bytes() + 64, dtype=np.uint8)
    caches, arrays, _ = u.carve_caches(memory, layout, start=64)
    u.fill(arrays, seed)
    worker.register_kv_caches(caches)
    say("ready", worker.control_address.rsplit(":", 1)[1])

    next_block = u.NUM_BLOCKS - 1
    pending = set()  # requests whose blocks a send still uses
    sent = set()     # finished_sending seen so far
    quitting = False
    deadline = None
    while True:
        output = worker.take_output()
        scheduler.update_connector_output(output)
        sent |= kvstream.decode_connector_output(output)["finished_sending"]
        pending -= sent
        for request in scheduler.take_incoming_requests():
            n = len(request.prompt_token_ids)
            blocks = list(range(next_block, next_block - (n + u.BLOCK_SIZE - 1) // u.BLOCK_SIZE, -1))
            next_block -= len(blocks)
            scheduler.update_state_after_alloc(request, blocks, 0)
            meta = scheduler.build_connector_meta([(request.request_id, 0, n)])
            assert len(kvstream.decode_connector_metadata(meta)["saves"]) == 1
            worker.bind_connector_metadata(meta)
            # The consumer says when to start, from a thread of its own while its main
            # thread waits for layer 0 (which needs that wait to release the GIL).
            if not select.select([sys.stdin], [], [], 20)[0] or sys.stdin.readline().strip() != "go":
                raise TimeoutError("no 'go' from the consumer")
            for layer in range(u.NUM_LAYERS):
                time.sleep(0.02)  # the layer's compute
                worker.save_kv_layer(u.layer_name(layer))
            worker.wait_for_save()
            worker.clear_connector_metadata()
            if scheduler.request_finished(request.request_id):
                pending.add(request.request_id)
            say("prefilled", request.request_id, ",".join(map(str, blocks)))
        if not quitting and select.select([sys.stdin], [], [], 0)[0]:
            if sys.stdin.readline().strip() == "quit":
                quitting = True
                deadline = time.monotonic() + 20
        if quitting and not pending:
            break
        if quitting and time.monotonic() > deadline:
            raise TimeoutError(f"sends of {sorted(pending)} did not finish")
        time.sleep(0.002)
    stats = worker.stats()
    say("done", stats["bytes_sent"], stats["layers_sent"])
    worker.close()


if __name__ == "__main__":
    main()
