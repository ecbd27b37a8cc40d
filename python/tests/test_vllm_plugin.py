"""kvstream.vllm against vLLM's real classes in one process: vLLM's config and connector
factory loading KvstreamConnector for both roles, its tensors registered, and vLLM's real
scheduler driving the plugin on each side of a transfer whose other side is kvstream's
own connector (the plugin's WorkerSide over a second set of vLLM-shaped tensors), or
nobody. The two-engine runs are in test_vllm_pair.py. Skipped where vLLM is not
installed."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import kvstream  # noqa: E402
import vllm_engine as ve  # noqa: E402
import vllm_harness as harness  # noqa: E402
from kvstream.vllm import KvstreamConnector, KvstreamConnectorMetadata  # noqa: E402
from kvstream.vllm import settings  # noqa: E402
from kvstream.vllm.worker_side import WorkerSide  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

PROMPT = [(i * 53 + 5) % 250 + 3 for i in range(40)]
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return harness.write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(autouse=True)
def _clean():
    yield
    harness.uninstall_worker_connector()


def config(model_dir, kv_role, **extra):
    return harness.make_vllm_config(
        model_dir, kv_role=kv_role, **ve.CONNECTOR,
        extra_config={"transport": "ucx", "ucx_tls": "shm", "attention_backend": "CPU_ATTN",
                      **extra})


def test_import_loads_neither_native_module_nor_vllm_before_use():
    code = ("import sys, kvstream.vllm.settings, kvstream.vllm.output_join\n"
            "assert 'kvstream._kvstream' not in sys.modules\n"
            "assert 'vllm' not in sys.modules\n"
            "from kvstream.vllm import KvstreamConnector\n"
            "assert 'kvstream._kvstream' not in sys.modules\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_factory_creates_the_plugin_for_each_role(model_dir, role):
    c = config(model_dir, "kv_both")
    assert c.scheduler_config.disable_hybrid_kv_cache_manager is True
    connector = harness.create_connector(c, role, None)
    assert type(connector) is KvstreamConnector
    assert (connector.scheduler_side is None) == (role is KVConnectorRole.WORKER)
    assert (connector.worker_side is None) == (role is KVConnectorRole.SCHEDULER)
    assert KvstreamConnector.requires_piecewise_for_cudagraph({}) is True
    connector.shutdown()


def test_kvstream_config_from_vllm_config(model_dir):
    c = config(model_dir, "kv_producer", kv_ip="10.0.0.5", handoff_wait_ms=5,
               load_timeout_ms=1234)
    kv = c.kv_transfer_config
    kv.kv_port, kv.engine_id, kv.kv_buffer_device = 15000, "prefill-a", ""
    rank0 = settings.kvstream_config(kv)
    assert rank0 == {
        "kv_connector": "LayerwiseConnector", "kv_role": "kv_producer",
        "engine_id": "prefill-a", "kv_buffer_device": "cpu", "kv_ip": "10.0.0.5",
        "kv_port": 15000, "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"transport": "ucx", "ucx_tls": "shm",
                                      "load_timeout_ms": 1234}}
    rank3 = settings.kvstream_config(kv, tp_rank=3, tp_size=4)
    assert (rank3["kv_port"], rank3["engine_id"]) == (15003, "prefill-a-tp3")
    assert settings.plugin_settings(kv).handoff_wait_ms == 5
    kv.kv_connector_extra_config["handoff_keep_ms"] = "soon"
    with pytest.raises(ValueError, match="handoff_keep_ms"):
        settings.plugin_settings(kv)


def test_unknown_kvstream_setting_is_refused_naming_it(model_dir):
    c = config(model_dir, "kv_consumer", no_such_setting=1)
    with pytest.raises(kvstream.InvalidArgumentError, match="no_such_setting"):
        harness.create_connector(c, KVConnectorRole.SCHEDULER, None)


@pytest.mark.parametrize("fmt", sorted(ve.FORMATS))
def test_registered_caches_are_vllm_memory(model_dir, fmt):
    e = ve.Engine(model_dir, "kv_producer", fmt=fmt)
    caches = e.worker.worker_side._caches
    assert sorted(caches) == ve.LAYERS
    for layer, name in enumerate(ve.LAYERS):
        k, v = e.views[name]  # split as vLLM's attention backend splits the tensor
        k.copy_(torch.arange(k.numel(), dtype=torch.float32).reshape(k.shape) + layer)
        v.copy_(-torch.arange(v.numel(), dtype=torch.float32).reshape(v.shape) - layer)
        cache = caches[name]
        assert cache.num_blocks == ve.NUM_BLOCKS and not cache.owned
        assert cache.spec.block_size == ve.BLOCK and cache.spec.head_size == ve.D
        # kvstream's K and V are views of the same bytes, not copies.
        assert cache.k.data_ptr() == k.data_ptr() and cache.v.data_ptr() == v.data_ptr()
        assert torch.equal(cache.k.view(torch.float32), k)
        assert torch.equal(cache.v.view(torch.float32), v)
    e.worker.shutdown()


class Consumer:
    """A decode side that is kvstream's own connector (no vLLM scheduler): the plugin's
    WorkerSide over vLLM-shaped tensors, and kvstream's ConnectorScheduler."""

    def __init__(self, model_dir, engine_id="decode-raw"):
        c = config(model_dir, "kv_consumer", load_timeout_ms=5000)
        c.kv_transfer_config.engine_id = engine_id
        self.side = WorkerSide(c, rank=(0, 1))
        kv_cache_config = harness.make_kv_cache_config(c, ve.NUM_BLOCKS)
        self.tensors = harness.allocate_kv_caches(c, kv_cache_config)
        self.side.register_kv_caches(self.tensors)
        self.worker = self.side.worker
        self.scheduler = kvstream.ConnectorScheduler(settings.kvstream_config(
            c.kv_transfer_config), ve.BLOCK)
        self.blocks = [5, 9, 2]

    def hand_off(self, tid, prompt, producer):
        host, port = producer.worker.worker_side.control_address.rsplit(":", 1)
        r = kvstream.Request(tid, prompt, (host, int(port)))
        n, _ = self.scheduler.get_num_new_matched_tokens(r, 0)
        self.scheduler.update_state_after_alloc(r, self.blocks, n)
        self.worker.bind_connector_metadata(
            self.scheduler.build_connector_meta([(tid, 0, len(prompt))]))
        self.worker.start_load_kv()

    def receive(self, tid):
        """Waits for every layer (bounded by the load timeout); returns (the output,
        every layer's received K and V)."""
        for name in ve.LAYERS:
            self.worker.wait_for_layer_load(name)
        self.worker.clear_connector_metadata()
        out = kvstream.decode_connector_output(self.worker.take_output())
        got = [tuple(ve.read_tokens(x, self.blocks, len(PROMPT) - 1)
                     for x in ve.kv_views(self.tensors[n], "CPU_ATTN")) for n in ve.LAYERS]
        return out, got

    def close(self):
        self.worker.close()


