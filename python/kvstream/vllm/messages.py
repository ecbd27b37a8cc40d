"""The objects kvstream.vllm hands to vLLM between its scheduler process and its workers.
vLLM pickles them (multiprocess executor) or passes them as they are (one worker in the
engine core's process), so each holds only bytes, strings and small containers.

KvstreamConnectorMetadata (scheduler -> every worker, one per step):
  kvstream    kvstream's step metadata (ConnectorScheduler.build_connector_meta)
  ids         {transfer id: vLLM request id} for requests that kvstream started to know
              this step; a worker keeps them until the request's transfer is settled
  delayed     vLLM request ids whose request_finished returned True: vLLM frees their
              blocks only once a worker names them in finished_sending / finished_recving
  settled     vLLM request ids vLLM finished and freed without waiting (request_finished
              returned False): a worker drops what it still holds of them
  release     vLLM request ids the plugin itself holds (a producer kept the blocks for a
              hand-off that never came): report them finished_sending now
  invalid     block ids whose KV vLLM counts as loaded but that no load will fill (a
              consumer's load kvstream refused): report them as load errors now

KvstreamWorkerMetadata (each worker -> scheduler, aggregated by vLLM across workers):
  reports     [(tensor-parallel rank, kvstream's ConnectorWorker.take_output bytes)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class KvstreamConnectorMetadata(KVConnectorMetadata):
    kvstream: bytes
    ids: dict[str, str] = field(default_factory=dict)
    delayed: list[str] = field(default_factory=list)
    settled: list[str] = field(default_factory=list)
    release: list[str] = field(default_factory=list)
    invalid: list[int] = field(default_factory=list)


@dataclass
class KvstreamWorkerMetadata(KVConnectorWorkerMetadata):
    reports: list[tuple[int, bytes]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KvstreamWorkerMetadata":
        if not isinstance(other, KvstreamWorkerMetadata):
            raise TypeError(f"kvstream.vllm: cannot aggregate {type(other).__name__} "
                            "with KvstreamWorkerMetadata")
        return KvstreamWorkerMetadata(reports=[*self.reports, *other.reports])


# kvstream's counters that are reported per interval (the difference between two
# ConnectorWorker.stats() snapshots), summed over workers.
STATS_COUNTERS = ("bytes_sent", "layers_sent", "bytes_received", "layers_received",
                  "load_errors", "send_failures", "wait_ms", "exposed_ms")


@dataclass
class KvstreamConnectorStats(KVConnectorStats):
    """What kvstream moved in an interval: STATS_COUNTERS, summed over workers."""

    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KvstreamConnectorStats":
        merged = dict(self.data)
        for key, value in (other.data or {}).items():
            merged[key] = merged.get(key, 0) + value
        return KvstreamConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {key: self.data.get(key, 0) for key in STATS_COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.get(key, 0) for key in STATS_COUNTERS)


def stats_delta(now: dict[str, Any], before: dict[str, Any] | None) -> dict[str, float]:
    before = before or {}
    return {key: now.get(key, 0) - before.get(key, 0) for key in STATS_COUNTERS}
