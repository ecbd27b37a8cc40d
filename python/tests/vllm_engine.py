"""One vLLM engine with kvstream.vllm as its KV connector, for the plugin's tests: vLLM's
real config, scheduler, Request objects, KV cache tensors and model-runner connector
sequence (vllm_harness.py), with a stand-in for the model that writes each scheduled
token's K and V into vLLM's cache tensors where the attention backend would (KV values
that name their layer, position and token, so a receiver can check every byte), between
the layer's wait_for_layer_load and its save_kv_layer, as vLLM's attention op does.

Both engines of a test pair use it: the decode engine in the test process, the prefill
engine in vllm_peer.py.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

import vllm_harness as harness
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.forward_context import set_forward_context
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

CONNECTOR = dict(connector="KvstreamConnector", module_path="kvstream.vllm")
NUM_BLOCKS = 64
BLOCK = 16
LAYERS = harness.TINY.layer_names()
D = harness.TINY.head_size
H = harness.TINY.num_kv_heads

# (attention backend, KV cache layout) pairs the tests run: the CPU backend's own, and
# FlashAttention's format in the layout Hopper GPUs get.
FORMATS = {"cpu": ("CPU_ATTN", harness.CPU_LAYOUT),
           "flash": ("FLASH_ATTN", harness.GPU_DEFAULT_LAYOUT)}


def kv_views(tensor: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer's cache as [blocks, block_size, heads, D], split the way vLLM's
    attention backend splits the tensor (cpu_attn.py: a head's page as 2N rows;
    flash_attn.py: transpose(1, 2).split(head_size, -1))."""
    if backend == "CPU_ATTN":
        b, h, n, _ = tensor.shape
        k, v = tensor.view(b, h, 2 * n, -1).chunk(2, dim=2)
        return k.transpose(1, 2), v.transpose(1, 2)
    k, v = tensor.transpose(1, 2).split(D, dim=-1)
    return k, v


def kv_value(layer: int, position: int, token: int, is_v: bool) -> torch.Tensor:
    """A token's [heads, D] K (or V) in one layer: exact in float32 (integers below 2^14
    plus multiples of 2^-10), different for every layer, position, token and head."""
    base = float(token * 7 + position * 13 + layer * 1031 + (517 if is_v else 0))
    return base + torch.arange(H * D, dtype=torch.float32).reshape(H, D) / 1024.0


def expected_tokens(layer: int, prompt: list[int], num_tokens: int, is_v: bool) -> torch.Tensor:
    return torch.stack([kv_value(layer, p, prompt[p], is_v) for p in range(num_tokens)])


def read_tokens(view: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    return torch.stack([view[block_ids[p // BLOCK], p % BLOCK] for p in range(num_tokens)])


class Engine:
    """The scheduler (and its SCHEDULER connector), the WORKER connector and the caches of
    one engine. The worker connector is vLLM's process-wide KV transfer group while a step
    runs (one Engine stepping at a time per process)."""

    def __init__(self, model_dir: str, kv_role: str, *, fmt: str = "cpu",
                 extra: dict[str, Any] | None = None, kv_port: int = 0,
                 engine_id: str | None = None, kv_load_failure_policy: str = "recompute"):
        self.backend, layout = FORMATS[fmt]
        extra = {"transport": "ucx", "ucx_tls": "shm", "attention_backend": self.backend,
                 **(extra or {})}
        self.config = harness.make_vllm_config(
            model_dir, kv_role=kv_role, extra_config=extra, engine_id=engine_id,
            kv_cache_layout=layout, kv_load_failure_policy=kv_load_failure_policy,
            **CONNECTOR)
        self.config.kv_transfer_config.kv_port = kv_port
        self.kv_cache_config = harness.make_kv_cache_config(self.config, NUM_BLOCKS)
        self.scheduler = harness.make_scheduler(self.config, self.kv_cache_config)
        self.worker = harness.make_worker_connector(self.config, self.kv_cache_config)
        self.kv_caches = harness.allocate_kv_caches(self.config, self.kv_cache_config)
        self.worker.register_kv_caches(self.kv_caches)
        self.views = {n: kv_views(t, self.backend) for n, t in self.kv_caches.items()}
        self.on_layer_loaded: Callable[[int, str], None] | None = None
        self.finished: dict[str, Any] = {}   # request id -> its final EngineCoreOutput
        self.steps = 0

    @property
    def connector(self):
        return self.scheduler.connector

    def add(self, request_id: str, prompt: list[int], *, max_tokens: int = 2,
            kv_transfer_params: dict[str, Any] | None = None):
        self.scheduler.add_request(harness.make_request(
            self.config, request_id, prompt, max_tokens=max_tokens,
            kv_transfer_params=kv_transfer_params))

    def block_ids(self, request_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[0])

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def busy(self) -> bool:
        return self.scheduler.has_requests()

    def step(self):
        """One engine step (EngineCore.step): schedule, the worker's step with both
        SchedulerOutput and ModelRunnerOutput pickled as between processes,
        update_from_output. Returns the SchedulerOutput."""
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
        out = self.scheduler.schedule()
        sent = harness.cross_process(out)
        kv_out = self._worker_step(sent)
        mro = harness.cross_process(harness.model_runner_output(self.scheduler, out, kv_out))
        for engine_outputs in self.scheduler.update_from_output(out, mro).values():
            for o in engine_outputs.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o
        self.steps += 1
        return out

    def run_until(self, done: Callable[[], bool], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine not done within {timeout_s} s "
                                   f"({self.steps} steps)")
            self.step()

    def _worker_step(self, so):
        with set_forward_context(None, self.config):
            if so.total_num_scheduled_tokens == 0:
                return KVConnectorModelRunnerMixin.kv_connector_no_forward(
                    so, self.config).kv_connector_output
            # What the attention op writes this step: each scheduled token's K and V.
            writes = []
            for new in so.scheduled_new_reqs:
                writes.append((new.req_id, new.num_computed_tokens))
            cached = so.scheduled_cached_reqs
            writes += list(zip(cached.req_ids, cached.num_computed_tokens))
            with KVConnectorModelRunnerMixin._get_kv_connector_output(so) as out:
                metadata = harness._HarnessAttnMetadata()
                for layer, name in enumerate(LAYERS):
                    self.worker.wait_for_layer_load(name)
                    if self.on_layer_loaded is not None:
                        self.on_layer_loaded(layer, name)
                    for req_id, start in writes:
                        self._write(layer, name, req_id, start, so.num_scheduled_tokens[req_id])
                    self.worker.save_kv_layer(name, self.kv_caches[name], metadata)
        return out

    def _write(self, layer, name, req_id, start, count):
        request = self.scheduler.requests[req_id]
        blocks = self.block_ids(req_id)
        k, v = self.views[name]
        for p in range(start, start + count):
            token = request.all_token_ids[p]
            k[blocks[p // BLOCK], p % BLOCK] = kv_value(layer, p, token, False)
            v[blocks[p // BLOCK], p % BLOCK] = kv_value(layer, p, token, True)
