"""Adam-family optimizer state as a gradient history (``report --summary --of grads``).

For a parameter with Adam/AdamW state, ``exp_avg_sq`` is the EMA of its squared
gradient element by element (``v <- b2*v + (1-b2)*g*g``), so its sum V follows the same
recursion with the parameter's squared gradient norm ||g||^2. With ``t`` the
parameter's own step count (from its state: a layer unfrozen late has fewer steps):

- ``S_t = V / (1 - b2**t)`` is the bias-corrected EMA of ||g||^2 (its square root is
  what the ``ema`` values are);
- between two checkpoints ``t1 < t2``, ``(V2 - b2**k * V1) / (1 - b2**k)`` with
  ``k = t2 - t1`` is exactly the weighted mean of ||g_s||^2 over the steps ``s`` in
  ``(t1, t2]`` (weights ``b2**(t2-s)``): the interval values, which pin a spike to
  the interval it happened in. Before the first checkpoint, V1 = 0 and t1 = 0.

``exp_avg_sq`` is float32: each value agrees with the true EMA to about 4e-7
relative. V is summed exactly (then rounded once to float64) and b2 is taken as
torch's float32 kernels use it (``float32(0.95) = 0.949999988``), but an interval
right after a spike subtracts two nearly equal sums: its conditioning number
``(V2 + b2**k V1) / |V2 - b2**k V1|`` times that 4e-7 bounds its relative error, and
an interval whose bound exceeds :data:`TRUST_LIMIT` is flagged (a negative one is
clamped at 0 and flagged).

This module reads optimizer state from readers; it computes nothing the CLI shows as text.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.exact import ExactSum
from ..core.dtypes import is_floating
from ..formats import TensorReader

#: Relative agreement of a float32 ``exp_avg_sq`` sum with the true EMA (measured: about 4e-7).
STATE_ERROR = 4e-7
#: An interval whose error bound (conditioning x STATE_ERROR) exceeds this is flagged.
TRUST_LIMIT = 0.25
_CHUNK = 1 << 22  # elements summed at once


@dataclass
class ParamState:
    """One parameter's Adam state in one checkpoint."""

    key: str                 # the state's key: an index ("3") or a parameter name
    shape: tuple[int, ...]
    step: float              # the parameter's own step count
    sum_sq: float            # V: the exact sum of exp_avg_sq, rounded once to float64
    beta2: float             # as torch's float32 kernels use it
    name: str = ""           # the name shown (the parameter's, or "param N (shape)")


@dataclass
class OptimizerState:
    """The Adam-like state found in one checkpoint, or why there is none."""

    params: list[ParamState] = field(default_factory=list)
    missing: str | None = None     # why no usable state was found (None: found)
    naming: str | None = None      # how integer keys were named, when not all were


def float32_beta(beta: float) -> float:
    """b2 as torch's float32 kernels multiply by it (``exp_avg_sq.mul_(beta2)``)."""
    return float(np.float32(beta))


