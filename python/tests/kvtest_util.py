"""Helpers the kvstream Python tests share: the cache shapes, deterministic cache contents,
caches carved out of one larger buffer (numpy, or torch on the CPU or a GPU), the streaming
tests' connector configs and producer process, and line I/O with a peer process under
deadlines. torch is imported only by the helpers that are given torch tensors."""

import contextlib
import os
import selectors
import subprocess
import sys
import time

import numpy as np

import kvstream

NUM_LAYERS = 4
BLOCK_SIZE = 4
NUM_KV_HEADS = 2
HEAD_SIZE = 8
HEAD_SIZE_V = 4
NUM_BLOCKS = 16
# The order in which stream_producer.py hands out its blocks: scattered, as an engine's
# free list is after a while.
PRODUCER_BLOCKS = [11, 3, 14, 6, 0, 9, 12, 1, 7, 15, 4, 10, 2, 13, 5, 8]
HERE = os.path.dirname(os.path.abspath(__file__))


def layer_name(i):
    return f"model.layers.{i}.self_attn.attn"


def spec():
    # bfloat16 caches held by numpy as raw uint16 (numpy has no bfloat16).
    return kvstream.KvCacheSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                                head_size=HEAD_SIZE, head_size_v=HEAD_SIZE_V, dtype="bfloat16")


def k_elems():
    return NUM_BLOCKS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE


def v_elems():
    return NUM_BLOCKS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE_V


def _is_numpy(array):
    return isinstance(array, np.ndarray)


def carve(buffer_u8, offset_bytes, elems, head_size, layout):
    """A [num_blocks, block_size, heads, head_size] view of `elems` bfloat16 elements at
    `offset_bytes` into a uint8 buffer (numpy: raw uint16, as numpy has no bfloat16; torch:
    bfloat16): NHD directly, HND as a permuted view."""
    dtype = np.uint16
    if not _is_numpy(buffer_u8):
        import torch
        dtype = torch.bfloat16
    flat = buffer_u8[offset_bytes:offset_bytes + 2 * elems].view(dtype)
    if layout == "NHD":
        return flat.reshape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, head_size)
    hnd = flat.reshape(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, head_size)
    return hnd.swapaxes(1, 2)


def carve_caches(buffer_u8, layout, start=0):
    """Every layer's K and V, one after the other from `start` (64-byte aligned), as views
    into `buffer_u8`; returns ({name: KvCache}, [(k, v)] per layer, bytes used)."""
    caches, arrays = {}, []
    offset = start
    for layer in range(NUM_LAYERS):
        k = carve(buffer_u8, offset, k_elems(), HEAD_SIZE, layout)
        offset += 2 * k_elems()
        v = carve(buffer_u8, offset, v_elems(), HEAD_SIZE_V, layout)
        offset += 2 * v_elems()
        caches[layer_name(layer)] = kvstream.KvCache.borrow(spec(), k, v)
        arrays.append((k, v))
    return caches, arrays, offset - start


def cache_bytes():
    return NUM_LAYERS * 2 * (k_elems() + v_elems())


def store(array, bits):
    """Writes uint16 bit patterns (a numpy array of the same logical shape) into a cache
    array: numpy uint16, or torch bfloat16 on any device (copied on torch's current stream)."""
    if _is_numpy(array):
        array[...] = bits
        return
    import torch
    array.view(torch.int16).copy_(torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)))


def to_numpy(array):
    """A numpy array of the same logical shape and bits: the array itself for numpy, a host
    copy of a torch tensor (bfloat16 as its uint16 bits; waits for torch's current stream)."""
    if _is_numpy(array):
        return array
    import torch
    if array.dtype == torch.bfloat16:
        return array.view(torch.int16).cpu().numpy().view(np.uint16)
    return array.cpu().numpy()


