"""Undoing the last rows of a pass through a KV cache, exactly.

A speculative step verifies a token and its drafts as rows at positions pos0 .. pos0 + n - 1 in
one pass (model.forward), which advances every layer's cache through all of them; the drafts that
are rejected must then leave no trace. Before the pass, KVJournal keeps what those rows can
overwrite, per layer:

    the window ring's slots (pos0 + i) % window, and the cache's token count;
    each compressor's (and indexer's) open-window slots (pos0 + i) % ratio, its previous
    window's halves and the compressed row at n_rows, and n_rows.

With n <= window and n <= ratio the rows' slots are distinct and at most one compressor window
closes among them, so `rollback(keep)` puts back exactly the state the first `keep` rows left:
the later rows' slots restored, and a window those later rows closed reopened (its row count,
appended row and the previous halves as they were). The cache is then byte for byte the one a
pass of the first `keep` rows alone would have left; nothing of the kept rows is recomputed.
"""
from __future__ import annotations

import numpy as np

from ds4f.engine.model.attention import CompressorState, LayerCache


def journal_limit(caches: list[LayerCache]) -> int:
    """The most rows a journal over these caches can undo: the smallest window or ratio."""
    n = min(c.window.shape[0] for c in caches)
    for c in caches:
        for s in (c.compressor, c.indexer):
            if s is not None:
                n = min(n, s.ratio)
    return n


class _CompressorMark:
    def __init__(self, s: CompressorState, slots: np.ndarray, closes: bool) -> None:
        self.kv, self.gate = s.kv[slots].copy(), s.gate[slots].copy()
        self.n_rows = s.n_rows
        self.closes = closes
        if closes:
            self.prev_kv, self.prev_gate = s.prev_kv.copy(), s.prev_gate.copy()
            self.row = s.rows[s.n_rows].copy() if s.n_rows < len(s.rows) else None


class KVJournal:
    """What a pass of n rows from pos0 may overwrite in `caches`, kept to undo its later rows."""

    def __init__(self, caches: list[LayerCache], pos0: int, n: int) -> None:
        if n > journal_limit(caches):
            raise ValueError(f"a journal of {n} rows; these caches allow {journal_limit(caches)}")
        self.caches, self.pos0, self.n = caches, pos0, n
        self.positions = np.arange(pos0, pos0 + n)
        self.marks = []
        for c in caches:
            w = c.window.shape[0]
            comp = []
            for s in (c.compressor, c.indexer):
                if s is None:
                    comp.append(None)
                    continue
                comp.append(_CompressorMark(s, self.positions % s.ratio,
                                            bool(np.any(self.positions % s.ratio == s.ratio - 1))))
            self.marks.append((c.window[self.positions % w].copy(), c.tokens, comp))

    def rollback(self, keep: int) -> None:
        """Undo the rows after the first `keep` (0 <= keep <= n) in every cache."""
        if not 0 <= keep <= self.n:
            raise ValueError(f"keep {keep} of a journal of {self.n} rows")
        if keep == self.n:
            return
        undo = self.positions[keep:]
        for c, (window, tokens, comp) in zip(self.caches, self.marks):
            c.window[undo % c.window.shape[0]] = window[keep:]
            c.tokens = self.pos0 + keep if keep else tokens
            for s, m in zip((c.compressor, c.indexer), comp):
                if s is None:
                    continue
                s.kv[undo % s.ratio] = m.kv[keep:]
                s.gate[undo % s.ratio] = m.gate[keep:]
                closed_late = bool(np.any(undo % s.ratio == s.ratio - 1))
                if closed_late:                      # the later rows closed a window: reopen it
                    s.n_rows = m.n_rows
                    s.prev_kv[:] = m.prev_kv
                    s.prev_gate[:] = m.prev_gate
                    if m.row is not None:
                        s.rows[m.n_rows] = m.row