def exact_sum(reader: TensorReader, name: str) -> float:
    """The sum of a tensor's values, exact until rounded once to float64 (NaN/Inf propagate).

    Values of 32 bits or fewer are split (from their float32 bits) into an integer
    mantissa (below 2**24) and an exponent; the mantissas of each exponent add exactly
    (float64 holds integers to 2**53, and at most 2**22 of them are added per chunk),
    and the per-exponent totals are combined as Python integers. Wider values are added by :class:`ExactSum`.
    """
    size = reader.tensors[name].size
    total, shift = 0, 0  # the sum is total * 2**shift
    wide = ExactSum()
    for start in range(0, size, _CHUNK):
        values = np.asarray(reader.read_flat(name, start, min(size, start + _CHUNK))).reshape(-1)
        if values.dtype.itemsize > 4 or not is_floating(values.dtype):
            for x in values.astype(np.float64).tolist():
                wide.add(x)
            continue
        values = values.astype(np.float32)  # exact for float16/bfloat16/float8
        finite = np.isfinite(values)
        if not finite.all():
            for x in values[~finite].astype(np.float64).tolist():
                wide.add(x)
            values = values[finite]
        if not values.size:
            continue
        # a float32 is (-1)^sign * mantissa * 2^(exponent - 150), mantissa < 2**24 an integer
        bits = values.view(np.uint32)
        exponent = (bits >> np.uint32(23)) & np.uint32(0xFF)
        mantissa = bits & np.uint32(0x7FFFFF)
        mantissa |= (exponent != 0).astype(np.uint32) << np.uint32(23)  # the implicit bit of normal numbers
        signed = mantissa.astype(np.float64)
        negative = bits >= np.uint32(1 << 31)
        if negative.any():
            signed[negative] *= -1
        np.maximum(exponent, np.uint32(1), out=exponent)  # subnormals share the smallest normal's scale
        counts = np.bincount(exponent.astype(np.intp), weights=signed, minlength=256)
        for biased, amount in enumerate(counts.tolist()):
            if amount:
                at = biased - 150
                if at < shift:
                    total <<= shift - at
                    shift = at
                total += int(amount) << (at - shift)
    if wide.special != 0.0 or math.isnan(wide.special):
        return wide.special
    if not wide.partials:
        return _scaled(total, shift)
    # the wide part and the integer part: exact as a fraction, rounded once
    from fractions import Fraction

    return float(sum((Fraction(p) for p in wide.partials), Fraction(total) * Fraction(2) ** shift))


def _scaled(total: int, shift: int) -> float:
    """``total * 2**shift`` correctly rounded (int/int division rounds once)."""
    if shift >= 0:
        return float(total << shift)
    return total / (1 << -shift)


# --------------------------------------------------------------------------- finding the state

_STATE = re.compile(r"^(?P<prefix>(?:.*\.)?)state\.(?P<key>.+)\.(?P<field>exp_avg_sq|step)$")


def optimizer_prefixes(reader: TensorReader) -> list[str]:
    """Where Adam-like state sits in a file: the prefixes P of ``P state.<key>.exp_avg_sq``."""
    found: dict[str, None] = {}
    for name in reader.tensors:
        match = _STATE.match(name)
        if match and match["field"] == "exp_avg_sq":
            found.setdefault(match["prefix"], None)
    return list(found)


def group_settings(reader: TensorReader, prefix: str) -> list[dict[str, Any]]:
    """``param_groups`` as plain data: per group its ``betas`` and ``params`` (may be absent)."""
    groups: dict[int, dict[str, Any]] = {}
    pattern = re.compile(re.escape(prefix) + r"param_groups\.(\d+)\.(betas|params|beta2)$")
    names = [o.name for o in reader.others] + list(reader.tensors)
    for name in names:
        match = pattern.match(name)
        if match:
            groups.setdefault(int(match[1]), {})[match[2]] = reader.plain_data(name)
    return [groups[i] for i in sorted(groups)]


def flat_betas(reader: TensorReader, prefix: str) -> dict[str, float]:
    """beta2 per parameter name from a flattened state (``param_groups.<name>.betas``, as
    ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` and DCP write it)."""
    pattern = re.compile(re.escape(prefix) + r"param_groups\.(.+)\.betas$")
    out = {}
    for other in reader.others:
        match = pattern.match(other.name)
        if match and not match[1].isdigit():
            betas = reader.plain_data(other.name)
            if isinstance(betas, list | tuple) and len(betas) == 2 and isinstance(betas[1], float | int):
                out[match[1]] = float(betas[1])
    return out


