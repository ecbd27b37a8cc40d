"""Helpers the kvstream Python tests share: the cache shapes, deterministic cache contents,
caches carved out of one larger buffer, and line I/O with a peer process under deadlines."""

import os
import selectors
import time

import numpy as np

import kvstream

NUM_LAYERS = 4
BLOCK_SIZE = 4
NUM_KV_HEADS = 2
HEAD_SIZE = 8
HEAD_SIZE_V = 4
NUM_BLOCKS = 16


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


def carve(buffer_u8, offset_bytes, elems, head_size, layout):
    """A [num_blocks, block_size, heads, head_size] uint16 view of `elems` elements at
    `offset_bytes` into a uint8 buffer: NHD directly, HND as a permuted view."""
    flat = buffer_u8[offset_bytes:offset_bytes + 2 * elems].view(np.uint16)
    if layout == "NHD":
        return flat.reshape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, head_size)
    hnd = flat.reshape(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, head_size)
    return hnd.transpose(0, 2, 1, 3)


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


def fill(arrays, seed):
    """Deterministic contents of every layer (the consumer regenerates them to compare)."""
    rng = np.random.default_rng(seed)
    for k, v in arrays:
        k[...] = rng.integers(0, 1 << 16, size=k.shape, dtype=np.uint16)
        v[...] = rng.integers(0, 1 << 16, size=v.shape, dtype=np.uint16)


def expected_layers(seed):
    """What fill(seed) writes, as logical [blocks, tokens, heads, dim] arrays per layer."""
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
