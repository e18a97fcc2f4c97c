"""No save is lost silently: the scheduler's save book (``kvpool.connector.save_book``) and the worker's
``SaveReport`` (``kvpool.connector.meta``): a key counts as saved only once committed; a failed one is planned
again, at most ``max_attempts`` times; a planned key without an outcome is wanted again after ``in_flight_s``."""

from __future__ import annotations

import pytest

from kvpool.connector.save_book import SaveBook

pytest.importorskip("vllm")

from kvpool.connector.meta import SaveReport  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_saved_only_on_commit_failures_retried_then_given_up() -> None:
    book = SaveBook(max_attempts=2, in_flight_s=60.0, clock=Clock())
    a, b = b"a" * 16, b"b" * 16
    assert book.wanted(a)
    book.planned([a, b])
    assert not book.wanted(a) and not book.is_saved(a) and book.in_flight == 2  # in flight: not planned twice
    book.outcome(saved=[a], failed=[b])
    assert book.is_saved(a) and not book.wanted(a)
    assert book.wanted(b) and book.failed_before(b)  # planned again (also from a held copy)
    book.planned([b])
    assert book.stats.retried == 1
    book.outcome(saved=[], failed=[b])
    assert not book.wanted(b) and book.stats.given_up == 1  # bounded
    assert (book.stats.planned, book.stats.committed, book.stats.failed) == (3, 1, 2)


def test_a_saved_key_the_shard_lost_is_wanted_again() -> None:
    book = SaveBook()
    a, b = b"a" * 16, b"b" * 16
    book.planned([a])
    book.outcome(saved=[a], failed=[])
    assert not book.wanted(a)
    assert book.forget([a, b]) == 1 and book.stats.lost == 1  # b was never saved: nothing to forget
    assert book.wanted(a) and not book.is_saved(a) and not book.failed_before(a)


def test_a_planned_key_without_an_outcome_is_wanted_again_later() -> None:
    clock = Clock()
    book = SaveBook(in_flight_s=10.0, clock=clock)
    book.planned([b"k"])
    clock.t = 9.0
    assert not book.wanted(b"k")
    clock.t = 10.5
    assert book.wanted(b"k") and book.stats.expired == 1


def test_the_book_is_bounded() -> None:
    book = SaveBook(capacity=3)
    book.planned([bytes([i]) for i in range(5)])
    book.outcome(saved=[bytes([i]) for i in range(5)], failed=[])
    assert [book.is_saved(bytes([i])) for i in range(5)] == [False, False, True, True, True]


def test_save_reports_of_two_ranks_aggregate_to_saved_only_where_no_rank_failed() -> None:
    r0 = SaveReport(saved=[b"a", b"b"], failed=[b"c"])
    r1 = SaveReport(saved=[b"a", b"c"], failed=[b"b"])
    agg = r0.aggregate(r1)
    assert agg.saved == [b"a"] and sorted(agg.failed) == [b"b", b"c"]


def test_a_key_never_attempted_spends_no_attempt() -> None:
    book = SaveBook(max_attempts=1)
    a = b"a" * 16
    for _ in range(3):  # skipped again and again (the shard restarting): always wanted again
        book.planned([a])
        assert not book.wanted(a)
        book.outcome(saved=[], failed=[], skipped=[a])
        assert book.wanted(a) and not book.failed_before(a)
    assert book.stats.skipped == 3 and book.stats.given_up == 0
    r = SaveReport(saved=[a], failed=[]).aggregate(SaveReport(saved=[], failed=[], skipped=[a]))
    assert (r.saved, r.failed, r.skipped) == ([], [], [a])  # one rank did not write its part: not saved
