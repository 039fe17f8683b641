"""The order in which one token's expert requests reach the cache: one piece of code for the
engine's streamer and for the cache lab's replay, so a replay reproduces a run's hit rate.

    token start   cache.at(t, -1); the hash layers' experts, all at once (known from the token id)
    each layer l  cache.at(t, l); a learned layer's experts, once the router has chosen them;
                  the layer's keys stay protected from eviction until its experts have run
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

TOKEN_START = -1  # the position of the token-start requests


def token_request_order(n_layers: int, n_hash_layers: int) -> list[int]:
    """The layers in the order their requests reach the cache within a token. The hash layers
    are the first ones and are requested at token start, so this is simply layer order."""
    return list(range(n_hash_layers)) + list(range(n_hash_layers, n_layers))


class TokenRequests:
    """Drives a cache (ExpertCache or its bookkeeping) through one token's requests.

        req = TokenRequests(cache, n_layers, n_hash_layers)
        req.start(t, hash_ids)          # {layer: ids} of the hash layers -> {layer: [(slot, hit)]}
        for layer in range(n_layers):
            req.enter(layer)
            pairs = req.request(layer, ids)     # learned layers (hash layers: the start's pairs)
            ...                                 # compute
            req.leave(layer, ids)
    """

    def __init__(self, cache, n_layers: int, n_hash_layers: int) -> None:
        self.cache = cache
        self.n_layers = n_layers
        self.n_hash_layers = n_hash_layers
        self.protected: set = set()   # keys the current token still needs
        self._token = 0
        self._at_start: dict[int, list] = {}

    def start(self, token: int, hash_ids: dict[int, Sequence[int]]) -> dict[int, list]:
        self._token = token
        self.protected = set()
        self.cache.at(token, TOKEN_START)
        self._at_start = {layer: self.cache.request([(layer, int(e)) for e in hash_ids[layer]], self.protected)
                          for layer in range(self.n_hash_layers)}
        return self._at_start

    def enter(self, layer: int) -> None:
        self.cache.at(self._token, layer)

    def request(self, layer: int, ids: Sequence[int]) -> list:
        """(slot, hit) per expert, routing-rank order."""
        if layer < self.n_hash_layers:
            return self._at_start[layer]
        return self.cache.request([(layer, int(e)) for e in ids], self.protected)

    def leave(self, layer: int, ids: Sequence[int]) -> None:
        self.protected.difference_update((layer, int(e)) for e in ids)


# ---- a chunk of prompt tokens, layer by layer (prefill) ----------------------------------------
#
#     chunk start   nothing: every layer's experts depend on the layer before
#     each layer l  the distinct experts the chunk's tokens chose (first appearance: token order,
#                   then rank order), requested in batches of at most half the cache's slots; the
#                   next batch is requested (its reads start) while the current one computes, and a
#                   batch's keys stay protected until its experts have run on every token

def chunk_layer_keys(layer: int, ids: np.ndarray) -> list[tuple[int, int]]:
    """The distinct (layer, expert) keys of a chunk's routing at `layer` (ids: [tokens, top_k]),
    in first-appearance order: token order, then rank order."""
    return list(dict.fromkeys((layer, int(e)) for e in np.asarray(ids).reshape(-1)))


def key_batches(keys: list, n_slots: int) -> list[list]:
    """keys in consecutive batches of at most half the cache (two are resident at once)."""
    size = max(1, n_slots // 2)
    return [keys[i:i + size] for i in range(0, len(keys), size)]


def chunk_layer_requests(cache, protected: set, token: int, layer: int, keys: list,
                         issue=None) -> Iterator[tuple[list, list]]:
    """Drive `cache` through one layer of a chunk: yields (batch keys, issue([(slot, hit)] per key))
    in order, the next batch already requested (and issued: its reads start) when a batch is
    yielded; the caller runs the batch's experts before taking the next one (its keys are
    unprotected then). issue: what the streamer does with a request's pairs (start the misses'
    reads); the cache lab's replay leaves it out."""
    issue = issue or (lambda pairs: pairs)
    cache.at(token, layer)
    batches = key_batches(keys, cache.n_slots)
    pending = [issue(cache.request(b, protected)) for b in batches[:2]]
    for i, batch in enumerate(batches):
        yield batch, pending[i]
        protected.difference_update(batch)
        if i + 2 < len(batches):
            pending.append(issue(cache.request(batches[i + 2], protected)))
