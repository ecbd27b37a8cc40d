"""KvstreamConnector: vLLM's KVConnectorBase_V1 over kvstream's layer-wise connector.

vLLM creates it twice: in the scheduler's process (role SCHEDULER: SchedulerSide, over
kvstream's C++ scheduler side) and in every worker (role WORKER: WorkerSide, over the C++
worker side). Each method of the base class is delegated to the side of its role; the
metadata crosses between them as bytes (messages.py). kvstream's native module is loaded
by the constructor, not by importing this module (vLLM imports it while it builds its
config, also in processes that never create a connector).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from kvstream.vllm.messages import KvstreamConnectorMetadata, KvstreamConnectorStats


class KvstreamConnector(KVConnectorBase_V1):
    """Layer-wise KV streaming between a prefill engine (kv_producer) and a decode engine
    (kv_consumer). Load it with

        KVTransferConfig(kv_connector="KvstreamConnector",
                         kv_connector_module_path="kvstream.vllm", kv_role=...,
                         kv_port=..., kv_connector_extra_config={...})

    and give each request kv_transfer_params naming one transfer id on both engines
    (docs/python.md, "vLLM")."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._scheduler = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from kvstream.vllm.scheduler_side import SchedulerSide

            self._scheduler = SchedulerSide(vllm_config, kv_cache_config,
                                            lambda: self._kv_cache_manager)
        else:
            from kvstream.vllm.worker_side import WorkerSide

            self._worker = WorkerSide(vllm_config)

    # ---- class-level hooks ----

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # wait_for_layer_load / save_kv_layer run between the layers: a CUDA graph over
        # the whole forward would skip them.
        return True

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        return None  # any layout: kvstream reads the tensors' strides

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return KvstreamConnectorStats(data=dict(data or {}))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        return False  # kvstream registers the cache memory once

    # ---- worker side ----

    @property
    def worker_side(self):
        """The WorkerSide (role WORKER), or None."""
        return self._worker

    @property
    def scheduler_side(self):
        """The SchedulerSide (role SCHEDULER), or None."""
        return self._scheduler

    def register_kv_caches(self, kv_caches):
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if not isinstance(connector_metadata, KvstreamConnectorMetadata):
            raise TypeError(f"kvstream.vllm: step metadata of type "
                            f"{type(connector_metadata).__name__}")
        # The base class keeps it too: vLLM's attention wrapper calls the per-layer hooks
        # only while has_connector_metadata() is true.
        super().bind_connector_metadata(connector_metadata)
        self._worker.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self._worker.clear_connector_metadata()
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        # kvstream sends from the cache it registered for the layer (kv_layer is the same
        # tensor) and takes the blocks from the step's metadata, not from attn_metadata.
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self):
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]):
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Loads are synchronous (load_async False): a failed one is reported through
        # get_block_ids_with_load_errors in the step it failed, never in failed_recving.
        sending, recving = self._worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()))

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self):
        return self._worker.build_connector_worker_meta()

    def get_kv_connector_stats(self):
        if self._worker is None:
            return None  # the scheduler side counts nothing of its own
        return self._worker.get_kv_connector_stats()

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]):
        return self._scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()
