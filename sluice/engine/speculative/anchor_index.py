"""Hashed anchors -> the positions that follow them: the suffix proposer's index.

An anchor is the n tokens right before a position, for a few fixed n (say 4 and 16).
Each anchor's hash maps to the positions that followed its occurrences, newest last,
at most `cap` of them. Finding where the end of a sequence occurred before is then
one dictionary lookup per anchor length, and at most `cap` candidates to compare
token by token, whatever the size of the corpus; a hash collision costs nothing but
a candidate whose tokens do not match.

Why anchors and not a suffix tree or a suffix automaton: both find the longest match
exactly, but a Python node per token (or per token and depth) costs hundreds of
bytes, and neither lets a request's text be taken out again without a rebuild, which
a store evicting by request needs. Here removing a sequence walks its anchors once,
and memory is one entry per position and anchor length. What the cap costs: a match
whose anchor occurred more than `cap` times since is not seen, so longer anchors are
looked up first (a long anchor rarely repeats that often), and frequencies are
counted among the newest `cap` occurrences only.

Positions are plain ints; a store of several sequences packs (segment, offset) into
one with `pack`.
"""

from __future__ import annotations

from collections.abc import Sequence

OFFSET_BITS = 32
_OFFSET_MASK = (1 << OFFSET_BITS) - 1


def pack(segment: int, offset: int) -> int:
    return segment << OFFSET_BITS | offset


def unpack(position: int) -> tuple[int, int]:
    """(segment, offset) of a packed position."""
    return position >> OFFSET_BITS, position & _OFFSET_MASK


class AnchorIndex:
    """For each anchor length n: hash of n tokens -> the positions right after them.

    A key holds a bare int while it has one position (most long anchors occur once)
    and a list, newest last, once it has more."""

    def __init__(self, lengths: Sequence[int], cap: int) -> None:
        if not lengths or min(lengths) < 1 or cap < 1:
            raise ValueError(f"need anchor lengths >= 1 and cap >= 1, got {lengths}, {cap}")
        self.lengths = tuple(sorted(set(lengths), reverse=True))  # longest first
        self.cap = cap
        self.maps: dict[int, dict[int, int | list[int]]] = {n: {} for n in self.lengths}
        self.num_positions = 0  # positions held, over all lengths

    def add(self, tokens: Sequence[int], start: int, end: int, segment: int = 0) -> None:
        """Index positions start..end-1 of `tokens` (each under the anchors ending
        right before it; the caller knows the token at each position)."""
        for n in self.lengths:
            positions = self.maps[n]
            for j in range(max(start, n), end):
                self._insert(positions, hash(tuple(tokens[j - n : j])), pack(segment, j))

    def remove(self, tokens: Sequence[int], segment: int) -> None:
        """Forget every position of a sequence indexed whole with `add` (those the cap
        dropped already are simply not found)."""
        for n in self.lengths:
            positions = self.maps[n]
            for j in range(n, len(tokens)):
                self._delete(positions, hash(tuple(tokens[j - n : j])), pack(segment, j))

    def lookup(self, context: Sequence[int], n: int) -> list[int]:
        """Positions that followed the last n tokens of `context` (or a hash
        collision), newest first; at most `cap`."""
        if len(context) < n:
            return []
        found = self.maps[n].get(hash(tuple(context[len(context) - n :])))
        if found is None:
            return []
        return [found] if isinstance(found, int) else found[::-1]

    def _insert(self, positions: dict[int, int | list[int]], key: int, pos: int) -> None:
        held = positions.get(key)
        self.num_positions += 1
        if held is None:
            positions[key] = pos
        elif isinstance(held, int):
            positions[key] = [held, pos]
        else:
            held.append(pos)
            if len(held) > self.cap:
                del held[0]
                self.num_positions -= 1

    def _delete(self, positions: dict[int, int | list[int]], key: int, pos: int) -> None:
        held = positions.get(key)
        if held is None:
            return
        if isinstance(held, int):
            if held == pos:
                del positions[key]
                self.num_positions -= 1
            return
        if pos in held:
            held.remove(pos)
            self.num_positions -= 1
            if len(held) == 1:
                positions[key] = held[0]
