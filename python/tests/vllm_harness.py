"""A harness for testing a vLLM KV connector against vLLM's real classes, on a machine
without a GPU and without downloading anything: a real VllmConfig built from a local model
folder holding only a small config.json, the KVCacheConfig and per-layer KV cache tensors
that vLLM's engine core and model runner would build for that model, vLLM's connector
factory for both roles, vLLM's real Scheduler driven with real Request objects, and one
worker step that calls the worker connector in the order vLLM's model runner does.

Written against vLLM 0.33.0 (python/kvstream/vllm/VLLM_NOTES.md has the file:line references
behind each step). Import it only after pytest.importorskip("vllm").

    model_dir = write_tiny_model(tmp_path)
    config = make_vllm_config(model_dir, connector="ProbeConnector",
                              module_path="probe_connector", kv_role="kv_consumer")
    kv_cache_config = make_kv_cache_config(config, num_blocks=64)
    scheduler = make_scheduler(config, kv_cache_config)          # SCHEDULER connector
    worker = make_worker_connector(config, kv_cache_config)      # WORKER connector
    worker.register_kv_caches(allocate_kv_caches(config, kv_cache_config))
    scheduler.add_request(make_request("r1", list(range(40)), max_tokens=2,
                                       kv_transfer_params={"do_remote_prefill": True}))
    out = scheduler.schedule()
    kv_out = run_worker_step(worker, config, cross_process(out), kv_caches)
    scheduler.update_from_output(out, model_runner_output(scheduler, out, kv_out))
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.forward_context import set_forward_context
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vllm.v1.worker.utils import allocate_kv_cache


@dataclass(frozen=True)
class TinyModel:
    """The shapes of the harness's model (a Llama; its weights are never loaded)."""

    num_layers: int = 2
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    vocab_size: int = 256
    max_position_embeddings: int = 1024
    dtype: str = "float32"

    def layer_names(self) -> list[str]:
        # vLLM's Llama names its attention layers so (Attention(prefix=...)); these are
        # the keys of register_kv_caches and the layer_name of the per-layer calls.
        return [f"model.layers.{i}.self_attn.attn" for i in range(self.num_layers)]


TINY = TinyModel()

# The layouts vLLM 0.33 resolves by default (v1/attention/backends/utils.py:229 and
# cpu_attn.py:82): the CPU attention backend takes only LBHNC; backends that state no
# preference (FlashAttention on Hopper) get LBNHC.
CPU_LAYOUT = "LBHNC"
GPU_DEFAULT_LAYOUT = "LBNHC"

EOS_TOKEN_ID = 2


def write_tiny_model(folder: str | os.PathLike, model: TinyModel = TINY) -> str:
    """Writes config.json of a tiny Llama into `folder` (created if missing) and returns
    the folder, for ModelConfig(model=folder). Nothing else is needed there as long as
    the tokenizer is skipped and no weights are loaded."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model.num_attention_heads * model.head_size,
        "intermediate_size": 4 * model.num_attention_heads * model.head_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_size,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "torch_dtype": model.dtype,
        "bos_token_id": 1,
        "eos_token_id": EOS_TOKEN_ID,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return str(path)


def make_vllm_config(
    model_dir: str,
    *,
    connector: str,
    module_path: str | None,
    kv_role: str,
    extra_config: dict[str, Any] | None = None,
    engine_id: str | None = None,
    block_size: int = 16,
    max_model_len: int = 512,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 8,
    kv_cache_layout: str = CPU_LAYOUT,
    kv_load_failure_policy: str = "recompute",
    async_scheduling: bool = False,
) -> VllmConfig:
    """A real VllmConfig for the model in `model_dir`, on the CPU, with a
    KVTransferConfig naming class `connector` in module `module_path` (importable from
    sys.path). Note that VllmConfig's own __post_init__ already imports the connector's
    module (to ask whether it supports the hybrid KV cache manager; a connector that does
    not subclass SupportsHMA gets it turned off).

    kv_cache_layout is set by hand: in a real engine the engine core resolves it from the
    workers' attention backends before any connector is created."""
    model_config = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=True,
        dtype=TINY.dtype,
        max_model_len=max_model_len,
        seed=0,
    )
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cache_config.kv_cache_layout = kv_cache_layout
    kv_transfer_config = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=module_path,
        kv_role=kv_role,
        engine_id=engine_id,
        kv_connector_extra_config=extra_config or {},
        kv_load_failure_policy=kv_load_failure_policy,
    )
    return VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=kv_transfer_config,
    )


