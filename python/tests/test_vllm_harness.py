"""Tests of the vLLM harness (vllm_harness.py) with its probe connector
(probe_connector.py): that a real VllmConfig builds here from a config.json alone, that
vLLM's connector factory loads a connector class by kv_connector_module_path for both
roles, and that vLLM's real scheduler and vLLM's model-runner connector sequence drive
it, in the order and with the arguments VLLM_NOTES.md describes. Skipped where vLLM is
not installed."""

import os
import sys

import pytest

pytest.importorskip("vllm")

# The probe connector is loaded by module name through kv_connector_module_path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import probe_connector  # noqa: E402
import vllm_harness as harness  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

PROBE = dict(connector="ProbeConnector", module_path="probe_connector")
LAYERS = harness.TINY.layer_names()
NUM_BLOCKS = 64
BLOCK = 16


@pytest.fixture(autouse=True)
def _clean():
    probe_connector.reset_calls()
    harness.uninstall_worker_connector()
    yield
    harness.uninstall_worker_connector()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return harness.write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def methods(role=None):
    return [m for r, m, _ in probe_connector.calls() if role is None or r == role]


def calls_of(method):
    return [(r, a) for r, m, a in probe_connector.calls() if m == method]


class Engine:
    """The scheduler, the worker connector and the caches of one engine."""

    def __init__(self, model_dir, kv_role, **config_kwargs):
        self.config = harness.make_vllm_config(model_dir, kv_role=kv_role, **PROBE,
                                               **config_kwargs)
        self.kv_cache_config = harness.make_kv_cache_config(self.config, NUM_BLOCKS)
        self.scheduler = harness.make_scheduler(self.config, self.kv_cache_config)
        self.worker = harness.make_worker_connector(self.config, self.kv_cache_config)
        self.kv_caches = harness.allocate_kv_caches(self.config, self.kv_cache_config)
        self.worker.register_kv_caches(self.kv_caches)

    def add(self, request_id, prompt, **kwargs):
        self.scheduler.add_request(
            harness.make_request(self.config, request_id, prompt, **kwargs))

    def step(self):
        return harness.step(self.scheduler, self.worker, self.config, self.kv_caches)

    def free_blocks(self):
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def test_vllm_config_builds_from_config_json_alone(model_dir):
    assert sorted(os.listdir(model_dir)) == ["config.json"]
    config = harness.make_vllm_config(model_dir, kv_role="kv_consumer", **PROBE)
    assert config.model_config.skip_tokenizer_init
    assert config.model_config.hf_config.num_hidden_layers == harness.TINY.num_layers
    assert config.model_config.get_num_kv_heads(config.parallel_config) == harness.TINY.num_kv_heads
    assert config.device_config.device.type == "cpu"
    kv = config.kv_transfer_config
    assert (kv.kv_connector, kv.kv_connector_module_path) == ("ProbeConnector", "probe_connector")
    assert kv.is_kv_consumer and not kv.is_kv_producer
    # The probe does not subclass SupportsHMA, so VllmConfig turned the hybrid manager off
    # (else create_connector would refuse it).
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is True


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_factory_loads_connector_from_module_path_for_each_role(model_dir, role):
    config = harness.make_vllm_config(model_dir, kv_role="kv_both", **PROBE)
    connector = harness.create_connector(config, role, None)
    assert type(connector) is probe_connector.ProbeConnector
    assert connector.role is role
    assert probe_connector.INSTANCES[role.name] == [connector]
    assert probe_connector.calls() == [
        (role.name, "__init__", {"kv_role": "kv_both", "has_kv_cache_config": False})]


def test_factory_names_missing_class(model_dir):
    config = harness.make_vllm_config(model_dir, kv_role="kv_both", **PROBE)
    config.kv_transfer_config.kv_connector = "NoSuchConnector"
    with pytest.raises(AttributeError, match="NoSuchConnector not found in probe_connector"):
        harness.create_connector(config, KVConnectorRole.WORKER, None)


