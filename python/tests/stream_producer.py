"""The prefill worker (producer) of the two-process streaming tests (test_stream.py,
test_gpu_stream.py), driven over stdin and stdout by the test, which is the decode worker
(consumer).

It prints "KVS ready <port>", then, for every request a consumer hands over: allocates
blocks (scattered: kvtest_util.PRODUCER_BLOCKS in order), waits for "go" on stdin, runs the
prefill's layers one by one (each layer's compute writes the layer's K and V, then
save_kv_layer), and prints "KVS prefilled <request id> <block ids, comma-separated>". On
"quit" on stdin it waits for every send to finish and prints "KVS done <bytes sent> <layers
sent>", then exits 0. Any failure: a traceback on stderr and exit status 1.

  python stream_producer.py <seed> <layout> <cache source> [--pause-after-layer=N]

Cache sources: numpy (one numpy buffer), worker (allocate_cache_memory), torch-cpu (one
torch CPU tensor), torch-cuda (one torch CUDA tensor, streamed over cuda_ipc); the caches
are sub-ranges of that one allocation. With torch-cuda the compute is enqueued on a torch
stream behind a GPU delay and save_kv_layer is called at once with that stream, so the
layer's data exists only once the GPU got there: a consumer that sees it after its wait
shows that the transfer was ordered after the compute and the arrival notice after the
transfer. --pause-after-layer=N: after posting layer N of the first request, prints "KVS
paused N" and waits to be killed (a crash mid-stream, as the test decides when).
"""

import sys
import time

import numpy as np

import kvstream
import kvtest_util as u

# About 10 ms of GPU time before each layer's data is written (torch.cuda._sleep spins
# this many cycles).
GPU_LAYER_DELAY_CYCLES = 20_000_000


def say(*words):
    print("KVS", *words, flush=True)


class Memory:
    """One allocation holding every layer's cache, and how a layer's compute writes it."""

    def __init__(self, worker, source, nbytes, seed):
        self.expected = u.expected_layers(seed)
        self.stream = None
        self._keep = []
        if source == "worker":
            # Memory peers write fastest, with the caches as sub-ranges of the one allocation.
            self.buffer = worker.allocate_cache_memory(nbytes)
        elif source == "numpy":
            self.buffer = np.zeros(nbytes, dtype=np.uint8)
        elif source in ("torch-cpu", "torch-cuda"):
            import torch
            device = source[len("torch-"):]
            # Something allocated first, so that the caches' buffer does not start where the
            # caching allocator's segment does (cuda_ipc must export the segment and offset).
            self._keep.append(torch.empty(4096, dtype=torch.uint8, device=device))
            self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            if device == "cuda":
                self.stream = torch.cuda.Stream()
                # Each layer's bits, uploaded once: the compute is then a device copy.
                self._staged = [tuple(torch.from_numpy(a.view(np.int16)).cuda() for a in kv)
                                for kv in self.expected]
                torch.cuda.synchronize()
        else:
            raise ValueError(f"unknown cache source '{source}'")

    def compute(self, layer, k, v):
        """Writes the layer's K and V; returns the stream to save it on (0: host caches)."""
        if self.stream is None:
            time.sleep(0.02)  # the layer's compute
            u.store(k, self.expected[layer][0])
            u.store(v, self.expected[layer][1])
            return 0
        import torch
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(GPU_LAYER_DELAY_CYCLES)
            sk, sv = self._staged[layer]
            k.view(torch.int16).copy_(sk, non_blocking=True)
            v.view(torch.int16).copy_(sv, non_blocking=True)
        return self.stream.cuda_stream


class Commands:
    """The test's lines on stdin, kept in order: a check for one word never loses another
    that came early (the consumer may say "go" before its hand-off has arrived here)."""

    def __init__(self):
        self._reader = u.LineReader(sys.stdin)
        self._lines = []

    def take(self, word):
        """Whether `word` has come (consuming it); never waits."""
        while (line := self._reader.try_read_line()) is not None:
            self._lines.append(line.strip())
        if word in self._lines:
            self._lines.remove(word)
            return True
        return False


def main():
    seed, layout, source = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    pause_after = -1
    for arg in sys.argv[4:]:
        if not arg.startswith("--pause-after-layer="):
            raise ValueError(f"unknown argument '{arg}'")
        pause_after = int(arg.split("=", 1)[1])
    if source.startswith("torch-"):
        # Before kvstream's native module: that one loads the system's libnccl, which can be
        # older than the one torch was built with (docs/python.md).
        import torch  # noqa: F401
    device = "cuda" if source == "torch-cuda" else "cpu"
    config = u.connector_config("kv_producer", device, send_timeout_ms=10000)
    scheduler = kvstream.ConnectorScheduler(config, u.BLOCK_SIZE)
    worker = kvstream.ConnectorWorker(config)
    memory = Memory(worker, source, u.cache_bytes() + 64, seed)
    caches, arrays, _ = u.carve_caches(memory.buffer, layout, start=64)
    worker.register_kv_caches(caches)
    say("ready", worker.control_address.rsplit(":", 1)[1])

    commands = Commands()
    free = list(u.PRODUCER_BLOCKS)
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
            count = (n + u.BLOCK_SIZE - 1) // u.BLOCK_SIZE
            blocks, free = free[:count], free[count:]
            scheduler.update_state_after_alloc(request, blocks, 0)
            meta = scheduler.build_connector_meta([(request.request_id, 0, n)])
            assert len(kvstream.decode_connector_metadata(meta)["saves"]) == 1
            worker.bind_connector_metadata(meta)
            # The consumer says when to start, from a thread of its own while its main
            # thread waits for layer 0 (which needs that wait to release the GIL).
            u.poll(lambda: commands.take("go"), 20, "'go' from the consumer")
            for layer in range(u.NUM_LAYERS):
                k, v = arrays[layer]
                stream = memory.compute(layer, k, v)
                worker.save_kv_layer(u.layer_name(layer), stream=stream)
                if layer == pause_after:
                    say("paused", layer)
                    time.sleep(60)
                    raise TimeoutError(f"paused after layer {layer}, not killed within 60 s")
            worker.wait_for_save()
            worker.clear_connector_metadata()
            if scheduler.request_finished(request.request_id):
                pending.add(request.request_id)
            say("prefilled", request.request_id, ",".join(map(str, blocks)))
        if not quitting and commands.take("quit"):
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
