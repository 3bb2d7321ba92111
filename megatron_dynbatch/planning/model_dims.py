"""The model's dimensions, as Megatron's arguments state them: what the memory model (and a
FLOP-based step-time model) derives its bytes and work from.

Standard library only. A builder from a Megatron argument namespace lives with the hosts that
parse Megatron's flags (``integrations/model_args.py``), not here: planning reads no ``args``.

Parameter counts follow Megatron-Core's GPT layer spec (``get_gpt_layer_local_spec`` /
``get_gpt_layer_with_transformer_engine_spec``): per layer an input norm, a fused QKV projection
(``heads * kv_channels`` query columns and ``2 * groups * kv_channels`` key/value columns), the
output projection, a pre-MLP norm and the MLP (``fc1`` twice as wide with a gated linear unit).
Tensor parallelism splits the projection matrices and the vocabulary; norms and the row-parallel
biases are replicated on every TP rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Tuple

from megatron_dynbatch.errors import DynBatchValueError

from .spec import ParallelLayout, _set_int, ceil_div

__all__ = ["DTYPE_BYTES", "ModelDims"]

#: Bytes of one element of each parameter dtype Megatron trains in.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True, kw_only=True)
class ModelDims:
    """A GPT's dimensions and its parallel layout (Megatron's argument names, without ``--``)."""

    num_layers: int
    """Transformer layers of the whole model (all pipeline stages)."""
    hidden_size: int
    """Model width ``h``."""
    num_attention_heads: int
    """Query heads."""
    vocab_size: int
    """Vocabulary rows of the embedding and output layer, as Megatron pads them
    (``--make-vocab-size-divisible-by`` x tp)."""
    ffn_hidden_size: Optional[int] = None
    """MLP width; ``None``: Megatron's default ``4 * hidden_size``."""
    num_query_groups: Optional[int] = None
    """Key/value heads (grouped-query attention); ``None``: one a query head."""
    kv_channels: Optional[int] = None
    """Width of one head; ``None``: ``hidden_size // num_attention_heads``."""
    gated_linear_unit: bool = False
    """``--swiglu``: ``fc1`` produces two ``ffn_hidden_size`` halves."""
    add_bias_linear: bool = True
    """Linear layers carry biases (Megatron's default; ``--disable-bias-linear`` turns it off)."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """A LayerNorm has a weight and a bias, an RMSNorm a weight only."""
    position_embeddings: int = 0
    """Rows of a learned absolute position embedding (``--max-position-embeddings`` with
    ``--position-embedding-type learned_absolute``); 0 for rotary / none."""
    untie_embeddings: bool = False
    """``--untie-embeddings-and-output-weights``: the output layer has its own weight. Tied or
    not, with ``pp_size > 1`` the last stage holds a copy of the vocabulary matrix."""
    params_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """What the model's weights and activations are stored in (``--bf16`` / ``--fp16``)."""
    sequence_parallel: bool = False
    """``--sequence-parallel``: norms, dropouts and residuals hold ``1/tp`` of the tokens."""
    num_experts: int = 0
    """MoE experts per layer (``--num-experts``); 0: a dense MLP."""
    moe_ffn_hidden_size: Optional[int] = None
    """Width of one expert's MLP; ``None``: ``ffn_hidden_size``."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    ep_size: int = 1
    """Expert-parallel size: each rank holds ``num_experts / ep_size`` experts."""
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    """tp / pp / cp / vpp / dp sizes (and the interleaving group)."""
    stage_chunk_layers: Optional[Tuple[Tuple[int, ...], ...]] = None
    """Transformer layers of each model chunk of each pipeline stage (``[stage][chunk]``), where
    Megatron does not split ``num_layers`` evenly (``--decoder-first-pipeline-num-layers``,
    ``--decoder-last-pipeline-num-layers``, ``--pipeline-model-parallel-layout``,
    ``--account-for-embedding-in-pipeline-split`` / ``-loss-``: the heavier stage holds more
    activations and sets the pipeline's pace); ``None``: the even split (:meth:`chunk_layers`)."""

    def __post_init__(self) -> None:
        fix = "pass the model's own Megatron arguments."
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
            _set_int(self, name, 1, fix)
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            # Megatron derives kv_channels = hidden_size / heads and refuses a remainder.
            raise DynBatchValueError(
                f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads="
                f"{self.num_attention_heads}, and without kv_channels each head has "
                "hidden_size / num_attention_heads channels (Megatron refuses this); pass the "
                "model's own --hidden-size and --num-attention-heads (or its --kv-channels)."
            )
        for name, default in (
            ("ffn_hidden_size", 4 * self.hidden_size),
            ("num_query_groups", self.num_attention_heads),
            ("kv_channels", self.hidden_size // self.num_attention_heads),
            ("moe_ffn_hidden_size", self.ffn_hidden_size or 4 * self.hidden_size),
        ):
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
            _set_int(self, name, 1, fix)
        _set_int(self, "position_embeddings", 0, fix)
        _set_int(self, "num_experts", 0, fix)
        _set_int(self, "moe_router_topk", 1, fix)
        _set_int(self, "ep_size", 1, fix)
        if self.params_dtype not in DTYPE_BYTES:
            raise DynBatchValueError(
                f"params_dtype={self.params_dtype!r} is not one of {tuple(DTYPE_BYTES)}; "
                "train in fp32, --bf16 or --fp16."
            )
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise DynBatchValueError(
                f"normalization={self.normalization!r} must be LayerNorm or RMSNorm."
            )
        if not isinstance(self.parallel, ParallelLayout):
            raise DynBatchValueError(f"parallel={self.parallel!r} must be a ParallelLayout.")
        if self.stage_chunk_layers is not None:
            layers = self.stage_chunk_layers
            pp, vpp = self.parallel.pp_size, self.parallel.vpp_size
            if not (
                isinstance(layers, tuple)
                and len(layers) == pp
                and all(isinstance(stage, tuple) and len(stage) == vpp for stage in layers)
                and all(type(n) is int and n >= 0 for stage in layers for n in stage)
            ):
                raise DynBatchValueError(
                    f"stage_chunk_layers={layers!r} must hold, for each of the {pp} pipeline "
                    f"stages, a tuple of {vpp} layer counts (integers >= 0)."
                )
        if self.num_attention_heads % self.num_query_groups:
            raise DynBatchValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}; pass Megatron's own values."
            )
        if self.num_experts and self.num_experts % self.ep_size:
            raise DynBatchValueError(
                f"num_experts={self.num_experts} is not a multiple of ep_size={self.ep_size}."
            )
        tp = self.parallel.tp_size
        if self.num_attention_heads % tp or self.num_query_groups % tp:
            # Megatron splits the attention heads (and key/value groups) over the tensor-parallel
            # ranks and refuses a remainder; a memory estimate of such a model means nothing.
            raise DynBatchValueError(
                f"num_attention_heads={self.num_attention_heads} and num_query_groups="
                f"{self.num_query_groups} must be multiples of tp_size={tp} (Megatron splits "
                "them over the tensor-parallel ranks); pass a tp_size that divides both."
            )
        # Fewer layers than model chunks is not refused here: Megatron checks its own split, and
        # --account-for-embedding-in-pipeline-split (or -loss-) gives a stage the embedding (or
        # the loss) in place of a layer, e.g. 3 layers at pp 4. Such a chunk holds no layer
        # (chunk_layers 0); the others are estimated as an even split.

    # --- shapes ---------------------------------------------------------------------------------

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one parameter / activation element in ``params_dtype``."""
        return DTYPE_BYTES[self.params_dtype]

    @property
    def query_width(self) -> int:
        """Columns of the query projection (``heads * kv_channels``)."""
        return self.num_attention_heads * self.kv_channels

    @property
    def kv_width(self) -> int:
        """Columns of the key and of the value projection (``groups * kv_channels``)."""
        return self.num_query_groups * self.kv_channels

    def chunk_layers(self, stage: int, chunk: int = 0) -> int:
        """Layers in model chunk ``chunk`` of pipeline stage ``stage``.

        Megatron splits ``num_layers`` over ``pp_size * vpp_size`` chunks in the order chunk 0 of
        every stage, then chunk 1, ...; an uneven split gives the first chunks one layer more
        (Megatron itself asks for an even split unless first/last-stage layer counts are given).
        With fewer layers than chunks the last chunks hold none (0). :attr:`stage_chunk_layers`,
        where given, says instead.
        """
        if self.stage_chunk_layers is not None:
            return self.stage_chunk_layers[stage][chunk]
        chunks = self.parallel.pp_size * self.parallel.vpp_size
        index = chunk * self.parallel.pp_size + stage
        base, extra = divmod(self.num_layers, chunks)
        return base + (1 if index < extra else 0)

    def stage_layers(self, stage: int) -> int:
        """Transformer layers on pipeline stage ``stage`` (all its virtual chunks)."""
        return sum(self.chunk_layers(stage, c) for c in range(self.parallel.vpp_size))

    # --- parameters on one rank -----------------------------------------------------------------

    def _norm_params(self) -> int:
        return self.hidden_size * (2 if self.normalization == "LayerNorm" else 1)

    def layer_params(self) -> int:
        """Parameters of one transformer layer on one tensor-parallel rank (its expert share
        with MoE)."""
        h, tp = self.hidden_size, self.parallel.tp_size
        bias = 1 if self.add_bias_linear else 0
        qkv_out = self.query_width + 2 * self.kv_width
        attention = (
            ceil_div(h * qkv_out, tp)
            + bias * ceil_div(qkv_out, tp)
            + ceil_div(self.query_width * h, tp)
            + bias * h
        )
        if self.num_experts:
            experts = self.num_experts // self.ep_size
            mlp = self.hidden_size * self.num_experts + experts * self._mlp_params(
                self.moe_ffn_hidden_size, bias
            )
        else:
            mlp = self._mlp_params(self.ffn_hidden_size, bias)
        return 2 * self._norm_params() + attention + mlp

    def _mlp_params(self, ffn: int, bias: int) -> int:
        h, tp = self.hidden_size, self.parallel.tp_size
        fc1 = ffn * (2 if self.gated_linear_unit else 1)
        return ceil_div(h * fc1, tp) + bias * ceil_div(fc1, tp) + ceil_div(ffn * h, tp) + bias * h

    def embedding_params(self) -> int:
        """Word (and learned position) embedding parameters on the first stage, one TP rank."""
        return (
            ceil_div(self.vocab_size, self.parallel.tp_size) * self.hidden_size
            + self.position_embeddings * self.hidden_size
        )

    def stage_params(self, stage: int) -> int:
        """Parameters pipeline stage ``stage`` holds on one TP rank: its layers, the embeddings
        (first stage), the final norm and the output layer (last stage)."""
        pp = self.parallel.pp_size
        params = self.stage_layers(stage) * self.layer_params()
        if stage == 0:
            params += self.embedding_params()
        if stage == pp - 1:
            params += self._norm_params()
            if self.untie_embeddings or pp > 1:
                params += ceil_div(self.vocab_size, self.parallel.tp_size) * self.hidden_size
        return params

    def stages(self) -> Tuple[int, ...]:
        """The pipeline stage indices, ``0 .. pp_size - 1``."""
        return tuple(range(self.parallel.pp_size))