def expect_prompt_kv(got):
    n = len(PROMPT) - 1
    for layer, (k, v) in enumerate(got):
        assert torch.equal(k, ve.expected_tokens(layer, PROMPT, n, False)), layer
        assert torch.equal(v, ve.expected_tokens(layer, PROMPT, n, True)), layer


# max_tokens 3: the request runs on after its KV was sent, and vLLM must not hear that
# the sends are done (it would free the blocks of a running request) before it finished.
@pytest.mark.parametrize("max_tokens", [1, 3])
def test_producer_waits_for_its_handoff_then_streams(model_dir, max_tokens):
    p = ve.Engine(model_dir, "kv_producer", extra={"handoff_wait_ms": TIMEOUT_S * 1000})
    free = p.free_blocks()
    p.add("vllm-id-P", PROMPT, max_tokens=max_tokens,
          kv_transfer_params={"do_remote_decode": True, "transfer_id": "t-1"})
    for _ in range(3):  # no hand-off yet: the request is not scheduled
        assert p.step().total_num_scheduled_tokens == 0
    assert p.scheduler.requests["vllm-id-P"].status == RequestStatus.WAITING
    d = Consumer(model_dir)
    d.hand_off("t-1", PROMPT, p)
    p.run_until(lambda: not p.busy(), TIMEOUT_S)
    out, got = d.receive("t-1")
    expect_prompt_kv(got)
    assert out["finished_recving"] == {"t-1"} and out["load_errors"] == []
    assert p.finished["vllm-id-P"].finish_reason == FinishReason.LENGTH
    assert p.free_blocks() == free  # vLLM freed the blocks once the sends had ended
    d.close()
    p.worker.shutdown()


