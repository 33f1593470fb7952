"""Top-k with ties broken exactly as torch.topk on the CPU breaks them.

transformers routes tokens with torch.topk, and equal router probabilities do happen
(experts with equal router rows, probabilities that round to the same float). torch's
CPU kernel (ATen's topk_impl_loop) runs std::partial_sort on (value, index) pairs when
k * 64 <= n, else std::nth_element and std::sort on the first k - 1; the order
among equal values is whatever those libstdc++ algorithms leave. No stable rule
(lowest index first, ...) reproduces it, so this module replays the same algorithms
step by step on the same comparator (checked against the installed torch by
tests/graphs/test_moe.py). Slow (pure Python); the router only calls it for
rows whose top-k boundary or order holds a tie.
"""

from __future__ import annotations

from collections.abc import Sequence

Pair = tuple[float, int]


def _gt(a: Pair, b: Pair) -> bool:
    # torch's comparator for largest=True: by value only, indices never compared
    return a[0] > b[0]


# -- heap (libstdc++ __adjust_heap / __push_heap, "greater" ordering) -------------------


def _push_up(q: list[Pair], first: int, hole: int, top: int, value: Pair) -> None:
    parent = (hole - 1) // 2
    while hole > top and _gt(q[first + parent], value):
        q[first + hole] = q[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    q[first + hole] = value


def _adjust(q: list[Pair], first: int, hole: int, length: int, value: Pair) -> None:
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if _gt(q[first + child], q[first + child - 1]):
            child -= 1
        q[first + hole] = q[first + child]
        hole = child
    if length % 2 == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        q[first + hole] = q[first + child - 1]
        hole = child - 1
    _push_up(q, first, hole, top, value)


def _make_heap(q: list[Pair], first: int, last: int) -> None:
    length = last - first
    if length < 2:
        return
    parent = (length - 2) // 2
    while True:
        _adjust(q, first, parent, length, q[first + parent])
        if parent == 0:
            return
        parent -= 1


def _pop_heap(q: list[Pair], first: int, last: int, result: int) -> None:
    value = q[result]
    q[result] = q[first]
    _adjust(q, first, 0, last - first, value)


def _sort_heap(q: list[Pair], first: int, last: int) -> None:
    while last - first > 1:
        last -= 1
        _pop_heap(q, first, last, last)


# -- introselect / introsort ----------------------------------------------------------


def _lg(n: int) -> int:
    return n.bit_length() - 1


def _median_to_first(q: list[Pair], result: int, a: int, b: int, c: int) -> None:
    if _gt(q[a], q[b]):
        if _gt(q[b], q[c]):
            pick = b
        elif _gt(q[a], q[c]):
            pick = c
        else:
            pick = a
    elif _gt(q[a], q[c]):
        pick = a
    elif _gt(q[b], q[c]):
        pick = c
    else:
        pick = b
    q[result], q[pick] = q[pick], q[result]


def _partition_pivot(q: list[Pair], first: int, last: int) -> int:
    _median_to_first(q, first, first + 1, first + (last - first) // 2, last - 1)
    pivot, lo, hi = first, first + 1, last
    while True:
        while _gt(q[lo], q[pivot]):
            lo += 1
        hi -= 1
        while _gt(q[pivot], q[hi]):
            hi -= 1
        if not lo < hi:
            return lo
        q[lo], q[hi] = q[hi], q[lo]
        lo += 1


def _linear_insert(q: list[Pair], last: int) -> None:
    value = q[last]
    prev = last - 1
    while _gt(value, q[prev]):
        q[last] = q[prev]
        last = prev
        prev -= 1
    q[last] = value


def _insertion_sort(q: list[Pair], first: int, last: int) -> None:
    if first == last:
        return
    for i in range(first + 1, last):
        if _gt(q[i], q[first]):
            value = q[i]
            q[first + 1 : i + 1] = q[first:i]
            q[first] = value
        else:
            _linear_insert(q, i)


def _heap_select_sort(q: list[Pair], first: int, middle: int, last: int) -> None:
    """libstdc++ __partial_sort: heap-select the best (middle - first), then sort them."""
    _make_heap(q, first, middle)
    for i in range(middle, last):
        if _gt(q[i], q[first]):
            _pop_heap(q, first, middle, i)
    _sort_heap(q, first, middle)


def _nth_element(q: list[Pair], nth: int) -> None:
    first, last = 0, len(q)
    if nth == last:
        return
    depth = _lg(last - first) * 2
    while last - first > 3:
        if depth == 0:
            # libstdc++ __heap_select over [first, nth + 1), then the nth into place
            _make_heap(q, first, nth + 1)
            for i in range(nth + 1, last):
                if _gt(q[i], q[first]):
                    _pop_heap(q, first, nth + 1, i)
            q[first], q[nth] = q[nth], q[first]
            return
        depth -= 1
        cut = _partition_pivot(q, first, last)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _insertion_sort(q, first, last)


def _sort(q: list[Pair], first: int, last: int) -> None:
    if first == last:
        return
    threshold = 16

    def loop(first: int, last: int, depth: int) -> None:
        while last - first > threshold:
            if depth == 0:
                _heap_select_sort(q, first, last, last)
                return
            depth -= 1
            cut = _partition_pivot(q, first, last)
            loop(cut, last, depth)
            last = cut

    loop(first, last, _lg(last - first) * 2)
    if last - first > threshold:
        _insertion_sort(q, first, first + threshold)
        for i in range(first + threshold, last):
            _linear_insert(q, i)
    else:
        _insertion_sort(q, first, last)


def topk_torch_cpu(values: Sequence[float], k: int) -> list[int]:
    """Indices of the k largest values, in the order torch.topk(sorted=True) returns them."""
    n = len(values)
    q: list[Pair] = [(float(v), j) for j, v in enumerate(values)]
    if k * 64 <= n:  # std::partial_sort
        _heap_select_sort(q, 0, k, n)
        return [j for _, j in q[:k]]
    _nth_element(q, k - 1)
    _sort(q, 0, k - 1)
    return [j for _, j in q[:k]]
