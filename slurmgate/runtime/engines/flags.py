"""The flags the launcher owns, one table per engine family: a command or a role may not set them.

The launcher renders these from the layout (a replica's or a role worker's sizes, its ports and
its multi-node rendezvous); a `command` or a role's `args` that set one would fight the layout,
so the spec refuses them. An engine's classic replica and its role workers own one family's
table; a role worker owns a few flags more where its launch sets them (the role, its ports).
Pure data: standard library only.
"""

from __future__ import annotations

# -- vLLM, and `custom` (a server that speaks vLLM's flags) ------------------------------------
# https://docs.vllm.ai/en/latest/serving/parallelism_scaling.html and
# https://docs.vllm.ai/en/latest/serving/data_parallel_deployment.html

# A replica's HTTP, sizes and multi-node rendezvous, in vLLM's long forms: what `custom` owns.
CUSTOM = (
    "--host",
    "--port",
    "--tensor-parallel-size",
    "--pipeline-parallel-size",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--headless",
    "--distributed-timeout-seconds",
    "--enable-expert-parallel",
    # A replica is one server on TP × PP GPUs; data parallelism is more replicas, or the
    # `data_parallel` field where the engine has a data-parallel launch (vLLM).
    "--data-parallel-size",
)
# vLLM also has short forms, and the other data-parallel flags of its multi-node launch: its
# replicas and its role workers own these. --kv-transfer-config is not among them: a role's
# args may carry a connector the deployment's kv_transfer cannot name (a recipe's
# MultiConnector); the spec then refuses kv_transfer beside it.
VLLM = (
    *CUSTOM,
    "-tp",
    "-pp",
    "-dp",
    "--data-parallel-size-local",
    "--data-parallel-address",
    "--data-parallel-rpc-port",
    "--data-parallel-start-rank",
    "--data-parallel-rank",
    "--data-parallel-hybrid-lb",
    "--data-parallel-external-lb",
)

# -- SGLang ------------------------------------------------------------------------------------
# https://docs.sglang.ai/advanced_features/server_arguments.html and
# https://docs.sglang.ai/advanced_features/pd_disaggregation.html

# A replica's HTTP, sizes and multi-node rendezvous, and its metrics.
SGLANG = (
    "--host",
    "--port",
    "--tp",
    "--tp-size",
    "--tensor-parallel-size",
    "--pp",
    "--pp-size",
    "--pipeline-parallel-size",
    "--ep",
    "--ep-size",
    "--expert-parallel-size",
    "--dp",
    "--dp-size",
    "--data-parallel-size",
    "--nnodes",
    "--node-rank",
    "--dist-init-addr",
    "--nccl-init-addr",
    "--dist-timeout",
    "--enable-metrics",
)
# A prefill or decode worker's role, and where a prefill worker serves its KV cache handshake.
SGLANG_PD = ("--disaggregation-mode", "--disaggregation-bootstrap-port")
# A role worker's too: DP attention, its NCCL port, its role and the KV transfer backend.
SGLANG_ROLE = (
    *SGLANG,
    "--enable-dp-attention",
    "--nccl-port",
    *SGLANG_PD,
    "--disaggregation-transfer-backend",
)

# `custom`'s role workers: vLLM's words, and SGLang's role words, which a stub engine playing
# prefill and decode behind a PD router parses.
CUSTOM_ROLE = (*VLLM, *SGLANG_PD)

# -- llama.cpp ---------------------------------------------------------------------------------
# https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md

LLAMACPP = ("--host", "--port", "--metrics")

# -- TensorRT-LLM ------------------------------------------------------------------------------
# `trtllm-serve MODEL` (tensorrt_llm/commands/serve.py): the sizes, and the LLM-API YAML
# (`--config`, which overrides them) the launcher writes from the role's `engine_config`.

TRTLLM = (
    "--host",
    "--port",
    "--tp_size",
    "--tensor_parallel_size",
    "--pp_size",
    "--pipeline_parallel_size",
    "--ep_size",
    "--moe_expert_parallel_size",
    "--config",
    "--extra_llm_api_options",
    "--extra-engine-args",
)
# The keys of that YAML the launcher sets from the role's sizes.
TRTLLM_CONFIG_KEYS = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "moe_expert_parallel_size",
    "enable_attention_dp",
)

# -- Dynamo workers ----------------------------------------------------------------------------
# https://docs.nvidia.com/dynamo/latest/: a Dynamo worker is its engine's launch plus Dynamo's
# request plane and role flags.

DYNAMO = ("--request-plane", "--disaggregation-mode")
DYNAMO_SGLANG = (*SGLANG_ROLE, *DYNAMO)
DYNAMO_VLLM = (*VLLM, *DYNAMO)
DYNAMO_TRTLLM = (*TRTLLM, *DYNAMO)