def read_state(reader: TensorReader, prefix: str) -> OptimizerState:
    """The Adam-like state under ``prefix``: per parameter, V, its own step and b2."""
    groups = group_settings(reader, prefix)
    beta_of: dict[str, float] = flat_betas(reader, prefix)
    order: list[str] = []
    for group in groups:
        betas = group.get("betas")
        beta2 = betas[1] if isinstance(betas, list | tuple) and len(betas) == 2 else group.get("beta2")
        params = group.get("params")
        if not isinstance(params, list | tuple):
            continue
        for key in params:
            order.append(str(key))
            if isinstance(beta2, float | int) and not isinstance(beta2, bool):
                beta_of[str(key)] = float(beta2)
    if not groups and not beta_of:
        return OptimizerState(missing="its optimizer state has no param_groups (no beta2 to read)")
    out = OptimizerState()
    keys = {}
    for name in reader.tensors:
        match = _STATE.match(name)
        if match and match["prefix"] == prefix and match["field"] == "exp_avg_sq":
            keys[match["key"]] = name
    ordered = [k for k in order if k in keys] + [k for k in keys if k not in set(order)]
    for key in ordered:
        beta2 = beta_of.get(key)
        step = _step_of(reader, f"{prefix}state.{key}.step")
        if beta2 is None or step is None:
            what = "beta2" if beta2 is None else "step count"
            return OptimizerState(missing=f"the state of parameter {key} has no {what}")
        name = keys[key]
        shape = tuple(reader.tensors[name].shape)
        out.params.append(ParamState(key, shape, step, exact_sum(reader, name), float32_beta(beta2)))
    return out


def _step_of(reader: TensorReader, name: str) -> float | None:
    if name in reader.tensors:
        info = reader.tensors[name]
        if info.size != 1:
            return None
        return float(np.asarray(reader.read_flat(name, 0, 1)).reshape(-1)[0])
    value = reader.plain_data(name)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def not_adam(reader: TensorReader) -> str | None:
    """Why a file with optimizer state but no ``exp_avg_sq`` gives no history (SGD, Adafactor...)."""
    for name in reader.tensors:
        if re.search(r"(^|\.)state\.[^.]+\.(momentum_buffer|exp_avg_sq_row|exp_avg_sq_col|exp_avg)$", name):
            return "its optimizer state holds no exp_avg_sq: not an Adam-like optimizer"
    if any(info.optimizer_state for info in reader.tensors.values()):
        # Keras keeps numbered variables and no beta2 (that is in the model's config, not the weights file)
        return "its optimizer variables (Keras) name no parameter and hold no beta2: not read for gradients yet"
    return None


# --------------------------------------------------------------------------- naming integer keys

def name_params(state: OptimizerState, model: list[tuple[str, tuple[int, ...]]], ordered: bool,
                groups: list[list[str]]) -> None:
    """Give integer-keyed parameters the names of the checkpoint's model tensors.

    ``model``: the model's floating tensors (name, shape); ``ordered``: whether their order
    is the module order (a pickled state dict keeps it; safetensors sorts its names).
    ``groups``: the state keys of each param group, in the optimizer's order.

    In module order, each group's parameters are a subsequence of the model's, and the
    groups together are all of them: when exactly one interleaving of the groups matches
    the shapes, it names every parameter. Otherwise only a parameter whose shape no
    other model tensor has is named; the rest are ``param N (shape)``.
    """
    by_key = {p.key: p for p in state.params}
    for p in state.params:
        p.name = p.key if not p.key.isdigit() else f"param {p.key} ({'x'.join(map(str, p.shape)) or 'scalar'})"
    if not any(p.key.isdigit() for p in state.params) or not model:
        return
    if ordered:
        shapes = [[by_key[k].shape if k in by_key else None for k in g] for g in groups]
        match = _unique_interleaving([s for _, s in model], shapes)
        if match is not None:
            for gi, g in enumerate(groups):
                for key, position in zip(g, match[gi]):
                    if key in by_key:
                        by_key[key].name = model[position][0]
            return
    count: dict[tuple[int, ...], int] = {}
    for _, shape in model:
        count[shape] = count.get(shape, 0) + 1
    state_count: dict[tuple[int, ...], int] = {}
    for p in state.params:
        state_count[p.shape] = state_count.get(p.shape, 0) + 1
    named = 0
    for p in state.params:
        if p.key.isdigit() and count.get(p.shape) == 1 and state_count[p.shape] == 1:
            p.name = next(n for n, s in model if s == p.shape)
            named += 1
    how = "in module order" if ordered else "sorted by name (not in module order)"
    state.naming = (f"the optimizer numbers its parameters and the model's names are {how}: "
                    f"{named} of {len(state.params)} named by a shape no other tensor has")


_MAX_STATES = 2_000_000


