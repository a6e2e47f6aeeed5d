"""Token windows, the Grain training iterator (determinism, resume, multi-process shares), eval batches, baseline."""

import json
import math

import numpy as np
import pytest

from systolic.data.corpus import Document
from systolic.data.text import (
    TokenWindows,
    encode_documents,
    make_eval_batches,
    make_train_iterator,
    unigram_cross_entropy,
)
from systolic.data.tokenizer import ByteTokenizer
from systolic.errors import UserError

SEQ = 4


def _tokens(num_windows, extra=1):
    # Token t has value t, so a window's first input divided by SEQ is its window index.
    return np.arange(num_windows * SEQ + extra, dtype=np.uint16)


def _window_ids(batch):
    return (batch["inputs"][:, 0] // SEQ).tolist()


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_encode_documents_appends_eot():
    tok = ByteTokenizer()
    tokens = encode_documents([Document("a", "hé"), Document("b", "x")], tok)
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == [104, 195, 169, 256, 120, 256]


def test_windows_are_non_overlapping_and_targets_shift_by_one():
    windows = TokenWindows(_tokens(3, extra=3), SEQ)  # 15 tokens: 3 whole windows, the partial one dropped
    assert len(windows) == 3
    assert windows[1].tolist() == [4, 5, 6, 7, 8]
    assert windows[np.array([2, 0])].tolist() == [[8, 9, 10, 11, 12], [0, 1, 2, 3, 4]]
    assert len(TokenWindows(_tokens(3, extra=0), SEQ)) == 2  # the last window would need one more token
    assert repr(windows) == repr(TokenWindows(_tokens(3, extra=3), SEQ)) != repr(TokenWindows(_tokens(3, extra=4), SEQ))
    with pytest.raises(IndexError):
        windows[3]
    batch = next(make_train_iterator(_tokens(8), seq_len=SEQ, global_batch=4, seed=0))
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    assert batch["inputs"].shape == batch["targets"].shape == (4, SEQ)
    np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)


def test_iterator_is_deterministic_and_seeded():
    first = [_window_ids(b) for b in _take(make_train_iterator(_tokens(50), seq_len=SEQ, global_batch=5, seed=3), 20)]
    again = [_window_ids(b) for b in _take(make_train_iterator(_tokens(50), seq_len=SEQ, global_batch=5, seed=3), 20)]
    other = [_window_ids(b) for b in _take(make_train_iterator(_tokens(50), seq_len=SEQ, global_batch=5, seed=4), 20)]
    assert first == again != other


def test_each_epoch_is_a_new_permutation():
    iterator = make_train_iterator(_tokens(16), seq_len=SEQ, global_batch=8, seed=0)
    epochs = [sum((_window_ids(b) for b in _take(iterator, 2)), []) for _ in range(4)]
    for order in epochs:
        assert sorted(order) == list(range(16))  # every window once per epoch
    assert len({tuple(order) for order in epochs}) == 4


def test_resume_from_json_state_is_exact():
    make = lambda: make_train_iterator(_tokens(37), seq_len=SEQ, global_batch=6, seed=1)  # noqa: E731
    iterator = make()
    _take(iterator, 9)  # crosses an epoch boundary (6 windows per epoch)
    state = json.loads(json.dumps(iterator.get_state()))
    expected = _take(iterator, 10)
    resumed = make()
    assert _window_ids(next(resumed)) != _window_ids(expected[0])  # a fresh iterator really starts elsewhere
    resumed.set_state(state)
    for want, got in zip(expected, _take(resumed, 10), strict=True):
        np.testing.assert_array_equal(want["inputs"], got["inputs"])
        np.testing.assert_array_equal(want["targets"], got["targets"])


def test_processes_share_the_global_batch_and_its_state():
    kwargs = dict(seq_len=SEQ, global_batch=8, seed=2)
    single = make_train_iterator(_tokens(30), **kwargs)
    shards = [make_train_iterator(_tokens(30), **kwargs, process_index=p, process_count=2) for p in range(2)]
    for _ in range(5):
        whole = next(single)
        parts = [next(shard) for shard in shards]
        assert parts[0]["inputs"].shape == (4, SEQ)
        np.testing.assert_array_equal(np.concatenate([p["inputs"] for p in parts]), whole["inputs"])
    # A state saved with one process count resumes the same global batches under another.
    assert shards[0].get_state() == shards[1].get_state() == single.get_state()
    state = json.loads(json.dumps(single.get_state()))
    whole = next(single)
    resumed = [make_train_iterator(_tokens(30), **kwargs, process_index=p, process_count=2) for p in range(2)]
    for shard in resumed:
        shard.set_state(state)
    np.testing.assert_array_equal(np.concatenate([next(s)["inputs"] for s in resumed]), whole["inputs"])


def test_iterator_user_errors():
    with pytest.raises(UserError, match="too small.*train.batch_size=9"):
        make_train_iterator(_tokens(8), seq_len=SEQ, global_batch=9, seed=0)
    with pytest.raises(UserError, match="not divisible by the number of processes"):
        make_train_iterator(_tokens(8), seq_len=SEQ, global_batch=6, seed=0, process_count=4)


def test_eval_batches_are_fixed_and_spread_evenly():
    batches = make_eval_batches(_tokens(20), seq_len=SEQ, batch=3, num_batches=2)
    assert [_window_ids(b) for b in batches] == [[0, 3, 6], [10, 13, 16]]
    again = make_eval_batches(_tokens(20), seq_len=SEQ, batch=3, num_batches=2)
    for a, b in zip(batches, again, strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
        np.testing.assert_array_equal(a["targets"], a["inputs"] + 1)
    # Fewer windows than batch * num_batches: as many whole batches as fit.
    assert [_window_ids(b) for b in make_eval_batches(_tokens(7), seq_len=SEQ, batch=3, num_batches=5)] == [
        [0, 1, 2],
        [3, 4, 5],
    ]
    # Fewer windows than one batch: one batch of overlapping windows from the first token to the last window's.
    (short,) = make_eval_batches(_tokens(2), seq_len=SEQ, batch=3, num_batches=1)
    assert short["inputs"][:, 0].tolist() == [0, 2, 4] and short["targets"][-1, -1] == 8
    with pytest.raises(UserError, match="validation split is too small.*fewer than one window.*data.val_percent"):
        make_eval_batches(_tokens(0, extra=SEQ), seq_len=SEQ, batch=3, num_batches=1)


def test_unigram_cross_entropy_by_hand():
    train = np.array([0, 0, 1], np.uint16)  # smoothed counts over 3 ids: [3, 2, 1] / 6
    val = np.array([0, 2], np.uint16)
    expected = -(math.log(3 / 6) + math.log(1 / 6)) / 2
    assert unigram_cross_entropy(train, val, vocab_size=3) == pytest.approx(expected, rel=1e-12)