def kv_cache_specs(config: VllmConfig, model: TinyModel = TINY) -> dict[str, FullAttentionSpec]:
    """What each attention layer of the model reports (Attention.get_kv_cache_spec)."""
    dtype = getattr(torch, model.dtype)
    spec = FullAttentionSpec(
        block_size=config.cache_config.block_size,
        num_kv_heads=model.num_kv_heads,
        head_size=model.head_size,
        dtype=dtype,
    )
    return {name: spec for name in model.layer_names()}


def make_kv_cache_config(config: VllmConfig, num_blocks: int, model: TinyModel = TINY
                         ) -> KVCacheConfig:
    """The KVCacheConfig vLLM's engine core builds for one worker with room for
    `num_blocks` blocks (v1/engine/core.py _initialize_kv_caches), with the same calls;
    usable for both the scheduler and the worker (one worker, so they are the same).
    Sets config.cache_config.num_gpu_blocks as the engine core does."""
    specs = [kv_cache_specs(config, model)]
    page_bytes = next(iter(specs[0].values())).page_size_bytes
    available = num_blocks * page_bytes * model.num_layers
    groups = get_global_kv_cache_groups(config, specs)
    configs = get_kv_cache_configs(config, specs, [available], groups)
    for c in configs:
        c.kv_cache_layout = config.cache_config.kv_cache_layout
    scheduler_config = generate_scheduler_kv_cache_config(configs)
    config.cache_config.num_gpu_blocks = scheduler_config.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler_config, config)
    for c in (*configs, scheduler_config):
        c.hash_block_size = hash_block_size
    assert len(configs) == 1
    worker_config = configs[0]
    # One worker: the scheduler's config and the worker's describe the same blocks.
    assert worker_config.num_blocks == scheduler_config.num_blocks == num_blocks, (
        worker_config.num_blocks, num_blocks)
    return worker_config


def allocate_kv_caches(config: VllmConfig, kv_cache_config: KVCacheConfig
                       ) -> dict[str, torch.Tensor]:
    """The per-layer KV cache tensors that vLLM's model runner allocates on the CPU and
    passes to register_kv_caches (gpu_model_runner.py initialize_kv_cache_tensors ->
    v1/worker/utils.py allocate_kv_cache), with the resolved layout. Each is a view of
    one int8 allocation shared by all layers, of logical shape
    [num_blocks, num_kv_heads, block_size, head_size + head_size_v]."""
    layout = config.cache_config.get_resolved_kv_cache_layout()
    return allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, None)


def create_connector(config: VllmConfig, role: KVConnectorRole,
                     kv_cache_config: KVCacheConfig | None) -> KVConnectorBase_V1:
    """vLLM's own factory call (factory.py KVConnectorFactory.create_connector)."""
    connector = KVConnectorFactory.create_connector(config, role, kv_cache_config)
    assert isinstance(connector, KVConnectorBase_V1)
    return connector


def make_scheduler(config: VllmConfig, kv_cache_config: KVCacheConfig):
    """vLLM's real scheduler, built as the engine core builds it (v1/engine/core.py);
    it creates its SCHEDULER-role connector itself (scheduler.py:179). The connector is
    scheduler.connector (scheduler.get_kv_connector())."""
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, config)
    scheduler_cls = config.scheduler_config.get_scheduler_cls()
    return scheduler_cls(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        hash_block_size=hash_block_size,
        include_finished_set=False,
        log_stats=True,
    )


def make_worker_connector(config: VllmConfig, kv_cache_config: KVCacheConfig
                          ) -> KVConnectorBase_V1:
    """The WORKER-role connector, created as ensure_kv_transfer_initialized does
    (kv_transfer_state.py), and installed as the process's KV transfer group so that
    vLLM's model-runner code (KVConnectorModelRunnerMixin) finds it. The real function
    first broadcasts engine_id over the TP group, which needs torch.distributed; with one
    worker that is a no-op, so it is skipped here. Undo with uninstall_worker_connector()."""
    connector = create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
    kv_transfer_state._KV_CONNECTOR_AGENT = connector
    return connector


def uninstall_worker_connector() -> None:
    kv_transfer_state._KV_CONNECTOR_AGENT = None


_none_hash_ready = False


