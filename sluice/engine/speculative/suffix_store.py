"""The suffix proposer's memory of earlier requests: their prompts and outputs.

Agents and coding tools send the same files, tool outputs and boilerplate over and
over, and a model answering them repeats spans it wrote before; a request can draft
from them only if finished requests' text is kept somewhere. This store keeps it,
whole requests at a time, least recently used first out, at most `max_tokens` tokens
in all: every token costs 4 bytes in its segment (an `array('i')`) plus one index
entry per anchor length (an int key and position in a dict, about 130 bytes), so
memory is bounded by the budget, not by the traffic. A segment that drafts is
touched, so text that keeps paying stays while text nobody repeats ages out.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

from sluice.engine.speculative.anchor_index import AnchorIndex


class SuffixStore:
    """Finished sequences (segments, ids from 1), indexed by anchors, LRU-bounded."""

    def __init__(self, max_tokens: int, anchor_lengths: Sequence[int], cap: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.max_tokens = max_tokens
        self.index = AnchorIndex(anchor_lengths, cap)
        self.segments: OrderedDict[int, array[int]] = OrderedDict()
        self.num_tokens = 0
        self.num_evicted = 0
        self._next_id = 1

    def add(self, tokens: Sequence[int]) -> int | None:
        """Keep a finished sequence (its last max_tokens tokens), evicting the least
        recently used ones past the budget; its segment id (None if too short to
        ever match anything)."""
        if len(tokens) <= min(self.index.lengths):
            return None
        segment = array("i", tokens[max(0, len(tokens) - self.max_tokens) :])
        sid = self._next_id
        self._next_id += 1
        self.segments[sid] = segment
        self.num_tokens += len(segment)
        self.index.add(segment, 0, len(segment), sid)
        while self.num_tokens > self.max_tokens:
            self._evict_oldest()
        return sid

    def touch(self, sid: int) -> None:
        """A segment was used: it becomes the last to be evicted."""
        if sid in self.segments:
            self.segments.move_to_end(sid)

    def _evict_oldest(self) -> None:
        sid, segment = self.segments.popitem(last=False)
        self.num_tokens -= len(segment)
        self.num_evicted += 1
        self.index.remove(segment, sid)