def _unique_interleaving(model: list[tuple[int, ...]],
                         groups: list[list[tuple[int, ...] | None]]) -> list[list[int]] | None:
    """The one way to deal the model's shapes out to the groups in order, or None (none or several).

    A shape of None (a parameter without state) matches any shape. States are the groups'
    positions; each model tensor moves one group a step. Iterative: a model has thousands
    of tensors."""
    if sum(len(g) for g in groups) != len(model) or not groups:
        return None
    sizes = [len(g) for g in groups]

    def moves(positions: tuple[int, ...]) -> list[tuple[int, tuple[int, ...]]]:
        at = sum(positions)
        out = []
        for gi, pos in enumerate(positions):
            if pos < sizes[gi] and groups[gi][pos] in (None, model[at]):
                out.append((gi, positions[:gi] + (pos + 1,) + positions[gi + 1:]))
        return out

    levels: list[set[tuple[int, ...]]] = [{tuple(0 for _ in groups)}]
    count = 1
    for _ in range(len(model)):
        following = {state for positions in levels[-1] for _, state in moves(positions)}
        count += len(following)
        if not following or count > _MAX_STATES:
            return None
        levels.append(following)
    # the ways to the end from each state, capped at 2 (several is as bad as many)
    to_end: list[dict[tuple[int, ...], int]] = [{} for _ in levels]
    to_end[-1] = {positions: 1 for positions in levels[-1]}
    for i in range(len(levels) - 2, -1, -1):
        to_end[i] = {positions: min(2, sum(to_end[i + 1].get(state, 0) for _, state in moves(positions)))
                     for positions in levels[i]}
    start = tuple(0 for _ in groups)
    if to_end[0].get(start) != 1:
        return None
    dealt: list[list[int]] = [[] for _ in groups]
    positions = start
    for at in range(len(model)):
        gi, positions = next((g, state) for g, state in moves(positions) if to_end[at + 1].get(state, 0))
        dealt[gi].append(at)
    return dealt


# --------------------------------------------------------------------------- the formulas

@dataclass
class Interval:
    """The interval gradient norm of one parameter between two checkpoints."""

    first_step: float
    last_step: float
    mean_sq: float | None        # weighted mean of ||g||^2 over (first, last]; None: no steps
    conditioning: float          # (V2 + b^k V1) / |V2 - b^k V1|
    trusted: bool
    clamped: bool                # a negative mean_sq (rounding) set to 0

    @property
    def norm(self) -> float | None:
        return None if self.mean_sq is None else math.sqrt(self.mean_sq) if self.mean_sq >= 0 else math.nan


def ema_sq(p: ParamState) -> float:
    """S_t = V / (1 - b2**t): the bias-corrected EMA of ||g||^2 (NaN when t is 0)."""
    if p.step <= 0:
        return math.nan
    return p.sum_sq / -math.expm1(p.step * math.log(p.beta2))


def interval(before: ParamState | None, after: ParamState) -> Interval:
    """The weighted mean of ||g||^2 over the steps between two checkpoints (see the module's docstring)."""
    t1, v1 = (before.step, before.sum_sq) if before is not None else (0.0, 0.0)
    t2, v2 = after.step, after.sum_sq
    k = t2 - t1
    if k <= 0 or not (math.isfinite(v1) and math.isfinite(v2)):
        # no step between them (None), or NaN/Inf in the state: Inf only when V2 alone overflowed
        mean = None if k <= 0 else (math.inf if v2 == math.inf and math.isfinite(v1) else math.nan)
        return Interval(t1, t2, mean, math.nan, k > 0, False)
    decay = math.exp(k * math.log(after.beta2))
    top = v2 - decay * v1
    mean = top / -math.expm1(k * math.log(after.beta2))
    conditioning = (v2 + decay * v1) / abs(top) if top else math.inf
    if v2 + decay * v1 == 0:
        conditioning = 1.0
    trusted = conditioning * STATE_ERROR <= TRUST_LIMIT
    clamped = mean < 0
    if clamped:
        mean, trusted = 0.0, False
    return Interval(t1, t2, mean, conditioning, trusted, clamped)
