"""The order in which one token's expert requests reach the cache: one piece of code for the
engine's streamer and for the cache lab's replay, so a replay reproduces a run's hit rate.

    token start   cache.at(t, -1); the hash layers' experts, all at once (known from the token id)
    each layer l  cache.at(t, l); a learned layer's experts, once the router has chosen them;
                  the layer's keys stay protected from eviction until its experts have run
"""
from __future__ import annotations

from typing import Sequence

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