def test_handoff_before_the_request_is_bound_at_admission(model_dir):
    p = ve.Engine(model_dir, "kv_producer", extra={"handoff_wait_ms": TIMEOUT_S * 1000})
    d = Consumer(model_dir)
    d.hand_off("t-early", PROMPT, p)
    # The engine learns of the hand-off in its first step (the worker's report).
    p.add("vllm-id-P", PROMPT, max_tokens=1,
          kv_transfer_params={"do_remote_decode": True, "transfer_id": "t-early"})
    p.run_until(lambda: not p.busy(), TIMEOUT_S)
    out, got = d.receive("t-early")
    expect_prompt_kv(got)
    assert out["finished_recving"] == {"t-early"}
    d.close()
    p.worker.shutdown()


def test_handoff_with_another_prompt_is_refused(model_dir):
    p = ve.Engine(model_dir, "kv_producer", extra={"handoff_wait_ms": TIMEOUT_S * 1000})
    free = p.free_blocks()
    d = Consumer(model_dir)
    other = list(reversed(PROMPT))
    d.hand_off("t-2", other, p)
    p.add("vllm-id-P", PROMPT, max_tokens=1,
          kv_transfer_params={"do_remote_decode": True, "transfer_id": "t-2"})
    p.run_until(lambda: not p.busy(), TIMEOUT_S)
    # The consumer hears that nothing comes (a load error to recompute), before its
    # deadline; the producer computed the request for itself and freed it.
    out, _ = d.receive("t-2")
    assert [e["request_id"] for e in out["load_errors"]] == ["t-2"]
    assert out["load_errors"][0]["code"] != "DEADLINE_EXCEEDED"
    assert p.finished["vllm-id-P"].finish_reason == FinishReason.LENGTH
    assert p.free_blocks() == free
    d.close()
    p.worker.shutdown()


def test_kept_blocks_are_freed_when_no_handoff_comes(model_dir):
    p = ve.Engine(model_dir, "kv_producer",
                  extra={"handoff_wait_ms": 0, "handoff_keep_ms": 1000})
    now = [0.0]
    p.connector.scheduler_side.clock = lambda: now[0]
    free = p.free_blocks()
    p.add("vllm-id-P", PROMPT, max_tokens=1,
          kv_transfer_params={"do_remote_decode": True, "transfer_id": "t-3"})
    for _ in range(4):
        p.step()
    # Prefilled and finished without a hand-off: its blocks are kept for one.
    assert p.finished["vllm-id-P"].finish_reason == FinishReason.LENGTH
    assert p.free_blocks() == free - 3 and p.connector.has_pending_push_work()
    now[0] = 2.0  # past handoff_keep_ms
    p.run_until(lambda: not p.busy(), TIMEOUT_S)
    assert p.free_blocks() == free
    # A hand-off coming now is refused: the consumer is told, it does not wait it out.
    d = Consumer(model_dir)
    d.hand_off("t-3", PROMPT, p)
    p.add("other", [7, 8, 9], max_tokens=2)  # something for the engine to step on
    p.run_until(lambda: not p.busy(), TIMEOUT_S)
    out, _ = d.receive("t-3")
    assert [e["request_id"] for e in out["load_errors"]] == ["t-3"]
    d.close()
    p.worker.shutdown()


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_unreachable_producer_is_a_load_error_vllm_handles(model_dir, policy):
    d = ve.Engine(model_dir, "kv_consumer", kv_load_failure_policy=policy)
    d.add("vllm-id-D", PROMPT, max_tokens=2, kv_transfer_params={
        "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": free_port(),
        "transfer_id": "t-4"})
    first = d.step()
    assert first.num_scheduled_tokens == {"vllm-id-D": 1}  # 39 tokens were to come
    d.run_until(lambda: not d.busy(), TIMEOUT_S)
    assert d.worker.worker_side.worker.stats()["load_errors"] == 1
    out = d.finished["vllm-id-D"]
    if policy == "fail":
        assert out.finish_reason == FinishReason.ERROR
    else:
        assert out.finish_reason == FinishReason.LENGTH and len(out.new_token_ids) >= 1
    assert d.free_blocks() == ve.NUM_BLOCKS - 1
    d.worker.shutdown()


