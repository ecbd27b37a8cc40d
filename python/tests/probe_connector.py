"""The vLLM harness's probe connector: a KVConnectorBase_V1 that moves no KV and records
every call vLLM makes on it, so that the harness (vllm_harness.py) can show what vLLM
calls, in which order and with what, for both roles. Test-only; the plugin's own tests
load kvstream.vllm in its place through the same kv_connector_module_path.

Its behaviour comes from kv_connector_extra_config (all optional):
  "probe_load_async": bool   consumer: get_num_new_matched_tokens' second value
                              (default False: the request runs at once, loading layer by
                              layer, as kvstream's layer-wise streaming does)
  "probe_delay_free": bool   producer: request_finished returns True for requests with
                              kv_transfer_params["do_remote_decode"] (default True)

Consumer: a request whose kv_transfer_params has "do_remote_prefill" gets all of its
prompt but the last token from "remote" (kvstream's GetNumNewMatchedTokens rule). The
worker reports it finished receiving (async loads) one step after it was bound as a load.
Producer: the worker reports a request finished sending on the first get_finished() call
whose finished_req_ids names it after it was saved (vLLM asserts that a finished_sending id
is a request it still holds, see VLLM_NOTES.md).

The metadata in both directions is bytes (JSON here; kvstream's own encodings there), to
exercise the shape kvstream.vllm will have: vLLM pickles the metadata objects between the
scheduler's and the workers' processes.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

# Every call on every ProbeConnector in this process, in order: (role name, method, args
# summary). Tests clear it with reset_calls().
_CALLS: list[tuple[str, str, dict[str, Any]]] = []
_CALLS_LOCK = threading.Lock()
# Every ProbeConnector created in this process, by role name.
INSTANCES: dict[str, list["ProbeConnector"]] = {"SCHEDULER": [], "WORKER": []}


def calls() -> list[tuple[str, str, dict[str, Any]]]:
    with _CALLS_LOCK:
        return list(_CALLS)


def reset_calls() -> None:
    with _CALLS_LOCK:
        _CALLS.clear()
    for v in INSTANCES.values():
        v.clear()


class ProbeConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker: one step's plan as bytes."""

    def __init__(self, payload: bytes):
        self.payload = payload

    def decode(self) -> dict[str, Any]:
        return json.loads(self.payload.decode())


class ProbeWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: what the worker learned in a step, as bytes (one list of
    reports, one per worker: aggregate() concatenates them, as vLLM's KVOutputAggregator
    does across tensor-parallel workers)."""

    def __init__(self, payloads: list[bytes]):
        self.payloads = payloads

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, ProbeWorkerMetadata)
        return ProbeWorkerMetadata(self.payloads + other.payloads)


def _block_ids(blocks: Any) -> list[int]:
    """KVCacheBlocks -> the one group's block ids (the harness's models have one group)."""
    groups = blocks.get_block_ids()
    assert len(groups) == 1, f"probe connector expects one KV cache group, got {len(groups)}"
    return list(groups[0])


class ProbeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._load_async = bool(extra.get("probe_load_async", False))
        self._delay_free = bool(extra.get("probe_delay_free", True))
        self._is_producer = self._kv_transfer_config.is_kv_producer
        self._is_consumer = self._kv_transfer_config.is_kv_consumer
        # Scheduler side.
        self._pending_loads: dict[str, dict[str, Any]] = {}
        self._pending_saves: dict[str, list[int]] = {}
        self._worker_reports: list[dict[str, Any]] = []
        # Worker side.
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._bound: dict[str, Any] | None = None
        self._recv_due: set[str] = set()   # async loads to report finished next time
        self._saved: set[str] = set()      # saved, not yet reported finished sending
        self._finished_seen: set[str] = set()
        self._layers_waited: list[str] = []
        self._layers_saved: list[str] = []
        INSTANCES[role.name].append(self)
        self._record("__init__", kv_role=self._kv_transfer_config.kv_role,
                     has_kv_cache_config=kv_cache_config is not None)

    def _record(self, method: str, **args: Any) -> None:
        with _CALLS_LOCK:
            _CALLS.append((self.role.name, method, args))

    # ---- scheduler side -------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        params = request.kv_transfer_params or {}
        n = 0
        if self._is_consumer and params.get("do_remote_prefill"):
            n = max(0, len(request.prompt_token_ids) - 1 - num_computed_tokens)
        load_async = self._load_async and n > 0
        self._record("get_num_new_matched_tokens", request_id=request.request_id,
                     num_computed_tokens=num_computed_tokens, result=(n, load_async))
        return n, load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        block_ids = _block_ids(blocks)
        self._record("update_state_after_alloc", request_id=request.request_id,
                     block_ids=block_ids, num_external_tokens=num_external_tokens)
        if num_external_tokens > 0:
            self._pending_loads[request.request_id] = {
                "prompt_token_ids": list(request.prompt_token_ids),
                "block_ids": block_ids,
                "num_tokens": num_external_tokens,
                "async": self._load_async,
            }

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        block_state = scheduler_output.kv_connector_block_state
        scheduled = dict(scheduler_output.num_scheduled_tokens)
        saves = {}
        if self._is_producer and block_state is not None:
            for req_id in scheduled:
                ids = block_state.get_block_ids(req_id)
                if ids is not None:
                    saves[req_id] = list(ids[0])
        plan = {
            "loads": self._pending_loads,
            "scheduled": scheduled,
            "saves": saves,
            "finished": sorted(scheduler_output.finished_req_ids),
        }
        self._pending_loads = {}
        self._record("build_connector_meta", scheduled=scheduled,
                     new_reqs=[r.req_id for r in scheduler_output.scheduled_new_reqs],
                     has_sync_kv_loads=scheduler_output.has_sync_kv_loads,
                     has_block_state=block_state is not None,
                     finished_req_ids=sorted(scheduler_output.finished_req_ids))
        return ProbeConnectorMetadata(json.dumps(plan, sort_keys=True).encode())

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        reports = []
        if meta is not None:
            assert isinstance(meta, ProbeWorkerMetadata)
            reports = [json.loads(p.decode()) for p in meta.payloads]
        self._worker_reports.extend(reports)
        self._record("update_connector_output",
                     finished_sending=sorted(connector_output.finished_sending or ()),
                     finished_recving=sorted(connector_output.finished_recving or ()),
                     invalid_block_ids=sorted(connector_output.invalid_block_ids),
                     worker_reports=reports)

    def request_finished(self, request, block_ids: list[int]):
        params = request.kv_transfer_params or {}
        delay = bool(self._is_producer and self._delay_free and params.get("do_remote_decode"))
        out_params = {"probe_block_ids": list(block_ids)} if delay else None
        self._record("request_finished", request_id=request.request_id,
                     block_ids=list(block_ids), status=str(request.status), result=delay)
        return delay, out_params

    # ---- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = dict(kv_caches)
        self._record("register_kv_caches", layers={
            name: {"shape": tuple(t.shape), "stride": tuple(t.stride()),
                   "dtype": str(t.dtype), "device": str(t.device)}
            for name, t in kv_caches.items()})

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(connector_metadata, ProbeConnectorMetadata)
        super().bind_connector_metadata(connector_metadata)
        self._bound = connector_metadata.decode()
        self._layers_waited, self._layers_saved = [], []
        self._record("bind_connector_metadata", plan=self._bound)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        assert self._bound is not None
        for req_id, load in self._bound["loads"].items():
            if load["async"]:
                self._recv_due.add(req_id)
        self._record("start_load_kv", loads=sorted(self._bound["loads"]))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._layers_waited.append(layer_name)
        self._record("wait_for_layer_load", layer_name=layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs: Any) -> None:
        self._layers_saved.append(layer_name)
        self._record("save_kv_layer", layer_name=layer_name, shape=tuple(kv_layer.shape),
                     is_registered=kv_layer.data_ptr() == self.kv_caches[layer_name].data_ptr())

    def wait_for_save(self) -> None:
        assert self._bound is not None
        if self._is_producer:
            self._saved.update(self._bound["saves"])
        self._record("wait_for_save", saves=sorted(self._bound["saves"]))

    def get_finished(self, finished_req_ids: set[str]):
        self._finished_seen |= set(finished_req_ids)
        sending = {r for r in self._saved if r in self._finished_seen}
        self._saved -= sending
        self._finished_seen -= sending
        recving, self._recv_due = self._recv_due, set()
        self._record("get_finished", finished_req_ids=sorted(finished_req_ids),
                     result=(sorted(sending), sorted(recving)))
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._record("get_block_ids_with_load_errors")
        return set()

    def build_connector_worker_meta(self):
        report = {"layers_waited": self._layers_waited, "layers_saved": self._layers_saved}
        self._record("build_connector_worker_meta", report=report)
        return ProbeWorkerMetadata([json.dumps(report).encode()])

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._bound = None
        self._record("clear_connector_metadata")
