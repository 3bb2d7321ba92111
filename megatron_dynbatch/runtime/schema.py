"""The declared per-sample data a micro-batch carries, and validation of samples against it.

Every sample is a mapping of tensors. Two entries are built in:

* ``tokens``: int64 ``[L]``, ``L >= 1``.
* ``loss_mask`` (optional): ``[L]`` of 0/1 values (bool, integer or floating dtype) marking the
  tokens that are loss *targets*. When absent it is all ones, or zeros on the first
  ``prompt_length`` tokens when the sample has a ``prompt_length`` entry (an int or a 0-d integer
  tensor). Giving both is ambiguous and rejected.

Everything else a sample carries (advantages, old log-probs, rewards, ...) must be declared as a
:class:`FieldSpec` in the :class:`BatchSchema`: ``token`` fields are ``[L, *trailing_shape]`` and
are laid out token by token; ``sample`` fields are ``[*trailing_shape]`` and are broadcast over the
sample's tokens. The schema, not the first sample seen, fixes every dtype and trailing shape, so a
rank whose micro-batches are all placeholders still builds tensors identical in shape and dtype to
the other ranks' (see ``materialize.py``).

Floating fields must be finite wherever they reach the loss. A token loss such as ``ce * advantage``
multiplies before the loss mask selects, so a NaN advantage on a masked token gives a finite loss
but a NaN gradient (backward computes ``0 * NaN`` for d(loss)/d(ce)). So a NaN or Inf on a
loss-bearing token is an error naming the sample and field, and one on a loss-free token (a prompt,
a fully masked sample) is replaced by the field's ``pad_value``, which must itself be finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning.spec import as_int

__all__ = [
    "FIELD_KINDS",
    "RESERVED_KEYS",
    "SAMPLE_INPUT_KEYS",
    "FieldSpec",
    "BatchSchema",
    "CheckedSample",
]

#: ``token``: one value per token ``[L, *trailing]``; ``sample``: one value per sample
#: ``[*trailing]``.
FIELD_KINDS = ("token", "sample")

#: Keys the materializer produces itself; a schema field may not reuse them.
RESERVED_KEYS = (
    "tokens",
    "labels",
    "loss_mask",
    "position_ids",
    "segment_ids",
    "sample_index",
    "cu_seqlens",
    "prompt_length",
)

#: Built-in keys a sample may carry besides its declared fields.
SAMPLE_INPUT_KEYS = ("tokens", "loss_mask", "prompt_length")

# Loss-mask dtypes we accept from users; values must still be exactly 0 or 1.
_MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _pad_value_fits(value: Any, dtype: torch.dtype) -> bool:
    """Whether ``value`` is stored exactly by ``dtype`` (so padding is what the user asked for)."""
    if isinstance(value, bool):
        return True
    if dtype == torch.bool:
        return value in (0, 1)
    if not isinstance(value, (int, float)):
        return False
    if not dtype.is_floating_point and not dtype.is_complex and not float(value).is_integer():
        return False
    try:
        stored = torch.tensor(value, dtype=dtype).item()
    except (OverflowError, RuntimeError):
        return False
    return stored == value


@dataclass(frozen=True, kw_only=True)
class FieldSpec:
    """One declared per-sample field of the micro-batch dict."""

    name: str
    """Key in each sample and in each micro-batch dict."""
    kind: str
    """``token`` (``[L, *trailing_shape]`` per sample) or ``sample`` (``[*trailing_shape]``)."""
    dtype: torch.dtype
    """Exact dtype every sample must use; the micro-batch tensor has the same dtype."""
    pad_value: Any = 0
    """Value on padding tokens and placeholder rows (must be exactly representable in ``dtype``)."""
    trailing_shape: Tuple[int, ...] = ()
    """Per-token (``token``) or per-sample (``sample``) shape after the token axis; ``()`` means a
    scalar."""
    shift_to_labels: bool = False
    """``token`` fields only: lay the field out aligned with ``labels`` instead of ``tokens``.

    Position ``j`` of the row then holds the sample's value at ``j + 1`` and the sample's last token
    gets ``pad_value``, exactly like ``loss_mask``. Use it for per-target data (old log-probs of the
    generated tokens, per-token advantages) given in token order.
    """

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise DynBatchValueError(f"FieldSpec name={self.name!r} must be a non-empty string.")
        if self.name in RESERVED_KEYS:
            raise DynBatchValueError(
                f"FieldSpec name={self.name!r} is a key the runtime produces itself "
                f"{RESERVED_KEYS}; rename the field."
            )
        if self.kind not in FIELD_KINDS:
            raise DynBatchValueError(
                f"FieldSpec {self.name!r}: kind={self.kind!r} is not one of {FIELD_KINDS}; use "
                "'token' for [L, ...] data and 'sample' for one value per sample."
            )
        if not isinstance(self.dtype, torch.dtype):
            raise DynBatchValueError(
                f"FieldSpec {self.name!r}: dtype={self.dtype!r} must be a torch.dtype such as "
                "torch.float32."
            )
        try:
            shape = tuple(self.trailing_shape)
        except TypeError:
            shape = None
        if shape is None or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape
        ):
            raise DynBatchValueError(
                f"FieldSpec {self.name!r}: trailing_shape={self.trailing_shape!r} must be a tuple "
                "of integers >= 1 (use () for one scalar per token or per sample)."
            )
        # Normalise a list to a tuple so the spec stays hashable and comparable.
        object.__setattr__(self, "trailing_shape", shape)
        if isinstance(self.pad_value, float) and not math.isfinite(self.pad_value):
            raise DynBatchValueError(
                f"FieldSpec {self.name!r}: pad_value={self.pad_value!r} is not finite; padding and "
                "placeholder rows pass through the token loss (ce * field) before the mask "
                "selects, so a non-finite pad makes every gradient NaN. Use a finite pad such as "
                "0.0."
            )
        if not _pad_value_fits(self.pad_value, self.dtype):
            raise DynBatchValueError(
                f"FieldSpec {self.name!r}: pad_value={self.pad_value!r} is not exactly "
                f"representable in dtype={self.dtype}; pick a pad value of that dtype."
            )
        if not isinstance(self.shift_to_labels, bool):
            raise DynBatchValueError(
                f"FieldSpec {self.name!r}: shift_to_labels={self.shift_to_labels!r} must be a bool."
            )
        if self.shift_to_labels and self.kind != "token":
            raise DynBatchValueError(
                f"FieldSpec {self.name!r}: shift_to_labels=True needs kind='token' (a per-sample "
                "value has no token order to shift); drop shift_to_labels."
            )

    def sample_shape(self, length: int) -> Tuple[int, ...]:
        """The shape this field must have in a sample of ``length`` tokens."""
        if self.kind == "token":
            return (length, *self.trailing_shape)
        return self.trailing_shape

    def loss_bearing(self, loss_mask: torch.Tensor) -> torch.Tensor:
        """Which of this field's values reach a loss-bearing position of the micro-batch.

        Args:
            loss_mask: The sample's ``[L]`` 0/1 mask in token order (token ``t`` is a target).

        Returns:
            bool ``[L]`` for a token field (entry ``t`` of the sample's value), 0-d for a sample
            field. Row position ``j`` of a sample predicts its token ``j + 1`` and bears loss when
            ``loss_mask[j + 1]`` is 1; it holds value ``j`` of an unshifted field and value
            ``j + 1`` of a ``shift_to_labels`` one, so value ``t`` bears loss when
            ``loss_mask[t + 1]`` (unshifted) or ``loss_mask[t]`` with ``t >= 1`` (shifted) is 1.
        """
        targets = loss_mask[1:] > 0
        if self.kind == "sample":
            return targets.any()
        bearing = torch.zeros(loss_mask.shape[0], dtype=torch.bool, device=loss_mask.device)
        if self.shift_to_labels:
            bearing[1:] = targets
        else:
            bearing[:-1] = targets
        return bearing


@dataclass(frozen=True)
class CheckedSample:
    """A sample that passed :meth:`BatchSchema.check_sample`, with its loss mask resolved."""

    index: int
    """Global sample index."""
    tokens: torch.Tensor
    """int64 ``[L]``."""
    loss_mask: torch.Tensor
    """float32 ``[L]`` of 0/1, in token order (not yet shifted to labels)."""
    fields: Dict[str, torch.Tensor]
    """Declared fields as the sample gave them, except non-finite values on loss-free tokens,
    which are replaced by the field's ``pad_value`` (see :meth:`BatchSchema.check_sample`)."""

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True, kw_only=True)
class BatchSchema:
    """All declared fields of a step's micro-batches, plus the token used for padding."""

    fields: Tuple[FieldSpec, ...] = ()
    """Declared fields besides the built-in ``tokens`` / ``loss_mask``."""
    pad_token_id: int = 0
    """Token id on padding and placeholder rows (never a loss target, so any valid id works)."""

    def __post_init__(self) -> None:
        try:
            fields = tuple(self.fields)
        except TypeError:
            fields = None
        if fields is None or not all(isinstance(f, FieldSpec) for f in fields):
            raise DynBatchValueError(
                f"BatchSchema fields={self.fields!r} must be a sequence of FieldSpec."
            )
        object.__setattr__(self, "fields", fields)
        names = [f.name for f in fields]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise DynBatchValueError(
                f"BatchSchema declares the field(s) {duplicates} more than once."
            )
        pad = as_int(self.pad_token_id)  # numpy / torch integers too
        if pad is None:
            raise DynBatchValueError(
                f"pad_token_id={self.pad_token_id!r} must be an integer token id."
            )
        object.__setattr__(self, "pad_token_id", pad)
        if self.pad_token_id < 0:
            raise DynBatchValueError(
                f"pad_token_id={self.pad_token_id} must be >= 0 (an embedding row)."
            )

    def field(self, name: str) -> Optional[FieldSpec]:
        """The declared field called ``name``, or ``None``."""
        for spec in self.fields:
            if spec.name == name:
                return spec
        return None

    def check_sample(self, index: int, sample: Mapping[str, Any]) -> CheckedSample:
        """Validate one sample against the schema and resolve its loss mask.

        Args:
            index: The sample's global index (only used in error messages and the result).
            sample: Mapping of key to tensor (``prompt_length`` may be an int).

        Returns:
            The validated sample with a float32 0/1 loss mask of length ``L``; a floating field's
            NaN/Inf values on tokens that bear no loss are replaced by its ``pad_value``, so they
            cannot reach a gradient.

        Raises:
            ValueError: Naming the sample index, key, and the expected and actual shape/dtype, or
                a floating field that is not finite on a loss-bearing token.
        """
        if not isinstance(sample, Mapping):
            raise DynBatchValueError(
                f"sample {index}: expected a mapping of key -> tensor, got {type(sample)}."
            )
        declared = {f.name for f in self.fields}
        # The token ids first (a probe: a sample of "input_ids" was told to declare a FieldSpec
        # for it, then refused for the missing "tokens").
        if "tokens" not in sample:
            raise DynBatchValueError(
                f"sample {index}: no 'tokens' key (keys: {sorted(map(str, sample))}); pass the "
                "token ids as sample['tokens'], a 1-D int64 tensor (rename input_ids to tokens)."
            )
        unknown = sorted(set(sample) - declared - set(SAMPLE_INPUT_KEYS), key=str)
        if unknown:
            # A FieldSpec declares a tensor; other values (metadata) can only be dropped.
            tensors = [k for k in unknown if isinstance(sample[k], torch.Tensor)]
            others = [k for k in unknown if k not in tensors]
            fix = []
            if tensors:
                fix.append(f"add a FieldSpec for {tensors} or drop them")
            if others:
                fix.append(
                    f"drop {others} (not tensors: keep such metadata beside the samples, by "
                    "sample index)"
                )
            raise DynBatchValueError(
                f"sample {index}: keys {unknown} are not declared in the schema (declared: "
                f"{sorted(declared)}); {'; '.join(fix)}."
            )
        tokens = self._check_tokens(index, sample)
        length = int(tokens.shape[0])
        loss_mask = self._resolve_loss_mask(index, sample, length)
        fields: Dict[str, torch.Tensor] = {}
        for spec in self.fields:
            if spec.name not in sample:
                raise DynBatchValueError(
                    f"sample {index}: missing key {spec.name!r} declared by the schema as a "
                    f"{spec.kind} field of shape {spec.sample_shape(length)} and dtype "
                    f"{spec.dtype}."
                )
            value = sample[spec.name]
            expected = spec.sample_shape(length)
            if not isinstance(value, torch.Tensor):
                raise DynBatchValueError(
                    f"sample {index}: key {spec.name!r} must be a tensor of shape {expected}, got "
                    f"{type(value).__name__}."
                )
            if tuple(value.shape) != expected:
                raise DynBatchValueError(
                    f"sample {index}: key {spec.name!r} has shape {tuple(value.shape)}, expected "
                    f"{expected} (a {spec.kind} field; the sample has L={length} tokens)."
                )
            if value.dtype != spec.dtype:
                raise DynBatchValueError(
                    f"sample {index}: key {spec.name!r} has dtype {value.dtype}, the schema "
                    f"declares {spec.dtype}; convert it with .to({spec.dtype})."
                )
            fields[spec.name] = _finite_where_it_counts(index, spec, value, loss_mask)
        return CheckedSample(index=index, tokens=tokens, loss_mask=loss_mask, fields=fields)

    @staticmethod
    def _check_tokens(index: int, sample: Mapping[str, Any]) -> torch.Tensor:
        tokens = sample["tokens"]  # present: check_sample refused a sample without it
        if not isinstance(tokens, torch.Tensor):
            raise DynBatchValueError(
                f"sample {index}: 'tokens' must be an int64 tensor [L], got {type(tokens)}."
            )
        if tokens.dim() != 1:
            raise DynBatchValueError(
                f"sample {index}: 'tokens' has shape {tuple(tokens.shape)}, expected one axis [L]."
            )
        if tokens.dtype != torch.int64:
            raise DynBatchValueError(
                f"sample {index}: 'tokens' has dtype {tokens.dtype}, expected torch.int64; convert "
                "it with .long()."
            )
        if tokens.shape[0] == 0:
            # An empty sample would become an empty segment, the crash class this package exists to
            # prevent; the planner never schedules one, so it is a data error.
            raise DynBatchValueError(
                f"sample {index}: 'tokens' is empty; every sample needs >= 1 token."
            )
        if int(tokens.min()) < 0:
            # Else an IndexError in the embedding, steps later and without the sample's name.
            raise DynBatchValueError(
                f"sample {index}: token id {int(tokens.min())} is negative; token ids must be >= 0 "
                "(mask padding with loss_mask or prompt_length, not with -1 / -100 ids)."
            )
        return tokens

    @staticmethod
    def _resolve_loss_mask(index: int, sample: Mapping[str, Any], length: int) -> torch.Tensor:
        has_mask = "loss_mask" in sample
        has_prompt = "prompt_length" in sample
        if has_mask and has_prompt:
            raise DynBatchValueError(
                f"sample {index}: both 'loss_mask' and 'prompt_length' are given; pass only one (a "
                "prompt length is turned into a loss mask of zeros on the prompt)."
            )
        if has_mask:
            mask = sample["loss_mask"]
            if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (length,):
                shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
                raise DynBatchValueError(
                    f"sample {index}: 'loss_mask' has shape {shape}, expected ({length},) like "
                    "'tokens'."
                )
            if not (mask.dtype in _MASK_DTYPES or mask.dtype.is_floating_point):
                raise DynBatchValueError(
                    f"sample {index}: 'loss_mask' has dtype {mask.dtype}; use bool, an integer or "
                    "a floating dtype holding 0/1."
                )
            mask = mask.to(torch.float32)
            # Token-count denominators are integers, so fractional weights would silently break the
            # exact normalisation in loss.py; reject them here.
            if bool(((mask != 0) & (mask != 1)).any()):
                raise DynBatchValueError(
                    f"sample {index}: 'loss_mask' holds values other than 0 and 1; per-token "
                    "weights belong in a declared token field, not in the mask."
                )
            return mask
        mask = torch.ones(length, dtype=torch.float32)
        if has_prompt:
            given = sample["prompt_length"]
            prompt = as_int(given)  # Python, numpy or 0-d torch integers
            if prompt is None or not 0 <= prompt <= length:
                prompt = given
                raise DynBatchValueError(
                    f"sample {index}: prompt_length={prompt!r} must be an integer in [0, "
                    f"L={length}]."
                )
            mask[: int(prompt)] = 0.0
        return mask


