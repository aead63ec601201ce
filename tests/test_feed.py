"""Document feed: epochs, give-back order, resume state, out-of-data, round cutting."""

from __future__ import annotations

import pytest

from jaxrl.data.feed import DocumentFeed, OutOfDataError, cut_rounds


def test_epochs_cover_every_document_once():
    feed = DocumentFeed(10, seed=3)
    first, second = feed.take(10), feed.take(10)
    assert sorted(first) == list(range(10)) == sorted(second)
    assert first != second  # a new permutation per epoch


def test_give_back_is_served_first_in_order_and_state_round_trips():
    feed = DocumentFeed(7, seed=0)
    taken = feed.take(5)
    feed.give_back(taken[2:])
    state = feed.state_dict()
    again = DocumentFeed(7, seed=0)
    again.load_state_dict(state)
    assert feed.take(6) == again.take(6)
    fresh = DocumentFeed(7, seed=0)
    fresh.take(2)
    assert fresh.take(3) == taken[2:]


def test_finite_feed_runs_out():
    feed = DocumentFeed(4, seed=0, num_epochs=1)
    assert len(feed.take(3)) == 3 and feed.available() == 1
    assert len(feed.take(3)) == 1 and feed.available() == 0


def test_a_step_that_needs_every_id_gets_them_or_a_clear_error():
    """DPO's and KTO's steps (``take_exactly``): all n ids, else no partial step."""
    feed = DocumentFeed(5, seed=0, num_epochs=1)
    assert len(feed.take_exactly(3, step=1, unit="pairs")) == 3
    with pytest.raises(OutOfDataError, match="step 2: the data ran out with 2 pairs available "
                       "for a step of 3"):  # fmt: skip
        feed.take_exactly(3, step=2, unit="pairs")


def test_cut_rounds_follows_fastllm():
    def layout(counts):  # one rank, round m holds counts[m] documents
        return [[list(range(c)) for c in counts]]

    assert cut_rounds(layout([2, 2, 2, 2, 2]), 6) == 3
    assert cut_rounds(layout([3, 3, 3]), 5) == 2
    assert cut_rounds(layout([4, 4]), 5) == 2
    assert cut_rounds(layout([3, 1, 2, 4]), 5) == 3
    two_ranks = [[[0, 1], [2]], [[3], [4, 5]]]  # rounds sum to 3 and 3
    assert cut_rounds(two_ranks, 4) == 2
