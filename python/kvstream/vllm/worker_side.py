"""WorkerSide: kvstream.vllm in each of vLLM's worker processes, over kvstream's C++
worker side (kvstream.ConnectorWorker), which owns the transport, the control channel and
the registrations of vLLM's KV cache tensors.

The per-layer calls go straight through: wait_for_layer_load is kvstream's wait before a
layer's attention (it returns at the load deadline at the latest: a load that failed
becomes a load error, never an exception in the forward pass), save_kv_layer posts the
layer's sends and returns. A producer's saves for requests whose KV was computed in an
earlier step (kept for a late hand-off, scheduler_side.py) go out in wait_for_save, layer
by layer, also in steps without a forward pass.

What kvstream reports finished is held until vLLM may hear it: vLLM frees the blocks of
every id a worker names in finished_sending / finished_recving (and asserts it still
holds the request), so an id is named only once the scheduler has said that vLLM finished
the request with its free delayed (the metadata's `delayed`), and dropped if vLLM freed it
without waiting (`settled`).

Thread safety: vLLM calls it from the thread running the model; kvstream's worker side may
be called from any thread.
"""

from __future__ import annotations

import logging
from typing import Any

from kvstream.vllm import kv_tensors
from kvstream.vllm import settings as cfg

logger = logging.getLogger("kvstream.vllm")


def tensor_parallel_rank(vllm_config) -> tuple[int, int]:
    size = int(vllm_config.parallel_config.tensor_parallel_size)
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise NotImplementedError("kvstream.vllm: pipeline parallelism is not supported")
    if size == 1:
        return 0, 1
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), size