def make_request(config: VllmConfig, request_id: str, prompt_token_ids: list[int], *,
                 max_tokens: int = 4, kv_transfer_params: dict[str, Any] | None = None
                 ) -> Request:
    """A real vLLM Request as the engine core makes it from an EngineCoreRequest
    (Request.from_engine_core_request): kv_transfer_params travel in
    SamplingParams.extra_args["kv_transfer_params"] (request.py:119), and a block hasher
    is attached because a KV connector is configured (core.py: request_block_hasher)."""
    global _none_hash_ready
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    if not _none_hash_ready:
        init_none_hash(hash_fn)
        _none_hash_ready = True
    extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    sampling_params = SamplingParams(max_tokens=max_tokens, extra_args=extra_args)
    sampling_params.update_from_generation_config({}, EOS_TOKEN_ID)
    hash_block_size = config.cache_config.block_size
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=sampling_params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(hash_block_size, hash_fn),
    )


def cross_process(obj: Any) -> Any:
    """What vLLM's multiprocess executor does to a SchedulerOutput (and the worker's
    ModelRunnerOutput on the way back): pickle (shm_broadcast.MessageQueue.enqueue/
    dequeue). With one worker in the engine core's process (UniProcExecutor) nothing is
    pickled and both sides see the same objects; a connector must work either way."""
    return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class _HarnessAttnMetadata:
    """Stands for the backend's AttentionMetadata: vLLM skips the per-layer connector
    calls when a layer has none (a profiling or dummy run), kv_transfer_utils.py:47."""


def run_worker_step(worker: KVConnectorBase_V1, config: VllmConfig,
                    scheduler_output: SchedulerOutput,
                    kv_caches: dict[str, torch.Tensor]) -> KVConnectorOutput:
    """One worker step: the worker connector's calls in the order vLLM's GPU/CPU model
    runner makes them, through vLLM's own KVConnectorModelRunnerMixin context manager
    (kv_connector_model_runner_mixin.py:67-107: bind_connector_metadata; start_load_kv
    before the forward if the step has synchronous loads, else after; wait_for_save;
    get_transfer_results -> get_finished; get_block_ids_with_load_errors; stats; events;
    build_connector_worker_meta; clear_connector_metadata). In between, for a step that
    computes tokens, each attention layer's wait_for_layer_load / save_kv_layer with that
    layer's KV cache tensor, as maybe_transfer_kv_layer does (kv_transfer_utils.py:51-57).
    No model runs: the caches are not written."""
    assert kv_transfer_state._KV_CONNECTOR_AGENT is worker, "make_worker_connector first"
    with set_forward_context(None, config):
        if scheduler_output.total_num_scheduled_tokens == 0:
            # execute_model's no-forward path (gpu_model_runner.py kv_connector_no_forward)
            out = KVConnectorModelRunnerMixin.kv_connector_no_forward(scheduler_output, config)
            return out.kv_connector_output
        with KVConnectorModelRunnerMixin._get_kv_connector_output(scheduler_output) as out:
            metadata = _HarnessAttnMetadata()
            for name in TINY.layer_names():
                worker.wait_for_layer_load(name)
                worker.save_kv_layer(name, kv_caches[name], metadata)
    return out


def model_runner_output(scheduler, scheduler_output: SchedulerOutput,
                        kv_connector_output: KVConnectorOutput | None,
                        token_id: int = 7) -> ModelRunnerOutput:
    """A ModelRunnerOutput for the step: one sampled token for each scheduled request
    whose prompt is complete after this step (none for a partial prefill), as the model
    runner returns them, and the connector's output. Reads the requests' progress from
    the scheduler (schedule() has already advanced num_computed_tokens)."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_prompt_tokens
        sampled.append([token_id] if done else [])
    if kv_connector_output is not None and kv_connector_output.is_empty():
        kv_connector_output = None
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv_connector_output,
    )


def step(scheduler, worker: KVConnectorBase_V1, config: VllmConfig,
         kv_caches: dict[str, torch.Tensor], *, pickle_between: bool = True):
    """One engine step as EngineCore.step does it: schedule, execute (the worker step
    above, with the SchedulerOutput and the output pickled between the processes if
    pickle_between), update_from_output. Returns (scheduler_output, engine outputs)."""
    scheduler_output = scheduler.schedule()
    sent = cross_process(scheduler_output) if pickle_between else scheduler_output
    kv_out = run_worker_step(worker, config, sent, kv_caches)
    mro = model_runner_output(scheduler, scheduler_output, kv_out)
    if pickle_between:
        mro = cross_process(mro)
    engine_outputs = scheduler.update_from_output(scheduler_output, mro)
    return scheduler_output, engine_outputs
