"""The parts of kvstream.vllm that need no vLLM: joining tensor-parallel workers' reports
(output_join.py), transfer ids (settings.py) and the producer's scoped ids. They run
wherever kvstream's package does, vLLM or not."""

import types

import pytest

import kvstream
from kvstream.vllm import settings
from kvstream.vllm.output_join import WorkerOutputJoiner
from kvstream.vllm.scheduler_side import transfer_key


def report(sending=(), recving=(), errors=(), incoming=()):
    return kvstream.encode_connector_output({
        "finished_sending": set(sending), "finished_recving": set(recving),
        "load_errors": [{"request_id": r, "block_ids": [1, 2], "code": "DEADLINE_EXCEEDED",
                         "message": "late"} for r in errors],
        "incoming": [{"request_id": r, "prompt_token_ids": [1, 2, 3], "num_tokens": 2}
                     for r in incoming]})


def test_one_worker_passes_reports_through():
    j = WorkerOutputJoiner(1)
    assert j.join([(0, report())]) is None
    out = j.join([(0, report(sending=["a"], incoming=["b"]))])
    assert out["finished_sending"] == {"a"} and [r["request_id"] for r in out["incoming"]] == ["b"]


def test_tensor_parallel_reports_complete_when_every_rank_reported():
    j = WorkerOutputJoiner(2)
    # Rank 0 has the hand-off and a finished send; rank 1 not yet: nothing is complete.
    assert j.join([(0, report(sending=["s"], incoming=["h"]))]) is None
    out = j.join([(1, report(sending=["s"]))])
    assert out["finished_sending"] == {"s"} and out["incoming"] == []
    out = j.join([(1, report(incoming=["h"], recving=["r"]))])
    assert [r["request_id"] for r in out["incoming"]] == ["h"]
    assert out["finished_recving"] == set()  # rank 0 has not finished receiving "r"
    assert j.join([(0, report(recving=["r"]))])["finished_recving"] == {"r"}


def test_tensor_parallel_load_error_passes_on_first_rank_once():
    j = WorkerOutputJoiner(2)
    out = j.join([(0, report(errors=["x"])), (1, report(errors=["x"]))])
    assert [e["request_id"] for e in out["load_errors"]] == ["x"]
    assert j.join([(0, report(recving=["x"])), (1, report(recving=["x"]))]) == {
        "finished_sending": set(), "finished_recving": {"x"}, "load_errors": [],
        "incoming": []}
    # A later attempt of the same id fails anew: reported again.
    assert [e["request_id"] for e in j.join([(1, report(errors=["x"]))])["load_errors"]] == ["x"]


def test_malformed_report_raises_invalid_argument():
    with pytest.raises(kvstream.InvalidArgumentError):
        WorkerOutputJoiner(1).join([(0, b"not a report")])


def request(request_id, params=None):
    return types.SimpleNamespace(request_id=request_id, kv_transfer_params=params)


def test_transfer_id_comes_from_params_else_the_request_id():
    assert settings.transfer_id(request("cmpl-1-abcd"), {"transfer_id": "x:1"}) == "x:1"
    assert settings.transfer_id(request("cmpl-1-abcd"), {}) == "cmpl-1-abcd"
    for bad in ("", "a/b", "quote'", "x" * 129, 7):
        with pytest.raises(ValueError, match="transfer id"):
            settings.transfer_id(request("r"), {"transfer_id": bad})


def test_transfer_key_drops_the_consumer_scope():
    assert transfer_key("decode-0/t-1") == "t-1"
    assert transfer_key("t-1") == "t-1"