class WorkerSide:
    def __init__(self, vllm_config, rank: tuple[int, int] | None = None):
        import kvstream

        c = vllm_config.kv_transfer_config
        self._vllm_config = vllm_config
        self._settings = cfg.plugin_settings(c)
        self._rank, size = rank if rank is not None else tensor_parallel_rank(vllm_config)
        self._worker = kvstream.ConnectorWorker(
            cfg.kvstream_config(c, tp_rank=self._rank, tp_size=size))
        self._consumer = c.kv_role in ("kv_consumer", "kv_both")
        self._producer = c.kv_role in ("kv_producer", "kv_both")
        self._caches: dict[str, Any] = {}
        self._cuda = False
        self._vid_of: dict[str, str] = {}   # transfer id -> vLLM id
        self._delayed: set[str] = set()      # vLLM ids vLLM finished, free delayed
        self._done_sending: set[str] = set()  # transfer ids kvstream finished, not yet named
        self._done_recving: set[str] = set()
        self._release: list[str] = []
        self._invalid: set[int] = set()
        self._saves = False                  # this step's metadata has saves
        self._saved: set[str] = set()        # layers posted this step
        self._report: bytes | None = None
        self._stats_before: dict[str, Any] | None = None

    @property
    def control_address(self) -> str:
        """Producer: the "ip:port" kvstream listens on (for consumers' remote_host/port)."""
        return self._worker.control_address

    @property
    def worker(self):
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        override = self._settings.attention_backend
        caches = kv_tensors.borrow_kv_caches(kv_caches, self._vllm_config, override)
        mc = self._vllm_config.model_config
        self._worker.set_model_info(
            vocab_size=int(mc.get_vocab_size()), max_model_len=int(mc.max_model_len),
            fingerprint=kv_tensors.model_fingerprint(self._vllm_config, kv_caches, override))
        self._worker.register_kv_caches(caches)
        self._caches = caches
        self._cuda = any(getattr(t, "is_cuda", False) for t in kv_caches.values())

    # ---- the step ----

    def bind_connector_metadata(self, meta) -> None:
        import kvstream

        self._vid_of.update(meta.ids)
        self._delayed.update(meta.delayed)
        settled = set(meta.settled)
        if settled:
            for tid in [t for t, v in self._vid_of.items() if v in settled]:
                self._forget(tid)
        for vid in meta.release:
            self._release.append(vid)
            for tid in [t for t, v in self._vid_of.items() if v == vid]:
                self._forget(tid)
        self._invalid.update(meta.invalid)
        data = meta.kvstream
        decoded = None
        if self._producer or (self._consumer and self._rank > 0):
            decoded = kvstream.decode_connector_metadata(data)
            self._saves = bool(decoded["saves"])
        if self._consumer and self._rank > 0 and decoded["loads"]:
            # Tensor-parallel rank r hands its shard to the producer's rank r, which
            # listens r ports above rank 0 (settings.kvstream_config).
            for load in decoded["loads"]:
                load["remote_port"] += self._rank
            data = kvstream.encode_connector_metadata(decoded)
        try:
            self._worker.bind_connector_metadata(data)
        except kvstream.KvstreamError as e:
            # The requests concerned become load errors or failed sends in the output.
            logger.error("kvstream.vllm: step metadata refused: %s", e)

    def start_load_kv(self) -> None:
        if not self._consumer:
            return
        import kvstream

        try:
            self._worker.start_load_kv()
        except kvstream.KvstreamError as e:
            logger.error("kvstream.vllm: start_load_kv: %s", e)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._consumer:
            return
        import kvstream

        try:
            self._worker.wait_for_layer_load(layer_name, self._stream())
        except kvstream.KvstreamError as e:
            logger.error("kvstream.vllm: wait_for_layer_load(%s): %s", layer_name, e)

    def save_kv_layer(self, layer_name: str) -> None:
        if not self._saves or layer_name not in self._caches:
            return
        self._post(layer_name)

    def wait_for_save(self) -> None:
        if not self._saves:
            return
        import kvstream

        # Layers not posted during a forward (a step with none, whose saves are all of
        # KV computed earlier): the cache holds their KV, post them now. kvstream posts
        # a request's layer once, whoever asks twice.
        for name in self._caches:
            if name not in self._saved:
                self._post(name)
        try:
            self._worker.wait_for_save()
        except kvstream.KvstreamError as e:
            logger.error("kvstream.vllm: wait_for_save: %s", e)

    def clear_connector_metadata(self) -> None:
        self._worker.clear_connector_metadata()
        self._saves = False
        self._saved.clear()

    def _post(self, layer_name: str) -> None:
        import kvstream

        self._saved.add(layer_name)
        try:
            self._worker.save_kv_layer(layer_name, stream=self._stream())
        except kvstream.KvstreamError as e:
            logger.error("kvstream.vllm: save_kv_layer(%s): %s", layer_name, e)

    def _stream(self) -> int:
        if not self._cuda:
            return 0
        import torch

        return int(torch.cuda.current_stream().cuda_stream)

    # ---- reports ----

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        import kvstream

        report = self._worker.take_output()
        out = kvstream.decode_connector_output(report)
        if out["finished_sending"] or out["finished_recving"] or out["load_errors"] or \
                out["incoming"]:
            self._report = report
        # An id kvstream finishes before the scheduler mapped it was never bound to a vLLM
        # request (a hand-off stopped first); the scheduler side learns it from the report.
        self._done_sending |= {t for t in out["finished_sending"] if t in self._vid_of}
        self._done_recving |= {t for t in out["finished_recving"] if t in self._vid_of}
        sending = set(self._release)
        self._release.clear()
        sending |= self._named(self._done_sending)
        recving = self._named(self._done_recving)
        return sending or None, recving or None

    def _named(self, done: set[str]) -> set[str]:
        named = set()
        for tid in [t for t in done if self._vid_of.get(t) in self._delayed]:
            named.add(self._vid_of[tid])
            self._forget(tid)
        return named

    def _forget(self, tid: str) -> None:
        vid = self._vid_of.pop(tid, None)
        self._delayed.discard(vid)
        self._done_sending.discard(tid)
        self._done_recving.discard(tid)

    def get_block_ids_with_load_errors(self) -> set[int]:
        ids = set(self._worker.get_block_ids_with_load_errors()) | self._invalid
        self._invalid = set()
        return ids

    def build_connector_worker_meta(self):
        from kvstream.vllm.messages import KvstreamWorkerMetadata

        if self._report is None:
            return None
        meta = KvstreamWorkerMetadata(reports=[(self._rank, self._report)])
        self._report = None
        return meta

    def get_kv_connector_stats(self):
        from kvstream.vllm.messages import KvstreamConnectorStats, stats_delta

        now = self._worker.stats()
        delta = stats_delta(now, self._stats_before)
        self._stats_before = now
        stats = KvstreamConnectorStats(data=delta)
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        self._worker.close()
