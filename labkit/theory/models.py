"""Real model shapes, and their parameter counts computed exactly."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """A transformer's shape, enough to count its parameters exactly."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int  # MLP inner size (a dense layer's, for MoE models)
    vocab: int
    gated_mlp: bool = True  # SwiGLU: 3 matrices; GELU MLP: 2
    biases: bool = False
    norm: str = "rmsnorm"  # "layernorm" has a bias too
    tied_embeddings: bool = False
    learned_positions: int = 0  # rows of a learned position table (GPT-2/3)
    seq: int = 2048  # training context, for activation estimates
    # mixture of experts (DeepSeek-V3 style): the first `dense_layers` are dense
    experts: int = 0
    shared_experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int = 0
    dense_layers: int = 0
    # multi-head latent attention (DeepSeek-V2/V3)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0


MODELS = {
    # Radford et al. 2019; HF "gpt2": 124,439,808 parameters
    "gpt2-small": ModelConfig("GPT-2 small", 12, 768, 12, 12, 3072, 50257,
                              gated_mlp=False, biases=True, norm="layernorm",
                              tied_embeddings=True, learned_positions=1024, seq=1024),
    # Brown et al. 2020, table 2.1: 96 layers, d_model 12288, 96 heads, 2048 context
    "gpt3-175b": ModelConfig("GPT-3 175B", 96, 12288, 96, 96, 4 * 12288, 50257,
                             gated_mlp=False, biases=True, norm="layernorm",
                             tied_embeddings=True, learned_positions=2048),
    # Llama Team 2024, "The Llama 3 Herd of Models", table 3; vocabulary 128,256
    "llama3-8b": ModelConfig("Llama 3 8B", 32, 4096, 32, 8, 14336, 128256, seq=8192),
    "llama3-70b": ModelConfig("Llama 3 70B", 80, 8192, 64, 8, 28672, 128256,
                              seq=8192),
    "llama3-405b": ModelConfig("Llama 3 405B", 126, 16384, 128, 8, 53248, 128256,
                               seq=8192),
    # DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", sec. 4.2 (and its config)
    "deepseek-v3": ModelConfig("DeepSeek-V3", 61, 7168, 128, 128, 18432, 129280,
                               seq=4096, experts=256, shared_experts=1,
                               experts_per_token=8, expert_ffn=2048, dense_layers=3,
                               q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128,
                               qk_rope_dim=64, v_head_dim=128),
}

PUBLISHED_PARAMS = {  # what each source reports, for the tests
    "gpt2-small": 124e6, "gpt3-175b": 175e9, "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9, "llama3-405b": 405.9e9, "deepseek-v3": 671e9,
}


def _attention_params(c: ModelConfig) -> int:
    h = c.hidden
    if c.kv_lora_rank:  # multi-head latent attention
        qk = c.qk_nope_dim + c.qk_rope_dim
        q = h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * c.heads * qk
        kv = (h * (c.kv_lora_rank + c.qk_rope_dim) + c.kv_lora_rank
              + c.kv_lora_rank * c.heads * (c.qk_nope_dim + c.v_head_dim))
        return q + kv + c.heads * c.v_head_dim * h
    head = h // c.heads
    q_out, kv_out = h, 2 * c.kv_heads * head
    n = h * (q_out + kv_out) + h * h
    return n + (q_out + kv_out + h if c.biases else 0)


def _mlp_params(c: ModelConfig, inner: int) -> int:
    mats = 3 if c.gated_mlp else 2
    return mats * c.hidden * inner + ((inner + c.hidden) if c.biases else 0)


def param_count(config: ModelConfig | str, active: bool = False) -> int:
    """Parameters of a model, counted from its shape; active=True counts only those
    one token uses (for MoE: the shared and the top-k routed experts)."""
    c = MODELS[config] if isinstance(config, str) else config
    norm = c.hidden * (2 if c.norm == "layernorm" else 1)
    embed = c.vocab * c.hidden * (1 if c.tied_embeddings else 2)
    embed += c.learned_positions * c.hidden
    total = embed + norm  # + the final norm
    for layer in range(c.layers):
        total += _attention_params(c) + 2 * norm
        if c.experts and layer >= c.dense_layers:
            routed = c.experts_per_token if active else c.experts
            total += (routed + c.shared_experts) * _mlp_params(c, c.expert_ffn)
            total += c.experts * c.hidden + c.experts  # router weights and bias
        else:
            total += _mlp_params(c, c.ffn)
    return total