def _finite_where_it_counts(
    index: int, spec: FieldSpec, value: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """``value`` with non-finite entries on loss-free tokens set to the pad value.

    Raises:
        ValueError: If a non-finite entry reaches a loss-bearing position.
    """
    if not (spec.dtype.is_floating_point or spec.dtype.is_complex):
        return value
    finite = torch.isfinite(value)
    if bool(finite.all()):
        return value  # the common case: no copy
    bearing = spec.loss_bearing(loss_mask).to(finite.device)
    if spec.kind == "token":
        bad = ~finite.reshape(finite.shape[0], -1).all(dim=1)
        hit = (bad & bearing).nonzero().flatten().tolist()
        if hit:
            raise DynBatchValueError(
                f"sample {index}: field {spec.name!r} is NaN or Inf on {len(hit)} loss-bearing "
                f"token(s) (first: token {hit[0]}, value {value[hit[0]].tolist()}); it would make "
                "the loss and every gradient NaN. Fix the data, or mask those tokens out "
                "(loss_mask / prompt_length) if they must not count."
            )
    elif bool(bearing):
        raise DynBatchValueError(
            f"sample {index}: field {spec.name!r} = {value.tolist()} is NaN or Inf and the sample "
            f"has {int((loss_mask[1:] > 0).sum())} loss-bearing token(s); it would make the loss "
            "and every gradient NaN. Fix the data, or mask the whole sample out if it must not "
            "count."
        )
    return torch.where(finite, value, torch.full_like(value, spec.pad_value))