def test_config_imports_the_module_path_at_construction(model_dir):
    with pytest.raises(ModuleNotFoundError, match="no_such_connector_module"):
        harness.make_vllm_config(model_dir, kv_role="kv_both", connector="ProbeConnector",
                                 module_path="no_such_connector_module")


@pytest.mark.parametrize("layout,strides", [
    # [B, H, N, C] element strides, C = head_size + head_size_v = 32 floats.
    (harness.CPU_LAYOUT, (2 * 16 * 32, 16 * 32, 32, 1)),          # LBHNC: heads outside tokens
    (harness.GPU_DEFAULT_LAYOUT, (2 * 16 * 32, 32, 2 * 32, 1)),   # LBNHC: tokens outside heads
])
def test_register_kv_caches_receives_vllm_tensors(model_dir, layout, strides):
    config = harness.make_vllm_config(model_dir, kv_role="kv_producer",
                                      kv_cache_layout=layout, **PROBE)
    kv_cache_config = harness.make_kv_cache_config(config, NUM_BLOCKS)
    worker = harness.make_worker_connector(config, kv_cache_config)
    caches = harness.allocate_kv_caches(config, kv_cache_config)
    worker.register_kv_caches(caches)
    (_, args), = calls_of("register_kv_caches")
    assert sorted(args["layers"]) == LAYERS
    t = harness.TINY
    for name in LAYERS:
        assert args["layers"][name] == {
            "shape": (NUM_BLOCKS, t.num_kv_heads, BLOCK, 2 * t.head_size),
            "stride": strides, "dtype": "torch.float32", "device": "cpu"}
    # All layers are views of one allocation, a layer's pages one after another.
    storages = {caches[n].untyped_storage().data_ptr() for n in LAYERS}
    assert len(storages) == 1
    layer_bytes = NUM_BLOCKS * t.num_kv_heads * BLOCK * 2 * t.head_size * 4
    assert caches[LAYERS[1]].data_ptr() - caches[LAYERS[0]].data_ptr() == layer_bytes
    (tensor,) = kv_cache_config.kv_cache_tensors
    assert (tensor.layer_stride, tensor.block_stride) == (layer_bytes, layer_bytes // NUM_BLOCKS)


def test_consumer_sync_load_call_order(model_dir):
    e = Engine(model_dir, "kv_consumer")
    prompt = list(range(3, 43))  # 40 tokens: 39 from remote, the last computed here
    e.add("remote", prompt, max_tokens=2, kv_transfer_params={"do_remote_prefill": True})
    e.add("local", list(range(5, 25)), max_tokens=2)
    probe_connector.reset_calls()

    out, _ = e.step()
    assert out.num_scheduled_tokens == {"remote": 1, "local": 20}
    assert out.has_sync_kv_loads
    per_layer = ["wait_for_layer_load", "save_kv_layer"] * len(LAYERS)
    assert methods() == [
        "get_num_new_matched_tokens", "update_state_after_alloc",   # remote
        "get_num_new_matched_tokens", "update_state_after_alloc",   # local
        "build_connector_meta",
        "bind_connector_metadata", "start_load_kv",  # before the forward: a sync load
        *per_layer,
        "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
        "build_connector_worker_meta", "clear_connector_metadata",
        "update_connector_output",
    ]
    matched = [a for _, a in calls_of("get_num_new_matched_tokens")]
    assert [(a["request_id"], a["num_computed_tokens"], a["result"]) for a in matched] == [
        ("remote", 0, (39, False)), ("local", 0, (0, False))]
    allocs = [a for _, a in calls_of("update_state_after_alloc")]
    assert allocs[0]["num_external_tokens"] == 39
    assert len(allocs[0]["block_ids"]) == 3  # 40 tokens in blocks of 16
    assert allocs[1]["num_external_tokens"] == 0
    (_, bound), = calls_of("bind_connector_metadata")
    assert bound["plan"]["loads"]["remote"]["block_ids"] == allocs[0]["block_ids"]
    assert bound["plan"]["loads"]["remote"]["prompt_token_ids"] == prompt
    # The worker's report (bytes in a KVConnectorWorkerMetadata) reached the scheduler.
    (_, update), = calls_of("update_connector_output")
    assert update["worker_reports"] == [{"layers_waited": LAYERS, "layers_saved": LAYERS}]

    probe_connector.reset_calls()
    out, engine_outputs = e.step()  # decode: nothing to load, start_load_kv after the forward
    assert out.num_scheduled_tokens == {"remote": 1, "local": 1}
    assert methods("WORKER") == ["bind_connector_metadata", *per_layer, "start_load_kv",
                                 "wait_for_save", "get_finished",
                                 "get_block_ids_with_load_errors",
                                 "build_connector_worker_meta", "clear_connector_metadata"]
    finished = [a for _, a in calls_of("request_finished")]
    assert [(a["request_id"], a["result"]) for a in finished] == [
        ("remote", False), ("local", False)]
    assert all(o.finish_reason is not None for o in engine_outputs[0].outputs)

    probe_connector.reset_calls()
    out, _ = e.step()  # no forward: the worker still gets metadata naming the finished
    assert out.total_num_scheduled_tokens == 0
    (_, meta), = calls_of("build_connector_meta")
    assert meta["finished_req_ids"] == ["local", "remote"]
    (_, got), = calls_of("get_finished")
    assert got["finished_req_ids"] == ["local", "remote"]
    assert "wait_for_layer_load" not in methods()
    assert e.scheduler.requests == {}
    assert e.free_blocks() == NUM_BLOCKS - 1  # block 0 is vLLM's null block


def test_consumer_async_load_waits_for_finished_recving(model_dir):
    e = Engine(model_dir, "kv_consumer", extra_config={"probe_load_async": True})
    e.add("remote", list(range(3, 43)), max_tokens=2,
          kv_transfer_params={"do_remote_prefill": True})
    out, _ = e.step()
    # Blocks allocated, nothing computed: the request waits for its KV.
    assert out.total_num_scheduled_tokens == 0
    assert e.scheduler.requests["remote"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (_, got), = calls_of("get_finished")
    assert got["result"] == ([], ["remote"])

    probe_connector.reset_calls()
    out, _ = e.step()
    # Reported received: scheduled with every prompt token but the last computed, after a
    # second update_state_after_alloc with no external tokens.
    assert out.num_scheduled_tokens == {"remote": 1}
    assert methods("SCHEDULER")[:2] == ["update_state_after_alloc", "build_connector_meta"]
    (_, again), = calls_of("update_state_after_alloc")
    assert again["num_external_tokens"] == 0
    assert e.scheduler.requests["remote"].num_computed_tokens == 40


def test_producer_holds_blocks_until_finished_sending(model_dir):
    e = Engine(model_dir, "kv_producer")
    free = e.free_blocks()
    e.add("p", list(range(3, 43)), max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    out, engine_outputs = e.step()
    assert out.num_scheduled_tokens == {"p": 40}
    (_, saved), = calls_of("wait_for_save")
    assert saved["saves"] == ["p"]
    (_, fin), = calls_of("request_finished")
    assert fin["result"] is True
    (o,) = engine_outputs[0].outputs
    assert o.kv_transfer_params == {"probe_block_ids": fin["block_ids"]}
    # request_finished returned True: vLLM keeps the request and its blocks.
    assert "p" in e.scheduler.requests
    assert e.free_blocks() == free - 3

    probe_connector.reset_calls()
    e.step()
    (_, got), = calls_of("get_finished")
    assert got == {"finished_req_ids": ["p"], "result": (["p"], [])}
    assert "p" not in e.scheduler.requests
    assert e.free_blocks() == free


def test_finished_sending_for_unknown_request_is_fatal(model_dir):
    # What vLLM does with a finished_sending id it does not hold (scheduler.py
    # _update_from_kv_xfer_finished): an assertion in the engine core, so a connector
    # must report only ids that request_finished delayed.
    e = Engine(model_dir, "kv_producer")
    out = e.scheduler.schedule()
    mro = harness.model_runner_output(
        e.scheduler, out, KVConnectorOutput(finished_sending={"never-seen"}))
    with pytest.raises(AssertionError):
        e.scheduler.update_from_output(out, mro)