def expected_layers(seed):
    """The producer's contents of every layer for `seed` (deterministic, so the consumer can
    regenerate them), as logical [blocks, tokens, heads, dim] uint16 arrays per layer."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(NUM_LAYERS):
        k = rng.integers(0, 1 << 16, size=(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE),
                         dtype=np.uint16)
        v = rng.integers(0, 1 << 16, size=(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE_V),
                         dtype=np.uint16)
        out.append((k, v))
    return out


def tokens(array, block_ids, num_tokens):
    """The first `num_tokens` tokens of a request stored in `block_ids`, in token order."""
    rows = [array[block_ids[t // BLOCK_SIZE], t % BLOCK_SIZE] for t in range(num_tokens)]
    return np.stack(rows)


def placed(source, source_blocks, blocks, num_tokens):
    """What a consumer's zeroed cache array holds after the first `num_tokens` tokens of
    `source` (stored in `source_blocks`) were copied into `blocks`: zeros elsewhere."""
    out = np.zeros_like(source)
    for t in range(num_tokens):
        out[blocks[t // BLOCK_SIZE], t % BLOCK_SIZE] = source[source_blocks[t // BLOCK_SIZE],
                                                              t % BLOCK_SIZE]
    return out


def connector_config(role, device="cpu", **settings):
    """The kv_transfer_config of the streaming tests' engines (a producer "prefill-0"
    listening on 127.0.0.1, a consumer "decode-0"): caches in host memory over UCX shared
    memory, in device memory (device "cuda") over cuda_ipc; `settings` go into
    kv_connector_extra_config."""
    extra = ({"transport": "cuda_ipc"} if device == "cuda"
             else {"transport": "ucx", "ucx_tls": "shm"})
    extra.update(settings)
    config = {
        "kv_connector": "LayerwiseConnector",
        "kv_role": role,
        "engine_id": "prefill-0" if role == "kv_producer" else "decode-0",
        "kv_buffer_device": device,
        "kv_connector_extra_config": extra,
    }
    if role == "kv_producer":
        config.update(kv_ip="127.0.0.1", kv_port=0)
    return config


def hand_over(scheduler, worker, request_id, prompt, blocks, port):
    """A consumer's first step for a request whose prompt the producer at 127.0.0.1:`port`
    prefills into `blocks`: matched, allocated, the step's metadata bound and the load
    started. Returns the number of tokens that come from remote."""
    request = kvstream.Request(request_id, prompt, remote_prefill=("127.0.0.1", port))
    num_tokens, _ = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, blocks, num_tokens)
    worker.bind_connector_metadata(scheduler.build_connector_meta([(request_id, 0, len(prompt))]))
    worker.start_load_kv()
    return num_tokens


@contextlib.contextmanager
def producer_process(*args, timeout_s=30):
    """stream_producer.py with `args` as a child process, until it said "ready": yields
    (Popen, LineReader of its stdout, its control port); kills it on the way out."""
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "stream_producer.py"), *map(str, args)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=HERE,
        env=dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", "")))
    reader = LineReader(proc.stdout)
    try:
        port = int(reader.read_message("KVS ready", timeout_s))
        yield proc, reader, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=timeout_s)


def tell(proc, line):
    """Writes one line to a peer's stdin."""
    proc.stdin.write(line.encode() + b"\n")
    proc.stdin.flush()


class LineReader:
    """Reads lines from a pipe with a deadline (never blocks past it)."""

    def __init__(self, pipe):
        self._fd = pipe.fileno()
        os.set_blocking(self._fd, False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._fd, selectors.EVENT_READ)
        self._buf = b""

    def read_line(self, timeout_s):
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no line from the peer within {timeout_s} s")
            if self._sel.select(left):
                chunk = os.read(self._fd, 65536)
                if not chunk:
                    raise EOFError("the peer closed its output")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def try_read_line(self):
        """A line if a whole one has come, else None; never waits."""
        if b"\n" not in self._buf and self._sel.select(0):
            chunk = os.read(self._fd, 65536)
            if not chunk:
                raise EOFError("the peer closed its output")
            self._buf += chunk
        if b"\n" not in self._buf:
            return None
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def read_message(self, prefix, timeout_s):
        """The next line starting with `prefix` (other lines, e.g. UCX's, are skipped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.read_line(max(0.001, deadline - time.monotonic()))
            if line.startswith(prefix):
                return line[len(prefix):].strip()


def poll(fn, timeout_s, what):
    """Calls fn() until it returns something truthy, for at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.002)
    raise TimeoutError(f"{what}: not within {timeout_s} s")
