"""What a training step holds in memory on each pipeline stage: the model, and the bound a
memory budget puts on the planner.

Standard library only. A stage's peak is its **static** bytes (weights, gradients, optimizer
state) plus the largest sum, over the schedule, of the **activations** its live micro-batches keep
for their backward pass:

* static (per TP rank, Megatron's DDP and optimizer): fp32 training holds 4 (weight) + 4 (fp32
  gradient buffer) + 8 (Adam's two moments) bytes a parameter; bf16 / fp16 training 2 (weight) +
  4 (fp32 gradient buffer) + 4 (fp32 main weight) + 8 (Adam) bytes. The distributed optimizer
  divides the main weights and Adam's moments over the DP ranks.
* activations of one micro-batch of ``B`` rows of ``S`` tokens, per layer, as saved for the backward
  of Megatron-Core's GPT layer (Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models", counted by tensor): the two norms' inputs and the QKV / fc1 inputs (``h``
  each; ``1/tp`` with sequence parallelism), query, key, value and the attention output
  (``(2 * heads + 2 * groups) * kv_channels / tp``), fc1's output and the activation's output
  (``(fc1 width + ffn) / tp``), times the dtype's bytes, times ``B * S / cp``. Attention that
  materialises its ``S x S`` scores (the cost model's ``dense``: Megatron's ``local`` and unfused
  paths) adds the softmax it keeps, ``dtype bytes * heads / tp`` a row per ``S**2 / cp``
  (attention dropout, off here, would keep its output and mask too); fused / flash attention (``segment``,
  ``causal``) keeps no scores. ``selective`` recompute keeps no scores either; ``full`` keeps only
  every layer's input, and one layer's activations while it recomputes it.
* MoE layers add the token dispatch: the tokens permuted to their ``topk`` experts and the
  experts' permuted output, ``2 x topk x h`` a token (:meth:`MemoryModel.moe_dispatch_token_bytes`).
* context parallelism divides every per-token term by ``cp`` (each rank holds ``S / cp`` of a
  row) and adds the ring attention's key/value blocks in flight while a layer runs
  (:meth:`MemoryModel.cp_ring_bytes`).
* the last stage's logits and loss buffers: ``vocab / tp`` logits a token in the dtype, their fp32
  copy and the fp32 softmax the cross entropy keeps (``vocab / tp * (dtype + 8)`` bytes a token);
  the first stage's embedding output (``h`` a token).
* the micro-batches alive at once: Megatron's 1F1B schedule runs ``pp - 1 - stage`` warm-up
  forwards before its first backward, so stage ``s`` holds ``min(M, pp - s)`` micro-batches; the
  interleaved schedule warms up ``2 * (pp - 1 - stage) + (vpp - 1) * group`` model-chunk
  forwards (:func:`schedule_events` replays either order).

The memory fit (:func:`fit_activation_scale`) scales the counted activation bytes (the per-token
and per-``S**2`` terms alike, by one factor a stage) to the measured peaks of the first steps
(least squares) and replaces the static estimate with the memory measured at rest, so
``MemoryModel.token_scale`` / ``score_scale`` / ``resting_bytes`` carry the run's own figures.

A budget (:class:`MemoryLimit`) bounds each candidate shape of the planner: ``row_cap(B)`` is the
longest row a micro-batch of ``B`` rows may have so that every stage, holding as many such
micro-batches as its schedule ever keeps alive, stays within the budget.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Dict, List, Literal, Optional, Sequence, Tuple

from megatron_dynbatch.errors import DynBatchValueError

from .model_dims import ModelDims

__all__ = [
    "GIB",
    "MIB",
    "MemoryLimit",
    "MemoryModel",
    "MicroShape",
    "PeakTerms",
    "UNCALIBRATED_SAFETY",
    "UNFITTED_SAFETY",
    "block_recompute_layers",
    "fit_activation_scale",
    "fit_peak_line",
    "budget_gib",
    "gib_to_bytes",
    "predicted_step_peaks",
    "schedule_events",
    "step_shapes",
]

GIB = 1 << 30
MIB = 1 << 20


def budget_gib(peak_bytes: float, margin: float = 0.0) -> float:
    """The smallest memory budget in GiB, rounded up to 0.001, that holds ``peak_bytes`` with
    ``margin`` (a fraction) on top: the value a refusal names, so that it passes the same check."""
    return math.ceil(peak_bytes * (1.0 + margin) / GIB * 1000) / 1000


def gib_to_bytes(gib: float) -> int:
    """A budget the user states in GiB (``--max-memory-gib``, a host's key), in whole bytes."""
    return int(float(gib) * GIB)


#: Until a run's peaks are measured, a prediction counts the activation bytes this many times
#: over: the counted tensors miss the transients of a backward (gradients of the activations, the
#: allocator's slack), which the memory fit's factors put at 1.8-3.3x on CPU.
UNFITTED_SAFETY = 2.0
#: The former name of :data:`UNFITTED_SAFETY` ("calibration" now names only the step-time fit).
UNCALIBRATED_SAFETY = UNFITTED_SAFETY

#: Bytes of Adam's state a parameter (two fp32 moments).
_ADAM_BYTES = 8
#: Bytes of an fp32 value (gradient buffer, main weight, logits copy).
_FP32 = 4

MicroShape = Tuple[int, int]
"""One micro-batch's ``(rows B, row length S)``."""


def schedule_events(
    num_microbatches: int, pp_size: int, stage: int, vpp_size: int = 1, group: Optional[int] = None
) -> List[Tuple[bool, int, int]]:
    """The order in which stage ``stage`` runs forwards and backwards in one training step.

    Each event is ``(is_forward, micro-batch, model chunk)``. Megatron's schedules: without
    interleaving ``pp - 1 - stage`` warm-up forwards, then one forward and one backward in turn,
    then the remaining backwards; with interleaving (``vpp_size > 1``) the micro-batches are walked
    in groups of ``group`` (default ``pp_size``), every model chunk of a group in turn, with
    ``2 * (pp - 1 - stage) + (vpp - 1) * group`` warm-up forwards, and the backwards walk the
    same table with the chunks reversed. ``pp_size == 1`` runs forward, backward, forward, ...
    """
    m, vpp = num_microbatches, vpp_size
    group = group or pp_size
    if vpp == 1:
        table = [(mb, 0) for mb in range(m)]
        warmup = pp_size - 1 - stage if pp_size > 1 else 0
    else:
        table = []
        for first in range(0, m, group):
            last = m if first + group >= m else first + group
            table += [(mb, chunk) for chunk in range(vpp) for mb in range(first, last)]
        warmup = 2 * (pp_size - 1 - stage) + (vpp - 1) * group
    total = len(table)
    warmup = min(warmup, total)
    events: List[Tuple[bool, int, int]] = [(True, *table[k]) for k in range(warmup)]
    for k in range(total - warmup):
        events.append((True, *table[k + warmup]))
        mb, chunk = table[k]
        events.append((False, mb, vpp - 1 - chunk))
    for k in range(total - warmup, total):
        mb, chunk = table[k]
        events.append((False, mb, vpp - 1 - chunk))
    return events


@dataclass(frozen=True)
class PeakTerms:
    """A stage's predicted peak, by term (bytes); ``total`` is what the model predicts."""

    static: float
    """Weights, gradients and optimizer state (or the memory measured at rest, once fitted)."""
    tokens: float
    """Activations proportional to tokens (layers, embeddings, logits), before ``token_scale``."""
    scores: float
    """Attention scores proportional to ``S**2`` a row, before ``score_scale``."""
    total: float
    """``static + token_scale * tokens + score_scale * scores``."""


def block_recompute_layers(granularity: object, method: object, count: object) -> Optional[int]:
    """:attr:`MemoryModel.recompute_block_layers` of Megatron's ``recompute_granularity``,
    ``recompute_method`` and ``recompute_num_layers`` (flags or TransformerConfig keys): the
    count under ``full`` / ``block``, else ``None`` (every layer recomputed, or none)."""
    if granularity != "full" or method != "block":
        return None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


@dataclass(frozen=True, kw_only=True)
class MemoryModel:
    """Bytes a training step holds on each pipeline stage (see the module docstring)."""

    dims: ModelDims
    """The model's dimensions and parallel layout."""
    attention: Literal["segment", "causal", "dense"] = "dense"
    """What attention runs (``spec.ATTENTION_KINDS``): only ``dense`` keeps ``S x S`` scores."""
    recompute: Optional[Literal["selective", "full"]] = None
    """``--recompute-granularity``: ``selective`` drops the scores, ``full`` keeps only each
    layer's input."""
    recompute_block_layers: Optional[int] = None
    """With ``full`` recompute and ``--recompute-method block``, ``--recompute-num-layers``: the
    first that many layers of each model chunk are recomputed, the others keep their activations
    as without recompute (Megatron's ``TransformerBlock``). ``None``: every layer (``uniform``)."""
    distributed_optimizer: bool = False
    """``--use-distributed-optimizer``: main weights and Adam's moments divided over DP."""
    base_bytes: float = 0.0
    """Memory of the process besides the model (CUDA context and workspaces, or on CPU the
    interpreter and its libraries), added to every stage's static estimate."""
    token_scale: float = 1.0
    """Fitted factor (the memory fit) on the per-token activation bytes (1.0: as counted)."""
    score_scale: float = 1.0
    """Fitted factor (the memory fit) on the per-``S**2`` attention-score bytes (1.0: as counted)."""
    resting_bytes: Tuple[float, ...] = ()
    """Memory fit: per stage, the memory measured at rest between steps, which replaces
    ``static_bytes + base_bytes``; ``()``: not measured."""
    stage_scales: Tuple[Tuple[float, float], ...] = field(default=())
    """Memory fit: per stage, ``(token_scale, score_scale)`` fitted to that stage's own peaks;
    ``()``: ``token_scale`` / ``score_scale`` on every stage."""

    def __post_init__(self) -> None:
        if not isinstance(self.dims, ModelDims):
            raise DynBatchValueError(f"dims={self.dims!r} must be a ModelDims.")
        if self.attention not in ("segment", "causal", "dense"):
            raise DynBatchValueError(
                f"attention={self.attention!r} must be segment, causal or dense."
            )
        if self.recompute not in (None, "selective", "full"):
            raise DynBatchValueError(
                f"recompute={self.recompute!r} must be None, 'selective' or 'full' "
                "(--recompute-granularity)."
            )
        block = self.recompute_block_layers
        if block is not None and (
            isinstance(block, bool) or not isinstance(block, int) or block < 0
        ):
            raise DynBatchValueError(
                f"recompute_block_layers={block!r} must be None or a whole number >= 0 "
                "(--recompute-num-layers under --recompute-method block)."
            )
        for name in ("base_bytes", "token_scale", "score_scale"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise DynBatchValueError(f"{name}={value!r} must be a finite number >= 0.")
        pp = self.dims.parallel.pp_size
        for name in ("resting_bytes", "stage_scales"):
            value = getattr(self, name)
            if value and len(value) != pp:
                raise DynBatchValueError(
                    f"{name} has {len(value)} entries for pp_size={pp} stages; give one a stage."
                )

    # --- static -----------------------------------------------------------------------------

    def static_bytes(self, stage: int) -> float:
        """Weights, gradients and optimizer state of ``stage`` on one rank (no ``base_bytes``)."""
        dims = self.dims
        params = dims.stage_params(stage)
        dp = dims.parallel.dp_size if self.distributed_optimizer else 1
        if dims.params_dtype == "fp32":
            # The weights are the optimizer's main weights; only Adam's moments are sharded.
            return params * (dims.dtype_bytes + _FP32 + _ADAM_BYTES / dp)
        return params * (dims.dtype_bytes + _FP32 + (_FP32 + _ADAM_BYTES) / dp)

    def resting(self, stage: int) -> float:
        """What ``stage`` holds between steps: measured once fitted, else the estimate."""
        if self.resting_bytes:
            return float(self.resting_bytes[stage])
        return self.static_bytes(stage) + self.base_bytes

    # --- activations ------------------------------------------------------------------------

    def layer_token_bytes(self) -> float:
        """Activation bytes one token keeps in one layer on one rank (before ``token_scale``)."""
        dims = self.dims
        tp = dims.parallel.tp_size
        d = dims.dtype_bytes
        replicated = dims.hidden_size / (tp if dims.sequence_parallel else 1)
        if self.recompute == "full":
            return d * replicated  # the layer's input; the rest is recomputed
        ffn = dims.moe_ffn_hidden_size if dims.num_experts else dims.ffn_hidden_size
        fc1 = ffn * (2 if dims.gated_linear_unit else 1)
        attention = (2 * dims.query_width + 2 * dims.kv_width) / tp
        mlp = (fc1 + ffn) / tp
        if dims.num_experts:
            # Every token runs top-k experts (their inputs and hidden), plus the router's output.
            mlp = mlp * dims.moe_router_topk + dims.num_experts
        return d * (4 * replicated + attention + mlp) + self.moe_dispatch_token_bytes()

    def moe_dispatch_token_bytes(self) -> float:
        """Bytes of the MoE token dispatch one token keeps in one layer (0 for a dense MLP).

        Megatron's token dispatcher permutes each token to its ``topk`` experts (an all-to-all
        over the expert-parallel group when ``ep_size > 1``): the permuted hidden states are the
        experts' ``fc1`` input, kept for its backward, and the experts' permuted output is kept
        by the un-permute / combine (it is weighted by the router's probabilities): two
        ``topk x h`` buffers a token. Expert parallelism moves them, it does not shrink them (a
        rank receives as many routed tokens as it sends, on average), and tensor parallelism does
        not split them (the dispatcher gathers the sequence-parallel shards first). Full
        recompute keeps only the layer's input.
        """
        dims = self.dims
        if not dims.num_experts or self.recompute == "full":
            return 0.0
        return dims.dtype_bytes * 2 * dims.moe_router_topk * dims.hidden_size

    def cp_ring_bytes(self, shape: MicroShape) -> float:
        """Transient bytes of context-parallel attention in the layer running (0 at ``cp = 1``).

        With ``cp > 1`` each rank holds ``S / cp`` of a row's tokens (every per-token term above
        is divided by ``cp``); ring attention passes key/value blocks round the CP group, two in
        flight in the forward (the block in use and the one arriving) and, in the backward, two
        key/value blocks and two of their gradients: four blocks of ``2 x kv_width / tp`` a local
        token, alive one layer at a time.
        """
        dims = self.dims
        cp = dims.parallel.cp_size
        if cp == 1:
            return 0.0
        rows, length = shape
        block = 2 * dims.kv_width / dims.parallel.tp_size * dims.dtype_bytes
        return 4 * block * rows * length / cp

    def layer_score_bytes(self) -> float:
        """Bytes of attention scores a row keeps per ``S**2`` in one layer (0 unless ``dense``)."""
        if self.attention != "dense" or self.recompute is not None:
            return 0.0
        dims = self.dims
        # The softmax kept for its backward (the scores it is computed from are freed with the
        # layer's forward: a transient the memory fit absorbs). Measured on the tiny GPT:
        # 4.06 bytes per head, row and S**2 in fp32 (tests/megatron/test_memory_megatron.py).
        return dims.dtype_bytes * dims.num_attention_heads / dims.parallel.tp_size

    def logit_token_bytes(self) -> float:
        """Logits and cross-entropy buffers a token keeps on the last stage."""
        dims = self.dims
        vocab = dims.vocab_size / dims.parallel.tp_size
        return vocab * (dims.dtype_bytes + 2 * _FP32) + 2 * dims.hidden_size * dims.dtype_bytes

    def _layers_recomputed(self, stage: int, chunk: int) -> Tuple[int, int]:
        """``(recomputed, kept)`` layers of a chunk: ``full`` recompute rebuilds every layer, or
        under ``block`` the first :attr:`recompute_block_layers` (a probe: ``block 1`` of 8
        layers was predicted as all 8 recomputed, 11.1 GiB where 15.9 GiB are held)."""
        layers = self.dims.chunk_layers(stage, chunk)
        if self.recompute != "full":
            return 0, layers
        if self.recompute_block_layers is None:
            return layers, 0
        recomputed = min(self.recompute_block_layers, layers)
        return recomputed, layers - recomputed

    def _per_layer(self, recomputed: float, kept: float) -> Tuple[float, float]:
        """``(token bytes, score bytes per S**2 a row)`` of ``recomputed`` and ``kept`` layers:
        a recomputed layer keeps its input, a kept one what it keeps without recompute."""
        if self.recompute != "full":
            return (
                (recomputed + kept) * self.layer_token_bytes(),
                (recomputed + kept) * self.layer_score_bytes(),
            )
        plain = replace(self, recompute=None, recompute_block_layers=None)
        return (
            recomputed * self.layer_token_bytes() + kept * plain.layer_token_bytes(),
            kept * plain.layer_score_bytes(),
        )

    def chunk_terms(self, stage: int, chunk: int, shape: MicroShape) -> Tuple[float, float]:
        """``(token bytes, score bytes)`` one micro-batch keeps in one model chunk of a stage."""
        rows, length = shape
        dims = self.dims
        cp = dims.parallel.cp_size
        tokens = rows * length / cp
        per_token, per_score = self._per_layer(*self._layers_recomputed(stage, chunk))
        token_bytes = tokens * per_token
        score_bytes = rows * (length / cp) * length * per_score
        last_chunk = chunk == dims.parallel.vpp_size - 1
        if stage == 0 and chunk == 0:
            token_bytes += tokens * dims.hidden_size * dims.dtype_bytes
        if stage == dims.parallel.pp_size - 1 and last_chunk:
            token_bytes += tokens * self.logit_token_bytes()
        return token_bytes, score_bytes

    def _recompute_terms(self, stage: int, shapes: Sequence[MicroShape]) -> Tuple[float, float]:
        """Transients of the layer running: ``full`` recompute rebuilds one layer's whole
        activations during a backward; context parallelism's ring buffers
        (:meth:`cp_ring_bytes`) live while a layer's attention runs."""
        if not shapes:
            return 0.0, 0.0
        widest = max(shapes, key=lambda s: s[0] * s[1])
        ring = self.cp_ring_bytes(widest) if self.dims.chunk_layers(stage) else 0.0
        if self.recompute != "full" or self.recompute_block_layers == 0:
            return ring, 0.0
        full = replace(self, recompute=None, recompute_block_layers=None)
        rows, length = widest
        cp = self.dims.parallel.cp_size
        tokens = rows * length / cp
        return (
            tokens * full.layer_token_bytes() + ring,
            rows * (length / cp) * length * full.layer_score_bytes(),
        )

    def _scales(self, stage: int) -> Tuple[float, float]:
        if self.stage_scales:
            return self.stage_scales[stage]
        return self.token_scale, self.score_scale

    def stage_peak(
        self, stage: int, shapes: Sequence[MicroShape], *, group: Optional[int] = None
    ) -> PeakTerms:
        """The predicted peak of ``stage`` running micro-batches of ``shapes`` (schedule order).

        Replays the stage's schedule (:func:`schedule_events`) and takes the moment its live
        micro-batches hold the most.
        """
        parallel = self.dims.parallel
        k_tok, k_sq = self._scales(stage)
        live: Dict[Tuple[int, int], Tuple[float, float]] = {}
        tok = sq = 0.0
        best = (0.0, 0.0, 0.0)
        events = schedule_events(
            len(shapes),
            parallel.pp_size,
            stage,
            parallel.vpp_size,
            group or parallel.group_size,
        )
        for forward, mb, chunk in events:
            if forward:
                terms = self.chunk_terms(stage, chunk, shapes[mb])
                live[(mb, chunk)] = terms
                tok, sq = tok + terms[0], sq + terms[1]
                value = k_tok * tok + k_sq * sq
                if value > best[0]:
                    best = (value, tok, sq)
            else:
                terms = live.pop((mb, chunk))
                tok, sq = tok - terms[0], sq - terms[1]
        extra_tok, extra_sq = self._recompute_terms(stage, shapes)
        static = self.resting(stage)
        tokens, scores = best[1] + extra_tok, best[2] + extra_sq
        return PeakTerms(
            static=static,
            tokens=tokens,
            scores=scores,
            total=static + k_tok * tokens + k_sq * scores,
        )

    def worst_live(self, stage: int) -> Tuple[int, int, int]:
        """Upper bounds over any micro-batch count: ``(layer-micro-batches, embedding outputs,
        logits)`` stage ``stage`` keeps alive at once (each a micro-batch's worth)."""
        return _worst_live(self.dims, stage)

    def uniform_peak(self, stage: int, shape: MicroShape) -> float:
        """An upper bound on ``stage``'s peak for any number of micro-batches of ``shape``."""
        k_tok, k_sq = self._scales(stage)
        tok, sq = self.uniform_terms(stage, shape)
        return self.resting(stage) + k_tok * tok + k_sq * sq

    def worst_stage(self, shape: MicroShape) -> Tuple[int, float]:
        """``(stage, peak)``: the stage micro-batches of ``shape`` peak highest on, and that
        :meth:`uniform_peak` (what every "the budget is too small for one row" message names)."""
        peaks = [self.uniform_peak(s, shape) for s in self.dims.stages()]
        stage = max(range(len(peaks)), key=peaks.__getitem__)
        return stage, peaks[stage]

    def uniform_terms(self, stage: int, shape: MicroShape) -> Tuple[float, float]:
        """``(tokens, scores)`` bytes, as counted (unscaled), that ``stage`` keeps at most for any
        number of micro-batches of ``shape``."""
        dims = self.dims
        layer_mbs, embeds, logits = self.worst_live(stage)
        rows, length = shape
        cp = dims.parallel.cp_size
        tokens = rows * length / cp
        # The stage's layers in the mix its chunks recompute and keep (every chunk alike but
        # for uneven splits, where this is their average).
        parts = [self._layers_recomputed(stage, c) for c in range(dims.parallel.vpp_size)]
        layers = sum(r + k for r, k in parts) or 1
        per_token, per_score = self._per_layer(
            sum(r for r, _ in parts) / layers, sum(k for _, k in parts) / layers
        )
        tok = layer_mbs * tokens * per_token
        tok += embeds * tokens * dims.hidden_size * dims.dtype_bytes
        tok += logits * tokens * self.logit_token_bytes()
        sq = layer_mbs * rows * (length / cp) * length * per_score
        extra_tok, extra_sq = self._recompute_terms(stage, [shape])
        return tok + extra_tok, sq + extra_sq


@functools.lru_cache(maxsize=256)
def _worst_live(dims: ModelDims, stage: int) -> Tuple[int, int, int]:
    parallel = dims.parallel
    group = parallel.group_size
    # Enough micro-batches for the warm-up to be complete (more only add steady-state pairs).
    count = group * (2 * parallel.pp_size + parallel.vpp_size + 1)
    layers = embeds = logits = 0
    most = [0, 0, 0]
    events = schedule_events(count, parallel.pp_size, stage, parallel.vpp_size, group)
    last_stage = stage == parallel.pp_size - 1
    for forward, _mb, chunk in events:
        sign = 1 if forward else -1
        layers += sign * dims.chunk_layers(stage, chunk)
        embeds += sign * (stage == 0 and chunk == 0)
        logits += sign * (last_stage and chunk == parallel.vpp_size - 1)
        most = [max(most[0], layers), max(most[1], embeds), max(most[2], logits)]
    # ``layers`` counts layer-micro-batches; a micro-batch's worth is the stage's chunk layers.
    return most[0], most[1], most[2]


def step_shapes(
    num_microbatches: int,
    micro_batch_size: int,
    seq_length: int,
    row_lengths: Sequence[Sequence[int]] = (),
    dp_size: int = 1,
) -> List[List[MicroShape]]:
    """Every DP rank's micro-batch shapes in schedule order, from a step plan's fields."""
    if row_lengths:
        return [[(micro_batch_size, s) for s in rows] for rows in row_lengths]
    return [[(micro_batch_size, seq_length)] * num_microbatches for _ in range(dp_size)]


def predicted_step_peaks(
    model: MemoryModel, rank_shapes: Sequence[Sequence[MicroShape]]
) -> List[PeakTerms]:
    """Per pipeline stage, the largest predicted peak over the DP ranks' micro-batches."""
    peaks = []
    for stage in model.dims.stages():
        terms = [model.stage_peak(stage, shapes) for shapes in rank_shapes]
        peaks.append(max(terms, key=lambda t: t.total))
    return peaks


@dataclass(frozen=True, kw_only=True)
class MemoryLimit:
    """A memory budget the planner keeps every stage's predicted peak within."""

    model: MemoryModel
    """How the step's bytes are predicted."""
    budget_bytes: int
    """The most one rank may hold at its peak (``--max-memory-gib`` in bytes)."""
    row_multiple: int = 1
    """Rows are multiples of this (the sample multiple): caps are rounded down to it."""
    counted_caps: Tuple[Tuple[float, float], ...] = ()
    """Per stage, the most ``(token, score)`` activation bytes (as counted, before the fitted
    factors) a shape may keep: a fitted memory model is trusted only so far beyond the steps it was
    fitted to, in either term; ``()``: no such cap."""
    measured: Tuple[MicroShape, ...] = ()
    """Shapes steps of this run ran within the budget on every stage, as measured (the measure
    the budget is stated in: the fixed run an equal-memory comparison takes its budget from ran
    its own ``[MBS x S]`` by it): a shape no larger in rows and length fits whatever the model
    predicts, so a model that over-predicts never refuses what the run has shown to fit."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, MemoryModel):
            raise DynBatchValueError(f"model={self.model!r} must be a MemoryModel.")
        if isinstance(self.budget_bytes, bool) or not isinstance(self.budget_bytes, int):
            raise DynBatchValueError(f"budget_bytes={self.budget_bytes!r} must be an int.")
        if self.budget_bytes <= 0:
            raise DynBatchValueError(f"budget_bytes={self.budget_bytes} must be > 0.")

    def fits(self, shape: MicroShape) -> bool:
        """Whether any number of micro-batches of ``shape`` keeps every stage within budget."""
        rows, length = shape
        if any(rows <= b and length <= s for b, s in self.measured):
            return True
        for stage in self.model.dims.stages():
            if self.model.uniform_peak(stage, shape) > self.budget_bytes:
                return False
            if self.counted_caps:
                tok, sq = self.model.uniform_terms(stage, shape)
                tok_cap, sq_cap = self.counted_caps[stage]
                if tok > tok_cap or sq > sq_cap:
                    return False
        return True

    def row_cap(self, rows: int = 1) -> int:
        """The longest row (a multiple of ``row_multiple``) of ``rows``-row micro-batches that
        fits (:meth:`fits`); 0 when not even one ``row_multiple`` does."""
        return _row_cap(self, rows)

    def least_gib(self, row: int) -> float:
        """The least budget in GiB (to 0.001) under which a micro-batch of one row of ``row``
        tokens (rounded up to ``row_multiple``) fits every stage, as the model predicts it."""
        unit = self.row_multiple
        _, peak = self.model.worst_stage((1, -(-row // unit) * unit))
        return budget_gib(peak)

    def most_rows(self, length: int, limit: int) -> int:
        """The most rows of ``length`` tokens, at most ``limit``, a micro-batch may have (>= 0)."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits((mid, length)):
                lo = mid
            else:
                hi = mid - 1
        return lo


#: Longest row searched for a cap (tokens): beyond any context length in use.
_MAX_ROW = 1 << 26


@functools.lru_cache(maxsize=1024)
def _row_cap(limit: MemoryLimit, rows: int) -> int:
    unit = limit.row_multiple
    lo, hi = 0, _MAX_ROW // unit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if limit.fits((rows, mid * unit)):
            lo = mid
        else:
            hi = mid - 1
    return lo * unit


def fit_activation_scale(
    observations: Sequence[Tuple[float, float, float]],
) -> Tuple[float, float]:
    """Least-squares factor ``k >= 0`` of measured activation peaks, and the error.

    Each observation is ``(tokens, scores, measured)``: a step's predicted activation terms at
    its peak (:class:`PeakTerms`, unscaled) and the measured peak less the memory at rest. Fits
    ``measured ~ k * (tokens + scores)``: one factor on both terms (their ratio as counted; a few
    noisy steps could not tell two factors apart). The error is the largest relative
    misprediction of an observed activation peak by the fit. ``(1.0, 0.0)`` without observations.
    """
    obs = [(t + s, m) for t, s, m in observations if t + s > 0]
    if not obs:
        return 1.0, 0.0
    k = max(0.0, sum(x * m for x, m in obs) / sum(x * x for x, _ in obs))
    error = max(abs(k * x - m) / max(m, 1.0) for x, m in obs)
    return float(k), float(error)


#: :func:`fit_peak_line` needs steps whose counted activations differ by at least this factor
#: (largest over smallest): steps of one shape cannot tell the intercept from the slope.
LINE_MIN_SPREAD = 1.2
#: ... and at least this many steps.
LINE_MIN_STEPS = 3


def fit_peak_line(
    observations: Sequence[Tuple[float, float]],
) -> Optional[Tuple[float, float, float]]:
    """Least-squares line ``peak ~ intercept + k * counted`` through measured peaks:
    ``(intercept, k, error)``, or ``None`` where the steps cannot place a line (fewer than
    :data:`LINE_MIN_STEPS`, counted bytes spread less than :data:`LINE_MIN_SPREAD`, or a slope
    that is not above 0).

    Each observation is ``(counted, peak)``: a step's counted activation bytes at its peak
    (``PeakTerms.tokens + scores``, unscaled) and its measured peak, absolute. Where what a step
    starts with is not a fixed memory at rest (a process's resident set keeps the heap the last
    step freed, and this step's activations reuse it), a line through the absolute peaks predicts
    them where "at rest plus a factor" counts the reused heap twice. ``error`` is the largest
    relative misprediction of an observed peak.
    """
    obs = [(float(x), float(y)) for x, y in observations if x > 0]
    if len(obs) < LINE_MIN_STEPS:
        return None
    xs = [x for x, _ in obs]
    if max(xs) < LINE_MIN_SPREAD * min(xs):
        return None
    mean_x = sum(xs) / len(obs)
    mean_y = sum(y for _, y in obs) / len(obs)
    k = sum((x - mean_x) * (y - mean_y) for x, y in obs) / sum((x - mean_x) ** 2 for x in xs)
    if not k > 0:
        return None
    intercept = mean_y - k * mean_x
    error = max(abs(intercept + k * x - y) / max(y, 1.0) for x, y in obs)
    return float(intercept), float(k), float(error)
