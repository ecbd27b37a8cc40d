"""Every Status error surfaces as the exception class that names its code."""

import numpy as np
import pytest

import kvstream

CLASSES = {
    "CANCELLED": "CancelledError", "UNKNOWN": "UnknownError",
    "INVALID_ARGUMENT": "InvalidArgumentError", "DEADLINE_EXCEEDED": "DeadlineExceededError",
    "NOT_FOUND": "NotFoundError", "ALREADY_EXISTS": "AlreadyExistsError",
    "PERMISSION_DENIED": "PermissionDeniedError", "RESOURCE_EXHAUSTED": "ResourceExhaustedError",
    "FAILED_PRECONDITION": "FailedPreconditionError", "ABORTED": "AbortedError",
    "OUT_OF_RANGE": "OutOfRangeError", "UNIMPLEMENTED": "UnimplementedError",
    "INTERNAL": "InternalError", "UNAVAILABLE": "UnavailableError",
    "DATA_LOSS": "DataLossError", "UNAUTHENTICATED": "UnauthenticatedError",
}


def config(**extra):
    c = {"kv_connector": "LayerwiseConnector", "kv_role": "kv_consumer", "engine_id": "d",
         "kv_connector_extra_config": {"transport": "loopback"}}
    c.update(extra)
    return c


def cache(num_blocks=8):
    s = kvstream.KvCacheSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
    return kvstream.KvCache.borrow(s, np.zeros((num_blocks, 4, 2, 8), np.float32),
                                   np.zeros((num_blocks, 4, 2, 8), np.float32))


def test_one_class_per_code():
    for value, (code, name) in enumerate(CLASSES.items(), start=1):
        cls = getattr(kvstream, name)
        assert issubclass(cls, kvstream.KvstreamError)
        assert cls.code == code and cls.code_value == value
        assert cls.__module__ == "kvstream" and cls.__name__ == name
    assert issubclass(kvstream.InvalidArgumentError, ValueError)
    assert issubclass(kvstream.DeadlineExceededError, TimeoutError)
    assert issubclass(kvstream.NotFoundError, LookupError)


def test_bad_config_key():
    with pytest.raises(kvstream.InvalidArgumentError, match="unknown key bogus") as e:
        kvstream.ConnectorScheduler(config(bogus=1), 16)
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(kvstream.InvalidArgumentError, match="load_timeout_ms"):
        kvstream.ConnectorWorker(config(kv_connector_extra_config={"load_timeout_ms": "soon"}))
    with pytest.raises(kvstream.InvalidArgumentError, match="kv_role"):
        kvstream.ConnectorScheduler(config(kv_role="kv_decoder"), 16)
    with pytest.raises(kvstream.InvalidArgumentError, match="malformed JSON"):
        kvstream.ConnectorScheduler("{not json", 16)
    with pytest.raises(kvstream.NotFoundError, match="NoSuchConnector"):
        kvstream.ConnectorScheduler(config(kv_connector="NoSuchConnector"), 16)


def test_malformed_metadata_bytes():
    scheduler = kvstream.ConnectorScheduler(config(), 4)
    worker = kvstream.ConnectorWorker(config())
    good = scheduler.build_connector_meta([])
    worker.bind_connector_metadata(good)
    for bad in (b"", b"junk", good[:-1], good + b"\0", b"XXXX" + good[4:]):
        with pytest.raises(kvstream.InvalidArgumentError):
            worker.bind_connector_metadata(bad)
        with pytest.raises(kvstream.InvalidArgumentError):
            kvstream.decode_connector_metadata(bad)
    with pytest.raises(kvstream.InvalidArgumentError):
        scheduler.update_connector_output(b"KVMO")
    out = worker.take_output()
    scheduler.update_connector_output(out)
    assert kvstream.decode_connector_output(out) == {
        "finished_sending": set(), "finished_recving": set(), "load_errors": [], "incoming": []}
    with pytest.raises(kvstream.InvalidArgumentError):
        scheduler.update_connector_output(out[:-1])
    worker.close()


def test_bad_block_ids():
    scheduler = kvstream.ConnectorScheduler(config(), 4)
    request = kvstream.Request("r", list(range(9)), remote_prefill=("127.0.0.1", 1))
    n, _ = scheduler.get_num_new_matched_tokens(request, 0)
    assert n == 8
    with pytest.raises(kvstream.InvalidArgumentError):
        scheduler.update_state_after_alloc(request, [0], n)  # 8 tokens need 2 blocks
    with pytest.raises(kvstream.InvalidArgumentError):
        scheduler.update_state_after_alloc(request, [0, -3], n)
    md = kvstream.build_attention_metadata([(0, 5, [1, 99])], block_size=4)
    with pytest.raises(kvstream.KvstreamError, match="99"):
        md.validate(block_size=4, num_blocks=8)
    with pytest.raises(kvstream.OutOfRangeError):
        kvstream.build_attention_metadata([(0, 9, [1])], block_size=4)


def test_bad_layer_names():
    worker = kvstream.ConnectorWorker(config())
    with pytest.raises(kvstream.InvalidArgumentError, match="no-index-here"):
        worker.register_kv_caches({"no-index-here": cache()})
    with pytest.raises(kvstream.InvalidArgumentError, match="index 3"):
        worker.register_kv_caches({"model.layers.3.attn": cache(),
                                   "decoder.3.self_attn": cache()})
    worker.register_kv_caches({"model.layers.0.self_attn.attn": cache()})
    registry = kvstream.LayerRegistry()
    with pytest.raises(kvstream.NotFoundError, match="model.layers.7"):
        registry.bind_kv_cache("model.layers.7.self_attn.attn", cache())
    worker.close()
    with pytest.raises(kvstream.FailedPreconditionError, match="closed"):
        worker.start_load_kv()


def test_bad_arrays():
    s = kvstream.KvCacheSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
    ok = np.zeros((8, 4, 2, 8), np.float32)
    with pytest.raises(kvstream.InvalidArgumentError):
        kvstream.KvCache.borrow(s, np.zeros((8, 4, 3, 8), np.float32), ok)  # 3 heads
    with pytest.raises(kvstream.InvalidArgumentError, match="dtype"):
        kvstream.KvCache.borrow(s, ok.astype(np.float64), ok)
    with pytest.raises(kvstream.InvalidArgumentError, match="expected a writable DLPack array"):
        kvstream.KvCache.borrow(s, [1, 2, 3], ok)
    with pytest.raises(kvstream.InvalidArgumentError):
        kvstream.KvCacheSpec(num_kv_heads=0, head_size=8)
    with pytest.raises(kvstream.InvalidArgumentError):
        kvstream.KvCacheSpec(num_kv_heads=2, head_size=8, dtype="float64")
