"""Choosing the next token from the logits: greedy, or sampled with temperature, top-k, min-p, top-p.

    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    sampler = Sampler(params)
    token = sampler.sample(logits)           # logits: fp32 [vocab]

Greedy (temperature 0, or top_k 1): the argmax, the lowest index on ties; no random number is
drawn. Otherwise, in float64, in this order:
  1. z = logits / temperature (a temperature so small that z overflows acts as greedy)
  2. p = softmax(z): exp(z - max z), divided by its sum
  3. the tokens sorted by p descending, ties by index ascending (a stable sort)
  4. top-k (k > 0): keep the first k
  5. min-p (> 0): keep those with p >= min_p * p_max (a prefix of the sorted order)
  6. top-p (< 1): renormalise the kept p to q; keep the shortest prefix whose cumulative q
     reaches top_p (at least one token)
  7. renormalise the kept p (their sum) to r
  8. draw one uniform u in [0, 1) from the sampler's own np.random.Generator(PCG64(seed))
  9. the first kept token (sorted order) whose cumulative r exceeds u (the last one if rounding
     leaves the sum below u)
One uniform per sampled token, so the same seed and settings give the same tokens.

With a constraint (engine.text.constraint: a response format), each pick is among the ids it
allows only, as if every other logit were -inf: the allowed ids' logits, in id order, go through
the same steps (greedy included), and the constraint is told the token picked.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import numpy as np

from ds4f.errors import Ds4fError


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_num(v) -> bool:
    return (_is_int(v) or isinstance(v, (float, np.floating))) and math.isfinite(float(v))


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0   # >= 0; 0: greedy
    top_k: int = 0             # >= 0; 0: no limit, 1: greedy
    top_p: float = 1.0         # in (0, 1]; 1: no limit
    min_p: float = 0.0         # in [0, 1); 0: no limit
    seed: int = 0              # >= 0

    def __post_init__(self) -> None:
        t, k, p, m, s = self.temperature, self.top_k, self.top_p, self.min_p, self.seed
        if not _is_num(t) or t < 0:
            raise Ds4fError(f"temperature: {t!r} must be a finite number >= 0", param="temperature")
        if not _is_int(k) or k < 0:
            raise Ds4fError(f"top_k: {k!r} must be an integer >= 0 (0: no limit)", param="top_k")
        if not _is_num(p) or not 0 < p <= 1:
            raise Ds4fError(f"top_p: {p!r} must be in (0, 1] (1: no limit)", param="top_p")
        if not _is_num(m) or not 0 <= m < 1:
            raise Ds4fError(f"min_p: {m!r} must be in [0, 1) (0: no limit)", param="min_p")
        if not _is_int(s) or s < 0:
            raise Ds4fError(f"seed: {s!r} must be an integer >= 0", param="seed")
        for name, conv in (("temperature", float), ("top_k", int), ("top_p", float), ("min_p", float),
                           ("seed", int)):
            object.__setattr__(self, name, conv(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        if not isinstance(d, dict):
            raise Ds4fError("sampling: a mapping of sampling settings expected", param="sampling")
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise Ds4fError(f"sampling: unknown setting {key!r} (known: {', '.join(sorted(known))})",
                                param=str(key))
        return cls(**d)


class Sampler:
    """Samples token ids with `params` (see the module docstring); keeps its own random stream."""

    def __init__(self, params: SamplingParams | None = None, constraint=None) -> None:
        self.params = params if params is not None else SamplingParams()
        self.rng = np.random.Generator(np.random.PCG64(self.params.seed))
        self.draws = 0   # uniforms drawn so far (one per sampled, non-greedy token)
        self.constraint = constraint   # None, or what the picks must follow (allowed(), advance(token))

    @property
    def plain_greedy(self) -> bool:
        """Every pick is the logits' argmax (greedy, no constraint)."""
        return self.params.greedy and self.constraint is None

    def sample(self, logits: np.ndarray) -> int:
        c = self.constraint
        if c is None:
            return self._pick(logits)
        ids = c.allowed()
        token = int(ids[self._pick(np.asarray(logits)[ids])])
        c.advance(token)
        return token

    def _pick(self, logits: np.ndarray) -> int:
        kept = self.distribution(logits)
        if isinstance(kept, int):
            return kept
        order, r = kept
        return int(order[self._draw(r)])

    def distribution(self, logits: np.ndarray) -> int | tuple[np.ndarray, np.ndarray]:
        """The tokens this sampler may pick and their probabilities (order, r), most likely first;
        a token id where the pick is certain (greedy, or a temperature that overflows)."""
        x = np.asarray(logits)
        if x.ndim != 1 or x.size == 0:
            raise Ds4fError(f"sampling: logits must be one non-empty vector, got shape {x.shape}", kind="internal")
        x = x.astype(np.float64)
        if np.isnan(x).any() or np.isposinf(x).any() or np.isneginf(x).all():
            raise Ds4fError("sampling: the logits are not finite (NaN, +inf, or all -inf)", kind="data")
        prm = self.params
        if prm.greedy:
            return int(np.argmax(x))
        z = x / prm.temperature
        if np.isposinf(z).any():   # a temperature so small that z overflows: greedy
            return int(np.argmax(x))
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        ps = p[order]
        n = len(ps)
        if prm.top_k > 0:
            n = min(n, prm.top_k)
        if prm.min_p > 0:
            n = min(n, int(np.count_nonzero(ps[:n] >= prm.min_p * ps[0])))
        if prm.top_p < 1:
            q = ps[:n] / ps[:n].sum()
            n = min(n, int(np.searchsorted(np.cumsum(q), prm.top_p, side="left")) + 1)
        return order[:n], ps[:n] / ps[:n].sum()

    def _draw(self, r: np.ndarray) -> int:
        """An index drawn from probabilities r (one uniform)."""
        u = self.rng.random()
        self.draws += 1
        return min(int(np.searchsorted(np.cumsum(r), u, side="right")), len(r) - 1)

    def state(self) -> dict:
        """The random stream's position: the params, the uniforms drawn, the generator's state."""
        state = {"params": self.params.to_dict(), "draws": self.draws, "rng": self.rng.bit_generator.state}
        if self.constraint is not None:
            state["constraint"] = self.constraint.state()
        return state
