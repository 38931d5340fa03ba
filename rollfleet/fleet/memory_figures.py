"""What a model's parts weigh, worked out from its config.json alone, before any process loads it:
the parameters (dense and Qwen-style MoE), a LoRA adapter's, a token's KV cache and a token's saved
activations in the trainer's forward. The memory plan (rollfleet.fleet.memory_plan) adds them up
per GPU; here are only the model's own figures."""

from __future__ import annotations

from dataclasses import dataclass

# saved tensors of one decoder layer per token, in compute-dtype elements, as autograd keeps them in
# transformers' Qwen3/Llama layers without gradient checkpointing (the trainer has none): two
# RMSNorms (fp32 copies: ~5 hidden each), the q/k/v projections, the q/k norms and rotary outputs,
# SDPA's inputs and output, o_proj's input, and the MLP's gate, up, activation and product
NORM_ELEMENTS, MLP_ELEMENTS = 8, 4
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
LORA_SHAPES = {  # target name -> (in, out) as a function of the shape
    "q_proj": lambda s: (s.hidden, s.q_dim),
    "k_proj": lambda s: (s.hidden, s.kv_dim),
    "v_proj": lambda s: (s.hidden, s.kv_dim),
    "o_proj": lambda s: (s.q_dim, s.hidden),
    "gate_proj": lambda s: (s.hidden, s.intermediate),
    "up_proj": lambda s: (s.hidden, s.intermediate),
    "down_proj": lambda s: (s.intermediate, s.hidden),
}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only model that memory depends on (a config.json's text part)."""

    hidden: int
    layers: int
    vocab: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k
    attention_bias: bool = False  # Qwen2: biases on q, k, v
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0  # Qwen2-MoE's shared expert (with its 1-wide gate)
    moe_layers: int = 0  # how many of the layers have experts instead of a dense MLP
    dtype_bytes: int = 2  # the checkpoint's dtype

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        """From a config.json's dict (a multimodal config's `text_config` when it has one)."""
        text = config.get("text_config") or config
        hidden, layers, heads = text["hidden_size"], text["num_hidden_layers"], text["num_attention_heads"]
        experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts") or 0
        step, dense_only = text.get("decoder_sparse_step") or 1, set(text.get("mlp_only_layers") or [])
        moe = [i for i in range(layers) if experts and (i + 1) % step == 0 and i not in dense_only]
        dtype = str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16")
        return cls(
            hidden=hidden,
            layers=layers,
            vocab=text["vocab_size"],
            intermediate=text.get("intermediate_size") or 4 * hidden,
            heads=heads,
            kv_heads=text.get("num_key_value_heads") or heads,
            head_dim=text.get("head_dim") or hidden // heads,
            tied=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
            qk_norm=str(text.get("model_type", "")).startswith("qwen3"),
            # Qwen2's q/k/v biases are in its code, not its config
            attention_bias=bool(text.get("qkv_bias", text.get("attention_bias", text.get("model_type") == "qwen2"))),
            experts=experts,
            experts_per_token=text.get("num_experts_per_tok") or 0,
            expert_intermediate=text.get("moe_intermediate_size") or 0,
            shared_expert_intermediate=text.get("shared_expert_intermediate_size") or 0,
            moe_layers=len(moe),
            dtype_bytes=DTYPE_BYTES.get(dtype.removeprefix("torch."), 2),
        )

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def _attention_parameters(self) -> int:
        weights = 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim
        bias = (self.q_dim + 2 * self.kv_dim) if self.attention_bias else 0
        return weights + bias + (2 * self.head_dim if self.qk_norm else 0)

    def _moe_mlp_parameters(self) -> int:
        shared = self.shared_expert_intermediate
        shared_params = 3 * self.hidden * shared + self.hidden if shared else 0
        return self.hidden * self.experts + self.experts * 3 * self.hidden * self.expert_intermediate + shared_params

    def layer_parameters(self) -> int:
        """One dense layer's parameters (attention, two norms, MLP)."""
        return self._attention_parameters() + 2 * self.hidden + 3 * self.hidden * self.intermediate

    def parameters(self) -> int:
        """Every parameter (what `sum(p.numel())` of the loaded model gives)."""
        dense = self.layers - self.moe_layers
        layers = self.layers * (self._attention_parameters() + 2 * self.hidden)
        layers += dense * 3 * self.hidden * self.intermediate + self.moe_layers * self._moe_mlp_parameters()
        return layers + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def embedding_parameters(self) -> int:
        """The embedding and lm_head (the root module FSDP gathers whole)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def lora_parameters(self, rank: int, targets: list[str]) -> int:
        """A rank-`rank` adapter's parameters on `targets` (A: rank x in, B: out x rank) in every layer;
        the MLP targets only where the layer is dense (fused experts take no adapter); lm_head and
        embed_tokens once each (rank x (vocab + hidden))."""
        ends = rank * (self.vocab + self.hidden) * sum(name in targets for name in ("lm_head", "embed_tokens"))
        return ends + sum(count * rank * (fan_in + fan_out) for count, fan_in, fan_out in self._lora_targets(targets))

    def lora_target_weights(self, targets: list[str]) -> int:
        """Parameters of the base weights `targets` cover, lm_head and embed_tokens included: an engine that
        merges an adapter keeps a copy of each beside the weights, to restore the base (engine/lora/lora_merge.py)."""
        head = self.vocab * self.hidden * sum(name in targets for name in ("lm_head", "embed_tokens"))
        return head + sum(count * fan_in * fan_out for count, fan_in, fan_out in self._lora_targets(targets))

    def _lora_targets(self, targets: list[str]):
        """(layers, in, out) of each target a layer holds; others are checked against the model when the
        run starts (rollfleet.train.lora)."""
        for name in targets:
            if name in LORA_SHAPES:
                mlp = name in ("gate_proj", "up_proj", "down_proj")
                yield (self.layers - self.moe_layers if mlp else self.layers), *LORA_SHAPES[name](self)

    def kv_bytes_per_token(self, dtype_bytes: int, tp_size: int = 1) -> int:
        """Keys and values of one token on one tp rank (KV heads split over tp, replicated when fewer)."""
        return self.layers * 2 * max(self.kv_heads // tp_size, 1) * self.head_dim * dtype_bytes

    def activation_bytes_per_token(self, dtype_bytes: int) -> int:
        """What one token's forward keeps for the backward, over every layer (see NORM_ELEMENTS)."""
        attention = 3 * self.q_dim + 4 * self.kv_dim + 5 * (self.q_dim + self.kv_dim) * self.qk_norm
        dense_mlp = MLP_ELEMENTS * self.intermediate
        expert_width = self.experts_per_token * self.expert_intermediate + self.shared_expert_intermediate
        moe_mlp = MLP_ELEMENTS * expert_width + self.experts
        per_layer = NORM_ELEMENTS * self.hidden + attention
        total = self.layers * per_layer + (self.layers - self.moe_layers) * dense_mlp + self.moe_layers * moe_mlp
        return total * dtype_bytes
