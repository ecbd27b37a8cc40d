"""WorkerOutputJoiner: the reports of an engine's tensor-parallel workers joined into the
one report kvstream's scheduler side expects from its single worker side.

With tensor parallelism every worker runs its own kvstream worker side over its shard of
the heads, and each reports the same request ids: a hand-off arrives once per rank (each
decode rank hands the request to the producer rank with its number), a load or send ends
once per rank. The scheduler side must see a request handed over, finished sending or
finished receiving only once every rank has said so, and a load error as soon as one rank
has one (that request's KV is incomplete). With one worker the reports pass unchanged.

Not thread-safe (the scheduler calls it from one thread).
"""

from __future__ import annotations

from collections import Counter
from typing import Any


class WorkerOutputJoiner:
    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size {world_size} must be >= 1")
        self._world = world_size
        self._counts: dict[str, Counter] = {k: Counter() for k in
                                            ("finished_sending", "finished_recving", "incoming")}
        self._incoming: dict[str, dict[str, Any]] = {}
        self._failed: set[str] = set()  # load errors passed on, until finished_recving

    def join(self, reports: list[tuple[int, bytes]]) -> dict[str, Any] | None:
        """Decodes the workers' reports of one or more steps (in any order, any number per
        rank) and returns what is complete, as a decode_connector_output dict, or None
        when nothing is. kvstream.InvalidArgumentError for malformed bytes."""
        import kvstream

        decoded = [kvstream.decode_connector_output(b) for _, b in reports]
        if self._world == 1:
            return self._merge_one(decoded)
        out: dict[str, Any] = {"finished_sending": set(), "finished_recving": set(),
                               "load_errors": [], "incoming": []}
        for d in decoded:
            for e in d["load_errors"]:
                if e["request_id"] not in self._failed:
                    self._failed.add(e["request_id"])
                    out["load_errors"].append(e)
            for r in d["incoming"]:
                self._incoming.setdefault(r["request_id"], r)
            for key in ("finished_sending", "finished_recving"):
                for rid in d[key]:
                    self._counts[key][rid] += 1
            for r in d["incoming"]:
                self._counts["incoming"][r["request_id"]] += 1
        for key in ("finished_sending", "finished_recving"):
            for rid in [r for r, n in self._counts[key].items() if n >= self._world]:
                del self._counts[key][rid]
                out[key].add(rid)
        for rid in [r for r, n in self._counts["incoming"].items() if n >= self._world]:
            del self._counts["incoming"][rid]
            out["incoming"].append(self._incoming.pop(rid))
        self._failed -= out["finished_recving"]
        return out if any(out.values()) else None

    @staticmethod
    def _merge_one(decoded: list[dict[str, Any]]) -> dict[str, Any] | None:
        out: dict[str, Any] = {"finished_sending": set(), "finished_recving": set(),
                               "load_errors": [], "incoming": []}
        for d in decoded:
            out["finished_sending"] |= d["finished_sending"]
            out["finished_recving"] |= d["finished_recving"]
            out["load_errors"] += d["load_errors"]
            out["incoming"] += d["incoming"]
        return out if any(out.values()) else None