def test_local_prefix_hit_computes_the_request_here(model_dir):
    d = ve.Engine(model_dir, "kv_consumer")
    d.add("local", PROMPT, max_tokens=1)
    d.run_until(lambda: not d.busy(), TIMEOUT_S)
    d.add("remote", PROMPT, max_tokens=1, kv_transfer_params={
        "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": free_port(),
        "transfer_id": "t-5"})
    out = d.step()
    # 32 of the prompt's tokens are cached here: kvstream would have to overwrite them.
    assert out.num_scheduled_tokens == {"remote": len(PROMPT) - 32}
    assert isinstance(out.kv_connector_metadata, KvstreamConnectorMetadata)
    assert kvstream.decode_connector_metadata(out.kv_connector_metadata.kvstream)["loads"] == []
    d.run_until(lambda: not d.busy(), TIMEOUT_S)
    assert d.worker.worker_side.worker.stats()["load_errors"] == 0
    d.worker.shutdown()


def test_tensor_parallel_rank_hands_off_to_the_producers_rank(model_dir):
    # Rank r of a producer listens r ports above kv_port; rank r of a consumer, told rank
    # 0's address (one step metadata for every rank), hands its shard to rank r.
    base = free_port()
    pc = config(model_dir, "kv_producer")
    pc.kv_transfer_config.kv_port = base
    producer = WorkerSide(pc, rank=(1, 2))
    kv_cache_config = harness.make_kv_cache_config(pc, ve.NUM_BLOCKS)
    producer.register_kv_caches(harness.allocate_kv_caches(pc, kv_cache_config))
    assert producer.control_address.endswith(f":{base + 1}")
    cc = config(model_dir, "kv_consumer")
    consumer = WorkerSide(cc, rank=(1, 2))
    consumer.register_kv_caches(harness.allocate_kv_caches(cc, kv_cache_config))
    sched = kvstream.ConnectorScheduler(settings.kvstream_config(cc.kv_transfer_config),
                                        ve.BLOCK)
    r = kvstream.Request("t-tp", PROMPT, ("127.0.0.1", base))
    n, _ = sched.get_num_new_matched_tokens(r, 0)
    sched.update_state_after_alloc(r, [4, 5, 6], n)
    consumer.bind_connector_metadata(KvstreamConnectorMetadata(
        kvstream=sched.build_connector_meta([("t-tp", 0, len(PROMPT))])))
    consumer.start_load_kv()

    def handed_over():
        out = kvstream.decode_connector_output(producer.worker.take_output())
        return [h["request_id"] for h in out["incoming"]]

    from kvtest_util import poll

    (handed,) = poll(handed_over, TIMEOUT_S, "the hand-off at the producer's rank 1")
    assert handed.endswith("/t-tp") and "-tp1" in handed  # scoped by the consumer's rank
    consumer.shutdown()
    producer.shutdown()
