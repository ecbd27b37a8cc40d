"""SchedulerSide: kvstream.vllm in vLLM's scheduler process, over kvstream's C++
scheduler side (kvstream.ConnectorScheduler).

vLLM gives one client request a different id in each engine, so kvstream knows every
request by a transfer id that both engines receive in kv_transfer_params (settings.py);
this class maps vLLM's ids to transfer ids and back, and tells the workers the mapping in
the step's metadata (messages.py).

Consumer (decode engine; kv_transfer_params do_remote_prefill, remote_host, remote_port):
kvstream says how many prompt tokens come from the producer (all but the last); they load
synchronously, layer by layer, in the request's first step. A request with a local
prefix-cache hit loads nothing (kvstream hands over a prompt's whole prefix, which would
overwrite the shared cached blocks) and is computed here.

Producer (prefill engine; do_remote_decode): vLLM's proxy, not kvstream, brings the
request to this engine, while the consumer's hand-off (its destination blocks) arrives
through kvstream's control channel. The request is matched with its hand-off by transfer
id: a request whose kv_transfer_params name a transfer id (a proxy that sends it to both
engines at once) waits up to handoff_wait_ms for it (get_num_new_matched_tokens returns
None: "ask again"), then streams each layer right after that layer's attention in the step
that completes its prompt. A request whose hand-off has not come by then, or that names no
transfer id, is prefilled anyway; its blocks are kept when it finishes, for up to
handoff_keep_ms, and go out as soon as the hand-off arrives. A proxy that waits for the
prefill's answer before it sends the request to the decode engine works this way:
request_finished's kv_transfer_params (this engine's address and the transfer id, the
request's own id when the proxy gave none) are what the decode engine's request needs.

A request's blocks stay allocated (request_finished -> True) while kvstream still uses
them, and a worker reports it finished only after vLLM finished it (worker_side.py), since
vLLM frees the blocks of whatever id a worker reports.

Not thread-safe: vLLM calls it from its scheduler thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvstream.vllm import settings as cfg
from kvstream.vllm.output_join import WorkerOutputJoiner

logger = logging.getLogger("kvstream.vllm")


@dataclass
class _Bound:  # producer: a request matched with its consumer's hand-off
    tid: str  # kvstream's id of the hand-off (scoped by its consumer)
    prompt: list[int]
    num_tokens: int
    allocated: bool = False  # kvstream has its blocks (its save goes out this step or later)


@dataclass
class _Kept:  # producer: prefilled before its hand-off came; its blocks are kept
    tid: str  # the transfer id
    prompt: list[int]
    blocks: list[int]
    deadline: float
    handoff_id: str | None = None  # kvstream's id, once the hand-off came: it goes out next


@dataclass
class _Offer:  # consumer: get_num_new_matched_tokens said tokens come from remote
    tid: str
    prompt: list[int]
    remote: tuple[str, int]


@dataclass
class _Outbox:  # what the next metadata tells the workers
    ids: dict[str, str] = field(default_factory=dict)
    delayed: list[str] = field(default_factory=list)
    settled: list[str] = field(default_factory=list)
    release: list[str] = field(default_factory=list)
    invalid: list[int] = field(default_factory=list)


class SchedulerSide:
    def __init__(self, vllm_config, kv_cache_config,
                 kv_cache_manager: Callable[[], Any],
                 clock: Callable[[], float] = time.monotonic):
        """kv_cache_manager: returns vLLM's KVCacheManager (bound after construction),
        for block ids where the step's block state does not have them."""
        import kvstream

        c = vllm_config.kv_transfer_config
        self._settings = cfg.plugin_settings(c)
        self._kv_port = int(c.kv_port)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise NotImplementedError("kvstream.vllm: pipeline parallelism is not supported")
        self._block_size = _block_size(vllm_config, kv_cache_config)
        self._sched = kvstream.ConnectorScheduler(cfg.kvstream_config(c), self._block_size)
        self._joiner = WorkerOutputJoiner(parallel.tensor_parallel_size)
        self._consumer = c.kv_role in ("kv_consumer", "kv_both")
        self._producer = c.kv_role in ("kv_producer", "kv_both")
        self._manager = kv_cache_manager
        self.clock = clock  # the deadlines' clock (monotonic seconds); tests replace it
        self._tid_of: dict[str, str] = {}   # vLLM id -> transfer id, for kvstream's requests
        self._outbox = _Outbox()
        self._pending: set[str] = set()      # delay-freed ids no worker has reported yet
        # consumer
        self._offers: dict[str, _Offer] = {}
        self._decided: set[str] = set()      # remote-prefill requests already handled once
        # producer
        # transfer id -> (hand-off, when it came); the hand-off's request_id is kvstream's
        # id of it, "<consumer scope>/<transfer id>" (transfer_key)
        self._handoffs: dict[str, tuple[dict[str, Any], float]] = {}
        self._waiting: dict[str, float] = {}  # vLLM id -> since when it waits for a hand-off
        self._bound: dict[str, _Bound] = {}
        self._local: dict[str, str] = {}      # vLLM id -> tid, prefilled without its hand-off
        self._local_only: set[str] = set()    # prefilled, never to be sent
        self._kept: dict[str, _Kept] = {}
        self._gone: dict[str, float] = {}     # tid -> until when: no hand-off will be served

    # ---- requests coming in ----

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        params = cfg.transfer_params(request)
        try:
            if self._consumer and params.get(cfg.DO_REMOTE_PREFILL):
                return self._consumer_match(request, params, num_computed_tokens), False
            if self._producer and params.get(cfg.DO_REMOTE_DECODE):
                return self._producer_match(request, params), False
        except ValueError as e:  # a bad transfer id: the request is computed here
            logger.warning("%s; request %s is computed without a transfer", e,
                           request.request_id)
            self._decided.add(request.request_id)
            self._local_only.add(request.request_id)
        return 0, False

    def _consumer_match(self, request, params, num_computed_tokens) -> int:
        import kvstream

        vid = request.request_id
        if vid in self._decided or vid in self._tid_of:
            return 0  # loaded (or refused) once; a preempted request recomputes
        host, port = params.get("remote_host"), params.get("remote_port")
        prompt = list(request.prompt_token_ids or [])
        reason = None
        if num_computed_tokens > 0:
            reason = f"{num_computed_tokens} tokens are in the local prefix cache"
        elif not isinstance(host, str) or not isinstance(port, int) or not prompt:
            reason = "kv_transfer_params lack remote_host / remote_port (or it has no prompt)"
        if reason:
            self._decided.add(vid)
            logger.info("kvstream.vllm: request %s computes its prompt here: %s", vid, reason)
            return 0
        tid = cfg.transfer_id(request, params)
        n, _ = self._sched.get_num_new_matched_tokens(
            kvstream.Request(tid, prompt, (host, port)), 0)
        if n > 0:
            self._offers[vid] = _Offer(tid, prompt, (host, port))
        return n

    def _producer_match(self, request, params) -> int | None:
        vid = request.request_id
        if vid in self._bound or vid in self._local or vid in self._local_only:
            return 0
        tid = cfg.transfer_id(request, params)
        prompt = list(request.prompt_token_ids or [])
        handoff = self._handoffs.pop(tid, None)
        if handoff is not None:
            self._waiting.pop(vid, None)
            h = handoff[0]
            if h["prompt_token_ids"] != prompt:
                self._refuse(h["request_id"], f"its hand-off's {len(h['prompt_token_ids'])} prompt tokens "
                                  f"differ from request {vid}'s {len(prompt)}")
                self._local_only.add(vid)
                return 0
            self._bound[vid] = _Bound(h["request_id"], prompt, int(h["num_tokens"]))
            self._map(vid, h["request_id"])
            return 0
        if tid in self._gone or not prompt:
            self._local_only.add(vid)
            return 0
        if cfg.TRANSFER_ID not in params:
            # No proxy-given id: the consumer can learn this request's id only from this
            # engine's answer, so its hand-off cannot come before the prefill.
            self._local[vid] = tid
            return 0
        now = self.clock()
        since = self._waiting.setdefault(vid, now)
        if (now - since) * 1000.0 < self._settings.handoff_wait_ms:
            return None  # vLLM asks again next step; the hand-off may come meanwhile
        self._waiting.pop(vid)
        self._local[vid] = tid
        return 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        import kvstream

        vid = request.request_id
        offer = self._offers.pop(vid, None)
        if offer is None or num_external_tokens <= 0:
            return
        self._decided.add(vid)
        block_ids = list(blocks.get_block_ids()[0])
        try:
            self._sched.update_state_after_alloc(
                kvstream.Request(offer.tid, offer.prompt, offer.remote), block_ids,
                num_external_tokens)
        except kvstream.KvstreamError as e:
            # vLLM counts the tokens as loaded already: their blocks must be reported as
            # load errors, so that vLLM recomputes them (or fails the request).
            logger.error("kvstream.vllm: request %s (transfer %s) cannot load: %s",
                         vid, offer.tid, e)
            need = -(-num_external_tokens // self._block_size)
            self._outbox.invalid.extend(block_ids[:need])
            return
        self._map(vid, offer.tid)

    # ---- the step ----

    def build_connector_meta(self, scheduler_output):
        import kvstream
        from kvstream.vllm.messages import KvstreamConnectorMetadata

        self._expire(self.clock())
        for vid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._preempted(vid)
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        scheduled = []
        for vid, n in scheduler_output.num_scheduled_tokens.items():
            tid = self._tid_of.get(vid)
            if tid is None:
                continue
            done = computed.get(vid, 0)
            b = self._bound.get(vid)
            if b is not None and not b.allocated and done + n >= b.num_tokens:
                # The step that completes the tokens the consumer wants: every block is
                # allocated now (not so at admission, with chunked prefill).
                blocks = self._block_ids(scheduler_output, vid)
                self._sched.update_state_after_alloc(kvstream.Request(tid, b.prompt), blocks, 0)
                b.allocated = True
            scheduled.append((tid, done, n))
        late = [vid for vid, k in self._kept.items() if k.handoff_id is not None]
        for vid in late:
            k = self._kept.pop(vid)
            self._sched.update_state_after_alloc(kvstream.Request(k.handoff_id, k.prompt),
                                                 k.blocks, 0)
            self._map(vid, k.handoff_id)
            scheduled.append((k.handoff_id, len(k.prompt), 0))
        meta = self._sched.build_connector_meta(scheduled)
        for vid in late:
            # vLLM finished it already (its free is delayed, the workers know): kvstream's
            # side now holds the blocks until the sends end.
            tid = self._tid_of.pop(vid)
            if not self._sched.request_finished(tid):
                self._outbox.release.append(vid)
        out, self._outbox = self._outbox, _Outbox()
        return KvstreamConnectorMetadata(kvstream=meta, ids=out.ids, delayed=out.delayed,
                                         settled=out.settled, release=out.release,
                                         invalid=out.invalid)

    def update_connector_output(self, kv_connector_output) -> None:
        import kvstream
        from kvstream.vllm.messages import KvstreamWorkerMetadata

        for vid in (kv_connector_output.finished_sending or ()):
            self._pending.discard(vid)
        for vid in (kv_connector_output.finished_recving or ()):
            self._pending.discard(vid)
        meta = kv_connector_output.kv_connector_worker_meta
        if not isinstance(meta, KvstreamWorkerMetadata) or not meta.reports:
            return
        joined = self._joiner.join(meta.reports)
        if joined is None:
            return
        self._sched.update_connector_output(kvstream.encode_connector_output(joined))
        accepted = {r.request_id for r in self._sched.take_incoming_requests()}
        now = self.clock()
        for h in joined["incoming"]:
            if h["request_id"] in accepted:
                self._hand_off_came(h, now)
        for kvid in joined["finished_sending"]:
            tid = transfer_key(kvid)
            if tid in self._handoffs and self._handoffs[tid][0]["request_id"] == kvid:
                # Stopped before any request of this engine took it (the consumer gave up
                # or was lost): kvstream's side forgets it, a request for it later is
                # prefilled without waiting.
                del self._handoffs[tid]
                self._sched.request_finished(kvid)
                self._gone[tid] = now + self._settings.handoff_keep_ms / 1000.0

    def _hand_off_came(self, h: dict[str, Any], now: float) -> None:
        kvid = h["request_id"]
        tid = transfer_key(kvid)
        if tid in self._gone:
            self._refuse(kvid, "its request was prefilled and freed without it")
            return
        if tid in self._handoffs:
            self._refuse(kvid, f"another consumer's hand-off of transfer {tid} is waiting")
            return
        kept = next((vid for vid, k in self._kept.items()
                     if k.tid == tid and k.handoff_id is None), None)
        if kept is not None:
            k = self._kept[kept]
            if h["prompt_token_ids"] != k.prompt:
                self._refuse(kvid, f"its prompt differs from request {kept}'s")
                del self._kept[kept]
                self._outbox.release.append(kept)
                return
            k.handoff_id = kvid
            return
        self._handoffs[tid] = (h, now)

    # ---- requests ending ----

    def request_finished(self, request, block_ids: list[int]):
        vid = request.request_id
        self._offers.pop(vid, None)
        self._decided.discard(vid)
        self._local_only.discard(vid)
        params = cfg.transfer_params(request)
        tid = self._tid_of.pop(vid, None)
        if tid is not None:
            self._bound.pop(vid, None)
            delay = bool(self._sched.request_finished(tid))
            (self._outbox.delayed if delay else self._outbox.settled).append(vid)
            if delay:
                self._pending.add(vid)
            return delay, self._producer_params(params, tid)
        waited = self._waiting.pop(vid, None)
        tid = self._local.pop(vid, None)
        if tid is not None:
            prompt = list(request.prompt_token_ids or [])
            if request.num_computed_tokens >= len(prompt) - 1 and tid not in self._gone:
                deadline = self.clock() + self._settings.handoff_keep_ms / 1000.0
                self._kept[vid] = _Kept(tid, prompt, list(block_ids), deadline)
                self._outbox.delayed.append(vid)
                self._pending.add(vid)
                return True, self._producer_params(params, tid)
            self._gone[tid] = self.clock() + self._settings.handoff_keep_ms / 1000.0
        elif waited is not None:  # finished (aborted) while it waited for its hand-off
            self._gone[cfg.transfer_id(request, params)] = (
                self.clock() + self._settings.handoff_keep_ms / 1000.0)
        return False, None

    def has_pending_push_work(self) -> bool:
        # Blocks vLLM keeps for kvstream (delay-freed, not yet reported by the workers):
        # the engine must go on stepping for the workers to report them.
        return bool(self._pending)

    # ---- helpers ----

    def _map(self, vid: str, tid: str) -> None:
        self._tid_of[vid] = tid
        self._outbox.ids[tid] = vid

    def _refuse(self, tid: str, why: str) -> None:
        logger.warning("kvstream.vllm: hand-off %s not served: %s", tid, why)
        # Queued in kvstream's side: finishing it tells the consumer, which recomputes.
        self._sched.request_finished(tid)

    def _preempted(self, vid: str) -> None:
        # vLLM freed the blocks already; kvstream stops the request (a consumer's producer
        # is told, a producer's consumer learns it was not sent).
        tid = self._tid_of.pop(vid, None)
        if tid is not None:
            self._bound.pop(vid, None)
            if self._sched.request_finished(tid):
                logger.warning("kvstream.vllm: request %s was preempted while its KV was "
                               "in flight", vid)
            self._outbox.settled.append(vid)
            self._local_only.add(vid)
        elif vid in self._local:
            self._gone[self._local.pop(vid)] = (
                self.clock() + self._settings.handoff_keep_ms / 1000.0)
            self._local_only.add(vid)

    def _expire(self, now: float) -> None:
        for vid in [v for v, k in self._kept.items() if k.deadline <= now and
                    k.handoff_id is None]:
            k = self._kept.pop(vid)
            logger.warning("kvstream.vllm: request %s: no hand-off for transfer %s within "
                           "%.0f ms; its blocks are freed", vid, k.tid,
                           self._settings.handoff_keep_ms)
            self._gone[k.tid] = now + self._settings.handoff_keep_ms / 1000.0
            self._outbox.release.append(vid)
        keep_s = self._settings.handoff_keep_ms / 1000.0
        for tid in [t for t, (_, came) in self._handoffs.items() if came + keep_s <= now]:
            h, _ = self._handoffs.pop(tid)
            self._refuse(h["request_id"], "no request of this engine took it in time")
        for tid in [t for t, until in self._gone.items() if until <= now]:
            del self._gone[tid]

    def _block_ids(self, scheduler_output, vid: str) -> list[int]:
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        ids = state.get_block_ids(vid) if state is not None else None
        if ids is None:
            ids = self._manager().get_block_ids(vid)
        return list(ids[0])

    def _producer_params(self, params: dict[str, Any], tid: str) -> dict[str, Any] | None:
        # What the consumer's request needs to hand itself over to this producer (a proxy
        # that asks the prefill engine first passes it on); without a fixed port, nothing.
        if not params.get(cfg.DO_REMOTE_DECODE) or self._kv_port == 0:
            return None
        return {cfg.DO_REMOTE_PREFILL: True, "remote_host": self._settings.kv_ip,
                "remote_port": self._kv_port, cfg.TRANSFER_ID: tid}


def transfer_key(kvstream_id: str) -> str:
    """The transfer id of a producer's kvstream request id: kvstream scopes a consumer's
    request ids by the consumer ("<scope>/<id>", the id escaped; settings.transfer_id
    admits only ids that escaping leaves as they are)."""
    return kvstream_id.split("/", 1)[1] if "/" in kvstream_id else kvstream_id


def _block_size(vllm_config, kv_cache_config) -> int:
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        raise NotImplementedError(
            f"kvstream.vllm: {len(groups)} KV cache groups (hybrid models) are not supported")
    if groups:
        return int(groups[0].kv_cache_spec.block_size)
    return int(vllm_config.cache_config.block_size)
